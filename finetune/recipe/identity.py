"""A recipe's identity: what it is as YAML, which optional features it uses, and which of its keys define the
training (what a resume must find unchanged).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from finetune.recipe.schema import Recipe


def features(recipe: Recipe) -> list[str]:
    """The optional features this recipe uses that need an extra package (names of versions.FEATURE_PACKAGES).

    Checked when the recipe is loaded, so a missing package fails at validation time with its install line,
    not an hour into a run.
    """
    used = {
        "liger": recipe.loss.impl == "liger",
        "liger_kernels": recipe.model.liger_kernels is True,  # auto runs without it
        "flash_attention_2": recipe.model.attn_implementation == "flash_attention_2",
        "bnb": recipe.adapter.type == "qlora" or recipe.train.optimizer == "adamw_8bit",
        "gguf": bool(recipe.model.gguf_file) or str(recipe.model.path or "").endswith(".gguf"),
        "tensorboard": recipe.logging.tensorboard,
        "wandb": recipe.logging.wandb,
        "mlflow": recipe.logging.mlflow,
        "mistral_common": recipe.tokenizer.backend == "mistral_common",
        "qat": recipe.qat.weight_dtype is not None,
    }
    return [name for name, on in used.items() if on]


def to_yaml(recipe: Recipe | dict[str, Any]) -> str:
    """The fully resolved recipe (or its dump, a dict) as YAML: what `validate` prints and the run stores."""
    data = recipe.model_dump(mode="json") if isinstance(recipe, Recipe) else recipe
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


# Keys that may change between a checkpoint and its resume without changing the training itself.
HARMLESS_KEYS = ("logging", "eval", "eval_datasets", "checkpoint", "resume", "output_dir", "data.num_proc",
                 "data.packing_check", "data.cache_dir", "requires", "allow_code", "grpo.reward_timeout_s")


def training_keys(recipe: Recipe) -> dict[str, Any]:
    """The flattened recipe minus harmless keys, and minus the settings of objectives it does not train: what
    must match for a resume to continue the same run."""
    unused = [f"{name}." for name in ("dpo", "orpo", "reward", "distill") if recipe.train.objective != name]
    flat = flatten(recipe.model_dump(mode="json"))
    return {k: v for k, v in flat.items() if not any(k == h or k.startswith(h + ".") for h in HARMLESS_KEYS)
            and not k.startswith(tuple(unused))}


def default_training_keys() -> dict[str, Any]:
    """The training keys of a recipe left at every default: what a key that an older finetune did not have
    yet counts as when its checkpoint is resumed."""
    return training_keys(Recipe())


def recipe_hash(recipe: Recipe) -> str:
    """A short hash of the training keys: equal hashes mean a resume continues the same training."""
    blob = json.dumps(training_keys(recipe), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": 1, "datasets.0.path": ...}: lists are indexed, so a change names the one key that changed."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if items is None or not value:
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
