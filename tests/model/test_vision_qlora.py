"""QLoRA on vision-language models (finetune/model/loading.py, vision.quantization_skips): the language model's
linear layers in 4-bit NF4, the vision encoder and projector unquantized, a LoRA on the language model that trains
on rows with images, the fused loss equal to the model's own on the quantized model, and `finetune merge` of a VLM
QLoRA run (tiny random Qwen2-VL and LLaVA from vision_fixtures, in-process, on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import needs
from vision_fixtures import model_config, recipe_yaml, tokenizer_config, write_data

from finetune.data.collate import collate
from finetune.data.formats import MessageFields, to_example
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import AdapterConfig, DataConfig, load_recipe

# (vision encoder, projector) of each family, as PEFT names them under its wrapper.
VISION_SIDE = {"qwen2_vl": ("base_model.model.model.visual.", "base_model.model.model.visual.merger."),
               "llava": ("base_model.model.model.vision_tower.", "base_model.model.model.multi_modal_projector.")}
LANGUAGE = "base_model.model.model.language_model."
# The fused loss and the model's own forward run the same 4-bit layers in float32: they differ by float summation
# order only (measured: at most 7e-8 relative, Qwen2-VL, LLaVA, Gemma 3, SmolVLM).
LOSS_TOLERANCE = 1e-5


def _batch(tok, folder):
    """A padded micro-batch of 6 rows of vision_fixtures.image_rows: 0, 1 or 2 images each, of four sizes."""
    data = write_data(folder, n=6)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    samples = [tokenize_example(to_example(RawRow(row, f"t.jsonl:{i}"), "chat",
                                           fields=MessageFields(image_root=str(folder))), tok)
               for i, row in enumerate(rows)]
    return collate(samples, DataConfig(packing=False), tok.pad_token_id).to("cpu")


def _linears(model, prefix: str) -> dict[str, type]:
    """name -> class of every linear layer (plain or 4-bit) under `prefix`, the adapter's own left out."""
    return {name: type(m) for name, m in model.named_modules() if name.startswith(prefix) and "lora_" not in name
            and isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_qlora_quantizes_the_language_model_only_and_trains_on_image_rows(tmp_path, family):
    """Every linear layer of the language model is Linear4bit, none of the vision encoder's or projector's is, the
    output layer is a float32 nn.Linear; the fused loss equals the model's own (4-bit) loss; four steps at a high
    lr on rows with images lower the loss, move the adapter and leave every base weight as it was."""
    bnb = needs("bitsandbytes")
    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    cfg = model_config(family, gradient_checkpointing=family == "qwen2_vl")
    lm = load_model(cfg, AdapterConfig(type="qlora", r=8, target_modules="all-linear"), tok, seed=0)
    tower, projector = VISION_SIDE[family]
    language = _linears(lm, LANGUAGE)
    assert len(language) == 2 * 7 and all(cls is bnb.nn.Linear4bit for cls in language.values()), language
    vision = _linears(lm, tower) | _linears(lm, projector)
    assert _linears(lm, projector) and vision and all(cls is torch.nn.Linear for cls in vision.values()), vision
    head = lm.get_base_model().get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    trained = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n and n.startswith(LANGUAGE) for n in trained), trained

    batch = _batch(tok, tmp_path)
    assert batch.vision is not None and batch.vision.images == 7
    net = CausalLMWithLoss(lm, "chunked", 16, 0.0, None)
    lm.eval()
    with torch.no_grad():
        loss_sum, count = net(**batch.model_inputs())
        own = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                 **batch.vision.inputs).loss
    assert abs(float(loss_sum / count) - float(own)) <= LOSS_TOLERANCE * float(own), (float(loss_sum / count), own)

    base = {n: p.detach().clone() for n, p in lm.named_parameters() if "lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in lm.named_parameters() if "lora_B" in n}
    optimizer = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=3e-3)
    lm.train()
    losses = []
    for _ in range(4):
        loss_sum, count = net(**batch.model_inputs())
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((loss_sum / count).item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    now = dict(lm.named_parameters())
    assert all(not torch.equal(now[n], a) for n, a in adapter.items())
    assert all(torch.equal(now[n], b) for n, b in base.items())  # 4-bit bytes, vision side, head: all untouched


def test_merge_of_a_vlm_qlora_run_loads_as_image_text_to_text(tmp_path):
    """`finetune merge` of a Qwen2-VL QLoRA run: the base is loaded unquantized, the merged directory loads with
    AutoModelForImageTextToText (no 4-bit layer, no quantization config) and computes what the unquantized base with
    the adapter computes on rows with images."""
    needs("bitsandbytes")
    from transformers import AutoModelForImageTextToText

    from finetune.commands.merge import merge_run
    from finetune.model.loading import load_base
    from finetune.run.trained import load_trained
    from finetune.train.loop import train

    data = write_data(tmp_path / "data", n=4)
    (tmp_path / "vlm.yaml").write_text(recipe_yaml(data))
    recipe = load_recipe(tmp_path / "vlm.yaml", [f"output_dir={tmp_path / 'run'}", "train.max_steps=2",
                                                 "train.lr=1e-2", "adapter.type=qlora", "adapter.r=4"])
    train(recipe)
    merged_dir = merge_run(str(tmp_path / "run"))
    merged = AutoModelForImageTextToText.from_pretrained(str(merged_dir)).eval()
    assert type(merged).__name__ == "Qwen2VLForConditionalGeneration"
    assert getattr(merged.config, "quantization_config", None) is None
    assert all(type(m) in (torch.nn.Linear,) for m in merged.modules() if isinstance(m, torch.nn.Linear))
    assert (merged_dir / "preprocessor_config.json").is_file()

    adapted, tok = load_trained(tmp_path / "run")
    batch = _batch(tok, tmp_path / "data")
    with torch.inference_mode():
        losses = [float(m(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                          **batch.vision.inputs).loss)
                  for m in (merged, adapted, load_base(recipe.model, tok, recipe.seed))]
    got, want, base = losses
    # float32: W + s * B @ A (merged) against W x + s * B (A x) (the adapter) differ by float rounding only.
    assert abs(got - want) <= 1e-5 * want, (got, want)
    assert abs(base - want) > 1e-3 * want, (base, want)  # the adapter changed the loss: the check has teeth
