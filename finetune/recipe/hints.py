"""Hints for a key written where the recipe does not have it: a key of another section (`max_steps` ->
`train.max_steps`), a name another tool uses (`learning_rate` -> `train.lr`), a command-line option that is a recipe
key (`--max-steps 3` -> `train.max_steps=3`). validation.py words the unknown-key error with them; cli.py the
unknown option.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

from pydantic import BaseModel

from finetune.recipe.schema import Recipe

# Names users bring from transformers' TrainingArguments, TRL and Axolotl -> the finetune key (and a note when the
# value changes form). tests/recipe/test_hints.py checks that every target is a key of the schema.
FOREIGN: dict[str, tuple[str, str]] = {
    "learning_rate": ("train.lr", ""),
    "per_device_train_batch_size": ("train.micro_batch_size", ""),
    "train_batch_size": ("train.micro_batch_size", " (rows per forward; the step is micro x accumulation x ranks)"),
    "batch_size": ("train.micro_batch_size", " (rows per forward; the step is micro x accumulation x ranks)"),
    "num_train_epochs": ("train.epochs", ""),
    "num_epochs": ("train.epochs", ""),
    "lr_scheduler_type": ("train.lr_scheduler", ""),
    "optim": ("train.optimizer", ""),
    "adam_epsilon": ("train.adam_eps", ""),
    "adam_beta1": ("train.adam_betas", " ([beta1, beta2])"),
    "adam_beta2": ("train.adam_betas", " ([beta1, beta2])"),
    "max_seq_length": ("data.max_seq_len", ""),
    "max_length": ("data.max_seq_len", ""),
    "sequence_len": ("data.max_seq_len", ""),
    "sample_packing": ("data.packing", ""),
    "val_set_size": ("data.val_fraction", " (a fraction of the training rows)"),
    "dataset_prepared_path": ("data.cache_dir", ""),
    "save_steps": ("checkpoint.every_steps", ""),
    "save_total_limit": ("checkpoint.keep_last", ""),
    "eval_steps": ("eval.every_steps", ""),
    "logging_steps": ("logging.every_steps", ""),
    "resume_from_checkpoint": ("resume", " (auto, or a checkpoint path)"),
    "base_model": ("model.path", ""),
    "model_name_or_path": ("model.path", ""),
    "bf16": ("model.dtype", " (model.dtype: bfloat16)"),
    "fp16": ("model.dtype", " (model.dtype: float16)"),
    "torch_dtype": ("model.dtype", ""),
    "attn_implementation": ("model.attn_implementation", ""),
    "use_liger_kernel": ("model.liger_kernels", ""),
    "lora_r": ("adapter.r", ""),
    "lora_alpha": ("adapter.alpha", ""),
    "lora_dropout": ("adapter.dropout", ""),
    "lora_target_modules": ("adapter.target_modules", ""),
    "chat_template": ("tokenizer.chat_template", ""),
    "num_generations": ("grpo.num_generations", ""),
    "max_completion_length": ("grpo.max_new_tokens", ""),
    "reward_funcs": ("grpo.rewards", " (a list of {function: ...})"),
}


@functools.cache
def _leaves() -> dict[str, list[str]]:
    """Each key name of the schema -> the dotted keys it is (a list: `beta` is dpo's, orpo's and grpo's)."""
    out: dict[str, list[str]] = {}

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, info in cls.model_fields.items():
            dotted = f"{prefix}{name}"
            out.setdefault(name, []).append(dotted)
            inner = _section(info.annotation)
            if inner is not None:
                walk(inner, f"{dotted}[]." if _is_list(info.annotation) else f"{dotted}.")

    walk(Recipe, "")
    return out


def _section(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_list(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is list


def elsewhere(name: str, here: str) -> list[str]:
    """The dotted keys called `name` in other sections than `here` (a dotted section, '' for the top level)."""
    inside = f"{here}." if here else ""
    return [k for k in _leaves().get(name, []) if not (k.startswith(inside) and "." not in k[len(inside):])]


def suggest(name: str, here: str, known: list[str]) -> str:
    """The hint after "unknown key" for `name` in section `here` whose keys are `known`: a close sibling, the section
    that has this key, the finetune name of another tool's key; else the keys there are."""
    guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if guess:
        return f"did you mean '{guess[0]}'?"
    other = elsewhere(name, here)
    if other:
        return f"did you mean {' or '.join(repr(k) for k in other)}? ({name} is a key of another section)"
    if name in FOREIGN:
        key, note = FOREIGN[name]
        return f"did you mean '{key}'{note}? ({name} is another tool's name for it)"
    return f"known keys here: {', '.join(known)}"


def key_for_option(option: str) -> str | None:
    """The recipe key a command-line option like `--max-steps` or `--learning_rate` means, if one does."""
    name = option.lstrip("-").split("=", 1)[0].replace("-", "_")
    if "." in name:  # --train.lr: already a dotted key
        return name if name.split(".")[-1] in _leaves() else None
    keys = [k for k in _leaves().get(name, []) if "[]" not in k]
    if len(keys) == 1:
        return keys[0]
    return FOREIGN[name][0] if name in FOREIGN else None
