"""model.experts_implementation: how transformers runs a mixture-of-experts model's fused experts (grouped_mm, eager,
batched_mm), checked before loading and read back from the loaded model for the run log and record."""

from __future__ import annotations

from typing import Any

import torch

from finetune.errors import UserError
from finetune.model import vision
from finetune.recipe import ModelConfig


def experts_implementation(model: torch.nn.Module) -> str | None:
    """How the model runs its fused experts (grouped_mm, eager, batched_mm), or None for a model without them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not type(base)._can_set_experts_implementation():
        return None
    return base.config._experts_implementation


def check_setting(cfg: ModelConfig, auto_class: Any) -> None:
    """model.experts_implementation set on a model without fused experts: an error before loading, rather than
    transformers' ValueError for grouped_mm (or, for eager, a setting that silently does nothing). `auto_class`:
    the transformers Auto class the model loads through."""
    from transformers import AutoConfig

    model_type = (cfg.config or {}).get("model_type")
    try:
        config = AutoConfig.for_model(model_type) if model_type else vision.model_config(cfg)
        model_class = auto_class._model_mapping[type(config)]
    except (KeyError, ValueError):  # no config to read (GGUF), or remote code: transformers decides when it loads
        return
    if not model_class._can_set_experts_implementation():
        raise UserError(f"model.experts_implementation: {cfg.experts_implementation}, but {model_class.__name__} has "
                        "no fused experts to run another way (transformers' experts implementations are for "
                        "mixture-of-experts models); leave it at auto")
