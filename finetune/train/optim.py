"""Optimizer (AdamW, or bitsandbytes' 8-bit AdamW) with no weight decay on norms and biases, and the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from finetune.errors import UserError
from finetune.recipe import TrainConfig


def parameter_groups(named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two groups: matrices decay; vectors (norm weights, biases) and anything named like a norm do not."""
    decay, no_decay = [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named: Iterable[tuple[str, torch.nn.Parameter]], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The recipe's optimizer over the trainable parameters."""
    groups = parameter_groups(named, cfg.weight_decay)
    if not groups:
        raise UserError("the model has no trainable parameters: nothing would be learned "
                        "(check adapter.target_modules, or the adapter type)")
    if cfg.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UserError("train.optimizer: adamw_8bit needs bitsandbytes: pip install 'finetune[bnb]'") from None
        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps)
    device = groups[0]["params"][0].device
    # The fused kernel is faster where it exists (CUDA); its math is AdamW's either way.
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, fused=fused)


def warmup_steps(cfg: TrainConfig, total: int) -> int:
    """The warmup length in optimizer steps: train.warmup_steps, or int(train.warmup_ratio x total) (floor) capped
    at train.warmup_max_steps; with warmup_from_zero a warmup of 1 step is 2 (Axolotl's rule)."""
    if cfg.warmup_ratio is not None:
        steps = int(cfg.warmup_ratio * total)
        if cfg.warmup_max_steps is not None:
            steps = min(steps, cfg.warmup_max_steps)
    else:
        steps = cfg.warmup_steps
    return 2 if cfg.warmup_from_zero and steps == 1 else steps


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup (from lr / W, or from 0 as
    Hugging Face's schedulers), then the decay."""
    warmup = warmup_steps(cfg, total)
    if warmup and step < warmup:
        return (step if cfg.warmup_from_zero else step + 1) / warmup
    if cfg.lr_scheduler == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = cfg.min_lr_ratio
    if cfg.lr_scheduler == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
