"""The MoE router's load-balancing loss, as the model's own forward adds it (`output_router_logits: true`).

transformers' `*ForCausalLM.forward` of a mixture-of-experts model adds `router_aux_loss_coef x
load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)` to its mean cross-entropy
(Switch Transformer's loss: num_experts x sum over experts of the fraction of top-k assignments times the mean
router probability, both over every layer's rows, padding left out where an attention mask says so). The fused loss
never calls that forward, so it adds the same term itself: the backbone returns its router logits and the model's
own module's `load_balancing_loss_func` computes it, with the model's own settings, per forward (micro-batch).

How a step combines the micro-batches' values (a product of two means is not a sum over tokens, so no split of a
step equals one batch exactly) is the loss contract's business (docs/models.md, "The router's load-balancing loss"):
each micro-batch's value weighs its share of the step's target tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

METRIC = "router_aux_loss"
"""The metric the step logs: the token-weighted mean of its micro-batches' load-balancing losses (without the
coefficient)."""

# The model types whose ForCausalLM adds router_aux_loss_coef x load_balancing_loss_func(outputs.router_logits,
# self.num_experts, self.num_experts_per_tok, attention_mask), read in transformers 5.23.0 (qwen3_vl_moe's reads its
# text_config and is a vision model: not here; JetMoE's coefficient is aux_loss_coef). Each is checked against the
# model's own loss and gradients by tests/model/test_router_aux_loss.py; another model type asking for router logits
# is refused with the key to turn them off.
SUPPORTED = ("dbrx", "deepseek_v4", "ernie4_5_moe", "flex_olmo", "flint", "gpt_oss", "granitemoe", "granitemoe_swa",
             "granitemoehybrid", "granitemoeshared", "jamba", "laguna", "mellum", "minimax", "minimax_m2", "mixtral",
             "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next")


@dataclass(frozen=True)
class RouterLoss:
    """One model's load-balancing loss: its coefficient, expert count and top-k, and its module's function."""

    coef: float
    num_experts: int
    top_k: int
    balance: Callable[..., Any]

    def __call__(self, router_logits: tuple[torch.Tensor, ...],
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The micro-batch's load-balancing loss (without the coefficient), float32, in the graph of the router
        logits. `attention_mask` [batch, length] leaves padding out, as the model's forward does; without one (packed
        and padding-free rows) every position counts, as transformers counts them."""
        return self.balance(tuple(router_logits), self.num_experts, self.top_k, attention_mask)


def router_loss(model: torch.nn.Module) -> RouterLoss | None:
    """The load-balancing loss `model`'s own forward adds (its config's output_router_logits is true), or None.
    Read from the loaded ForCausalLM itself (the attributes its forward reads), through a PEFT wrapper."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or getattr(config, "model_type", None) not in SUPPORTED:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    balance = sys.modules[type(base).__module__].load_balancing_loss_func
    return RouterLoss(float(base.router_aux_loss_coef), int(base.num_experts), int(base.num_experts_per_tok), balance)


def refusal(config: Any) -> str | None:
    """Why a model whose config asks for router logits cannot be trained with its load-balancing loss, or None."""
    model_type = getattr(config, "model_type", None)
    if not getattr(config, "output_router_logits", False) or model_type in SUPPORTED:
        return None
    return (f"model.config.output_router_logits is true: {model_type} would add its router load-balancing loss to the "
            "cross-entropy, and finetune adds it only for the architectures checked against their own loss "
            f"({', '.join(SUPPORTED)}; docs/models.md). Set model.config.output_router_logits: false (the router is "
            "still trained through the cross-entropy)")
