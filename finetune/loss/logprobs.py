"""Per-token log-probabilities of the targets through the output layer, for objectives that score whole
sequences (DPO, ORPO), without ever building the full [tokens x vocab] logits.

The scheme of finetune/loss/fused.py with one difference: there, the upstream gradient is one scalar, so the
gradient can be formed during the forward; here, each token's upstream gradient depends on its whole sequence
and pair (known only after the forward), so the forward keeps only each row's log-sum-exp and the backward
recomputes each chunk's logits to form `g_t (onehot - softmax)` before the two GEMMs: one extra output-layer GEMM,
the same memory (one chunk of logits). Liger-Kernel's fused cross-entropy does the same with reduction="none".

Inside `entropy_sum()`, each call also adds up the entropy of the distribution at every target position (GRPO's
metric), in the same chunked forward under no gradient, so the logits are still never built in full. It is
asked for through a context rather than a keyword because the objective calls the model with its loss through
whatever wraps it (DDP, FSDP) and the forward's return stays the same for every caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from finetune.batch import Targets
from finetune.errors import UserError
from finetune.loss.fused import acc_dtype, compute_dtype, mm_f32, resolve_impl, target_rows
from finetune.loss.liger import liger_token_losses


@dataclass
class EntropySum:
    """The summed entropy (nats, float64, on the device: never read here) of the target positions' distributions
    over the token_logprobs calls made inside `entropy_sum()`; None when none was made."""

    total: torch.Tensor | None = None

    def add(self, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.total = value if self.total is None else self.total + value


_ENTROPY: ContextVar[EntropySum | None] = ContextVar("finetune_entropy_sum", default=None)


@contextlib.contextmanager
def entropy_sum() -> Iterator[EntropySum]:
    """Within it, every token_logprobs call also sums the entropy of each target position's distribution (as
    scored: the logits after the head's softcap, and its temperature when the caller folded it into the weight)."""
    sink = EntropySum()
    token = _ENTROPY.set(sink)
    try:
        yield sink
    finally:
        _ENTROPY.reset(token)


def _row_entropy(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """-sum_v p log p of each row of logits `x` [N, V] whose log-sum-exp is `lse` [N] (p = 0 counts 0)."""
    p = (x - lse.unsqueeze(1)).exp_()
    return -torch.special.xlogy(p, p).sum(dim=1)


@torch.no_grad()
def chunked_entropy_sum(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, chunk_size: int,
                        softcap: float | None) -> torch.Tensor:
    """The summed entropy of the distributions of rows h [N, H], one chunk of logits at a time."""
    total = torch.zeros((), dtype=acc_dtype(h.dtype), device=h.device)
    for start in range(0, h.shape[0], chunk_size):
        x, _ = _chunk_logits(h[start:start + chunk_size], w, b, softcap)
        total += _row_entropy(x, torch.logsumexp(x, dim=1)).sum()
    return total


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   bias: torch.Tensor | None = None, *, impl: str = "chunked", chunk_size: int = 1024,
                   softcap: float | None = None, targets: Targets | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target) of every target token [N], their flat positions in [B*T] [N]).

    hidden [B, T, H] (or [T, H]), weight [V, H], labels UNSHIFTED with IGNORE_INDEX where not scored: position t
    scores labels[t + 1]. The log-probs carry gradients to hidden, weight and bias, in the accumulation dtype
    (float32; float64 for float64 inputs). `impl` is resolved ('chunked' | 'torch' | 'liger'). `targets`
    (finetune/batch.py, found on the CPU) spares the host syncs of finding and checking them."""
    keep, y = target_rows(labels, targets)
    dtype = compute_dtype(hidden, weight)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep).to(dtype)
    low, high = (targets.low, targets.high) if targets is not None else (
        (int(y.min()), int(y.max())) if y.numel() else (0, 0))
    if (targets.count if targets is not None else y.numel()) and (low < 0 or high >= weight.shape[0]):
        raise UserError(f"labels contain token ids outside the model's vocabulary [0, {weight.shape[0]})")
    w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
    entropy = _ENTROPY.get()
    if impl == "torch":
        logits = F.linear(h, w, b).to(acc_dtype(dtype))
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if entropy is not None:
            with torch.no_grad():
                entropy.add(_row_entropy(logits, torch.logsumexp(logits, dim=1)).sum())
        return -F.cross_entropy(logits, y, reduction="none"), keep
    if impl == "liger":
        if h.device.type != "cuda":
            resolve_impl("liger", h.device)  # raises the UserError naming loss.impl, unless the interpreter is on
        if h.shape[0]:
            if entropy is not None:  # Liger's kernel keeps no logits: one more chunked GEMM pass, no gradient
                entropy.add(chunked_entropy_sum(h, w, b, chunk_size, softcap))
            return -liger_token_losses(h, w, b, y, softcap), keep
        # No target rows (a filler micro-batch): Liger 0.8.5 divides by zero; chunked's empty result reaches every
        # input, so the backward and the distributed hooks run.
    elif impl != "chunked":
        raise ValueError(f"impl must be resolved with resolve_impl() first; got {impl!r}")
    return _ChunkedTokenLogprobs.apply(h, w, b, y, chunk_size, softcap, entropy), keep


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits of one chunk in the accumulation dtype, softcapped; tanh values for the chain rule or None)."""
    logits = mm_f32(h, w.t(), acc_dtype(h.dtype))
    if b is not None:
        logits.add_(b)
    if softcap is None:
        return logits, None
    t = logits.div_(softcap).tanh_()
    return t * softcap, t


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(y_t) = x_t[y_t] - logsumexp(x_t) for target rows h [N, H], one chunk of rows at a time.

    Forward saves h, w, b, y and each row's log-sum-exp; backward recomputes a chunk's logits, turns them into
    d(sum_t g_t log p_t)/dx = g_t (onehot(y_t) - softmax(x_t)), and multiplies into the hidden and weight
    gradients chunk by chunk. With an EntropySum, each chunk's entropy is added to it from the same logits."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor,  # type: ignore[override]
                chunk_size: int, softcap: float | None, entropy: EntropySum | None = None) -> torch.Tensor:
        out = torch.empty(h.shape[0], dtype=acc_dtype(h.dtype), device=h.device)
        lse = torch.empty_like(out)
        summed = torch.zeros((), dtype=out.dtype, device=out.device) if entropy is not None else None
        for start in range(0, h.shape[0], chunk_size):
            x, _ = _chunk_logits(h[start:start + chunk_size], w, b, softcap)
            rows = slice(start, start + x.shape[0])
            lse[rows] = torch.logsumexp(x, dim=1)
            out[rows] = x.gather(1, y[rows].unsqueeze(1)).squeeze(1) - lse[rows]
            if summed is not None:
                summed += _row_entropy(x, lse[rows]).sum()
        if entropy is not None:
            entropy.add(summed)
        ctx.save_for_backward(h, w, b, y, lse)
        ctx.config = (chunk_size, softcap)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, w, b, y, lse = ctx.saved_tensors
        chunk_size, softcap = ctx.config
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = acc_dtype(h.dtype)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        grad_b = torch.zeros(b.shape, dtype=acc, device=b.device) if need_b and b is not None else None
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            x, t = _chunk_logits(h[rows], w, b, softcap)
            g = x.sub_(lse[rows].unsqueeze(1)).exp_().neg_()  # -softmax, in place
            g.scatter_add_(1, y[rows].unsqueeze(1), g.new_ones((g.shape[0], 1)))  # + onehot(y)
            g.mul_(grad_out[rows].to(acc).unsqueeze(1))
            if t is not None:
                g.mul_(t.square_().neg_().add_(1.0))  # through the softcap: 1 - tanh^2
            if grad_h is not None:
                grad_h[rows] = mm_f32(g.to(h.dtype) if g.dtype != h.dtype else g, w, acc).to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t(), h[rows].to(acc))
            if grad_b is not None:
                grad_b.add_(g.sum(dim=0))
        return (grad_h, grad_w.to(w.dtype) if grad_w is not None else None,
                grad_b.to(b.dtype) if grad_b is not None else None, None, None, None, None)
