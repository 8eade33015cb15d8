"""A finished run's model, ready for inference: what `finetune eval RUN`, `generate`, `chat` and `merge` load.

final/ holds either the full trained weights or a LoRA adapter; an adapter goes onto the run's base, rebuilt
from the run's recipe exactly as training loaded it (unquantized, in the recipe's dtype).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError, first_line
from finetune.model import files
from finetune.model.loading import load_base, quiet_peft
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import Recipe, TokenizerConfig
from finetune.run.directory import RunDir, finished_run, read_versions


def load_trained(run_dir: str | Path, recipe: Recipe | None = None, generation: bool = False
                 ) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of a finished run, ready for inference in its recipe's dtype on the CPU: the full
    weights of final/, or the run's base with the adapter of final/ on it; the tokenizer saved with the run.
    `recipe` defaults to the run's own (`finetune eval` passes the run's recipe with the user's overrides);
    `generation`: the tokenizer takes prompts (model/tokenizer.py)."""
    saved, final = finished_run(run_dir)
    recipe = recipe or saved
    files.check_model_dir(final, files.FINAL)  # a damaged file named before anything reads it
    tokenizer = load_tokenizer(TokenizerConfig(path=str(final), backend=recipe.tokenizer.backend), recipe.model,
                               generation)
    if has_adapter(final):
        return load_adapted_model(run_dir, final, recipe, tokenizer), tokenizer
    trained = recipe.model.model_copy(update={"path": str(final), "init": "pretrained", "gguf_file": None})
    return load_base(trained, tokenizer, recipe.seed, key=files.FINAL, score_head=is_reward_model(recipe)), tokenizer


def is_reward_model(recipe: Recipe) -> bool:
    """Whether the run trained a reward model (train.objective: reward): its final/ is a sequence classifier."""
    return recipe.train.objective == "reward"


def has_adapter(final: Path) -> bool:
    return (final / "adapter_config.json").is_file()


def load_adapted_model(run_dir: str | Path, final: Path, recipe: Recipe, tokenizer: Any) -> torch.nn.Module:
    """The run's base (rebuilt unquantized in the recipe's dtype) with the adapter from `final` on it, for
    inference. A random-init base is rebuilt from the recipe's config and seed, which needs the torch and
    transformers versions the run used (recorded in versions.json): checked here."""
    from peft import PeftModel

    files.check_model_dir(final, files.FINAL)  # before the base loads: `finetune merge` comes here directly
    if recipe.model.init == "random":
        check_rebuild_versions(Path(run_dir))
    base = load_base(recipe.model, tokenizer, recipe.seed, score_head=is_reward_model(recipe))
    try:
        with quiet_peft(), files.load_errors(final, files.FINAL):
            return PeftModel.from_pretrained(base, str(final)).eval()
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{final}: the adapter does not load onto the run's base model "
                        f"({type(e).__name__}: {first_line(e)})") from None


def check_rebuild_versions(run_dir: Path) -> None:
    """A random-init base is not stored: it is rebuilt from its seed, which gives the same weights only with
    the same torch and transformers (their init code and RNG streams). Refuse with the reason otherwise."""
    import transformers

    saved = read_versions(run_dir)
    if saved is None:
        raise UserError(f"{RunDir(run_dir).versions} is missing or unreadable: the random-init base of this run cannot be rebuilt "
                        "safely without knowing the torch/transformers versions it was built with")
    now = {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}
    then = {k: str(saved.get(k) or "").split("+")[0] for k in now}
    if now != then:
        raise UserError(f"this run's base was random-init (not stored; rebuilt from model.config and seed), "
                        f"built with torch {then['torch']}, transformers {then['transformers']}; installed are "
                        f"torch {now['torch']}, transformers {now['transformers']}, which may initialize "
                        "differently. Install the run's versions (see versions.json) to merge or generate.")

