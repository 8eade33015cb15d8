"""What tokenizer.backend: mistral_common allows: mistral-common encodes each conversation itself, from a fixed
vocabulary, and only its assistant turns can be located in the tokens (finetune/chat/mistral.py)."""

from __future__ import annotations

from finetune.recipe.schema import DATASET_LISTS, Recipe

_WHY = "tokenizer.backend: mistral_common"


def mistral_common_checks(recipe: Recipe) -> list[str]:
    """The recipe's problems with tokenizer.backend: mistral_common (none for the hf backend)."""
    tok = recipe.tokenizer
    if tok.backend != "mistral_common":
        return []
    problems = []
    if tok.chat_template is not None or tok.chat_template_kwargs:
        problems.append(f"tokenizer.chat_template: not with {_WHY}, which encodes conversations itself "
                        "(there is no Jinja template to replace or give variables to)")
    for key in ("special_tokens", "added_tokens", "added_special_tokens"):
        if getattr(tok, key):
            problems.append(f"tokenizer.{key}: not with {_WHY}: its vocabulary and control tokens are fixed")
    if recipe.train.objective != "sft":
        problems.append(f"train.objective: {recipe.train.objective} is not supported with {_WHY} (sft only)")
    if (recipe.model.gguf_file or (recipe.model.path or "").endswith(".gguf")) and not tok.path:
        problems.append(f"tokenizer.path: {_WHY} reads the tokenizer's tekken.json or tokenizer.model.vN, not a "
                        "GGUF file; point tokenizer.path at the model's directory")
    for key in DATASET_LISTS:
        for i, ds in enumerate(getattr(recipe, key)):
            if ds.format not in ("chat", "completion", "alpaca"):
                problems.append(f"{key}.{i}.format: {ds.format} is not supported with {_WHY} (chat, alpaca or "
                                "completion data)")
            elif ds.roles_to_train != ["assistant"] and ds.format != "completion":
                problems.append(f"{key}.{i}.roles_to_train: with {_WHY} only assistant turns can be trained")
    return problems
