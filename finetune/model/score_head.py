"""A reward model's head: transformers' XForSequenceClassification with one output (`score`), what
train.objective: reward loads (model/loading.py), trains (model/with_score.py) and saves: the standard class that
transformers and TRL load."""

from __future__ import annotations

from typing import Any

import torch

from finetune.errors import UserError

SCORE_HEAD = "score"
"""The head's attribute on transformers' sequence classification models (GenericForSequenceClassification)."""


def score_auto_class(config: Any, vision_family: str | None) -> Any:
    """AutoModelForSequenceClassification, for a text model (`config`: its config when known, else None) whose
    architecture transformers gives that class; a vision-language model, or one without the class, is refused."""
    from transformers import AutoModelForSequenceClassification

    if vision_family is not None:
        raise UserError("train.objective reward: vision-language models are not trained as reward models here; use "
                        "a text model")
    _check_has_class(config)
    return AutoModelForSequenceClassification


def _check_has_class(config: Any) -> None:
    """Refuse a config (None: not known yet) whose architecture has no sequence classification class, neither in
    transformers nor in its remote code."""
    from transformers import AutoModelForSequenceClassification

    if config is None or "AutoModelForSequenceClassification" in (getattr(config, "auto_map", None) or {}):
        return
    if type(config) not in AutoModelForSequenceClassification._model_mapping:
        raise UserError(f"train.objective reward: transformers has no sequence classification class for model_type "
                        f"{getattr(config, 'model_type', '?')!r}; a reward model needs one (e.g. llama, qwen2, "
                        "mistral, gemma)")


def one_label(kwargs: dict[str, Any], seed: int, score_head: bool = True) -> None:
    """from_pretrained's keyword arguments for a reward model (`score_head`; else left alone): one label (on the
    overridden config, when given). Seeds torch: a causal LM's checkpoint has no score head, which then starts from
    seeded random weights."""
    if not score_head:
        return
    if "config" in kwargs:
        _check_has_class(kwargs["config"])
        kwargs["config"].num_labels = 1
    else:
        kwargs["num_labels"] = 1
    torch.manual_seed(seed)


def with_pad_id(model: Any, tokenizer: Any, score_head: bool = True) -> Any:
    """A reward model (`score_head`; else the model as it is) with the tokenizer's pad id on its config:
    transformers' own forward needs it to score padded rows (ours reads each sequence's last token from the batch's
    documents instead: model/with_score.py)."""
    if score_head:
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return model


def is_score_model(model: torch.nn.Module) -> bool:
    """Whether `model` (or the model under its PEFT wrapper) is a sequence classifier with a `score` head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(getattr(base, SCORE_HEAD, None), torch.nn.Module) and base.get_output_embeddings() is None


def score_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder backbone, score head) of a sequence classification model, looking through a PEFT wrapper (whose
    modules_to_save copy of the head is then what runs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, SCORE_HEAD, None)
    backbone = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    if not isinstance(head, torch.nn.Module) or not isinstance(backbone, torch.nn.Module) or backbone is base:
        raise UserError(f"{type(base).__name__} has no decoder and `score` head; train.objective reward needs a "
                        "model whose XForSequenceClassification class transformers defines")
    if getattr(base.config, "num_labels", 1) != 1:
        raise UserError(f"{type(base).__name__} has {base.config.num_labels} labels; a reward model scores with one")
    return backbone, head


def trained_score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The score head, refused when it would not train (train.trainable_parameters leaving it out): it starts from
    random weights whenever the model was a causal LM."""
    head = score_layers(model)[1]
    if not any(p.requires_grad for p in head.parameters()):
        raise UserError("train.trainable_parameters leaves the reward model's score head frozen; it must train (add "
                        "a pattern matching it, e.g. '^score')")
    return head
