"""`finetune merge RUN_DIR [--out DIR]`: fold a run's LoRA adapter into its base and save a plain HF model.

The base is rebuilt from the run's recipe.yaml exactly as training loaded it (`model.load_base`):

* a pretrained base (HF directory, hub id, GGUF file, pkg://...) is loaded again from `model.path`;
* a random-init base (`model.init: random`) is NOT stored in the run: it is rebuilt from `model.config` and
  `seed`, which is deterministic for the same torch and transformers versions. Those are recorded in the
  run's versions.json and checked; with other versions the merge is refused rather than silently wrong;
* a QLoRA base is loaded unquantized in the recipe's dtype: the adapter was trained against the NF4
  rounding of those weights, and merging into the original weights is the usual choice (a note says so).

A vision-language run's merged directory loads with AutoModelForImageTextToText and holds the image processor training
used (preprocessor_config.json), so `finetune generate DIR --image ...` lays images out as training did.

The merge happens in the recipe's dtype (PEFT computes scale * B @ A in float32 on the CPU, then adds it to W):
no float32 copy of the whole model, which for an 8B model would need 32 GB of RAM.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.errors import UserError
from finetune.model import vision
from finetune.model.loading import DTYPES
from finetune.run.directory import finished_run
from finetune.run.trained import has_adapter, load_adapted_model


def merge_run(run_dir: str, out: str | None = None) -> Path:
    """Merge RUN_DIR/final (a PEFT adapter) into the run's base; write model + tokenizer to `out`
    (default RUN_DIR/merged) and return that directory."""
    from transformers import AutoTokenizer

    recipe, final = finished_run(run_dir)
    if not has_adapter(final):
        raise UserError(f"nothing to merge: {final} holds a full model (the run used adapter.type: none), not a "
                        f"LoRA adapter. Use {final} directly as an HF model directory.")
    target = Path(out).expanduser() if out else Path(run_dir) / "merged"
    if target.resolve() == final.resolve() or target.resolve() == Path(run_dir).resolve():
        raise UserError(f"--out {target} would overwrite the run itself; choose another directory")
    if recipe.adapter.type == "qlora":
        print(f"note: the run trained a QLoRA adapter on a 4-bit NF4 base; merging into the base loaded "
              f"unquantized in {recipe.model.dtype} (the original weights), as is usual for QLoRA.")
    tokenizer = AutoTokenizer.from_pretrained(str(final))  # saved with the run: the recipe's chat template
    vision.attach_layout(tokenizer, recipe.model)  # a vision-language run: the image processor training used
    peft_model = load_adapted_model(run_dir, final, recipe, tokenizer)
    merged = peft_model.merge_and_unload().to(DTYPES[recipe.model.dtype])
    _keep_untied_heads(merged)
    merged.config.use_cache = True
    target.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(target), safe_serialization=True)
    tokenizer.save_pretrained(str(target))
    vision.save_processor(tokenizer, target)  # preprocessor_config.json: the merged model takes images as trained
    return target


def _keep_untied_heads(model: torch.nn.Module) -> None:
    """With tied embeddings and adapter.modules_to_save naming the output layer (or the input embedding), the
    trained copy replaced one of the two: they are no longer the same tensor, and saving them as tied would
    silently throw one away on reload. Mark the config untied so both are written."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or not getattr(model.config, "tie_word_embeddings", False):
        return
    if head.weight.data_ptr() != embed.weight.data_ptr():
        model.config.tie_word_embeddings = False
