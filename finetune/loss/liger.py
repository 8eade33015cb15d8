"""Liger-Kernel's fused linear cross-entropy (liger-kernel 0.8.5, Triton): the import, the summed loss, the
per-token losses, and Triton's interpreter, which runs the same kernels on the CPU as a testing mode.

Triton decides when a kernel is defined (when liger_kernel is imported) whether it compiles it for a GPU or runs it
in its interpreter (numpy, any device, ~5x slower here): TRITON_INTERPRET must be in the environment before the
import. Without it and without a GPU driver, importing liger_kernel fails ("0 active drivers").
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX

LIGER_FIX = "install it with `pip install 'finetune[liger]'` or set `loss.impl: chunked`"


# Triton reads this variable when a kernel is defined (at import): its interpreter then runs every kernel with numpy.
INTERPRETER_VAR = "TRITON_INTERPRET"
INTERPRETED = "liger (Triton interpreter, CPU testing mode)"


def triton_interpreter() -> bool:
    """Whether TRITON_INTERPRET turns Triton's interpreter on, read as Triton 3.x reads it (1, true, on, yes, y)."""
    return os.environ.get(INTERPRETER_VAR, "").strip().lower() in ("1", "true", "on", "yes", "y")


@functools.lru_cache(maxsize=1)
def liger_import() -> tuple[Callable[..., torch.Tensor] | None, str]:
    """(liger_fused_linear_cross_entropy, "") or (None, why it failed). Cached: the import is slow and a
    failure will not fix itself within a process."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as exc:  # ImportError, or triton's RuntimeError when it finds no usable GPU driver
        return None, f"{type(exc).__name__}: {exc}"
    return liger_fused_linear_cross_entropy, ""


def liger_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, z_loss: float,
               softcap: float | None) -> torch.Tensor:
    """Liger-Kernel 0.8.5's liger_fused_linear_cross_entropy with reduction='sum'."""
    fn = _liger_fn()
    h, kwargs = _liger_arguments(fn, h, weight, bias)
    return fn(h, weight, y, **kwargs, lse_square_scale=float(z_loss), reduction="sum", softcap=softcap)


def liger_token_losses(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                       softcap: float | None) -> torch.Tensor:
    """Liger-Kernel 0.8.5's fused cross-entropy per token (reduction='none': it recomputes in backward)."""
    fn = _liger_fn()
    h, kwargs = _liger_arguments(fn, h, weight, bias)
    return fn(h, weight, y, **kwargs, reduction="none", softcap=softcap)


def _liger_fn() -> Callable[..., torch.Tensor]:
    fn, why = liger_import()
    if fn is None:
        raise UserError(f"loss.impl: liger is selected but liger-kernel cannot be imported ({why}); {LIGER_FIX}")
    return fn


def _liger_arguments(fn: Callable[..., Any], h: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """(the input rows as Liger must get them, the keywords both reductions share)."""
    kwargs: dict[str, Any] = {"bias": bias, "ignore_index": IGNORE_INDEX}
    # fp32 accumulation of grad_weight/grad_bias for 16-bit weights (Liger's default accumulates in the weight
    # dtype). Never for fp32/fp64 weights, where it would be a no-op or a downgrade.
    if weight.dtype in (torch.float16, torch.bfloat16) and "accum_dtype" in liger_params(fn):
        kwargs["accum_dtype"] = torch.float32
    if torch.is_grad_enabled() and not h.requires_grad and (
        weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        # Liger 0.8.5 computes grad_weight/grad_bias only when its input requires grad (frozen trunk, trained
        # head): give it a detached input that does, and let its (unused) input gradient fall on the floor.
        h = h.detach().requires_grad_(True)
    return h, kwargs


@functools.lru_cache(maxsize=4)
def liger_params(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)
