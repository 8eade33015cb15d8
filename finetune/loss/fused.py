"""Fused linear cross-entropy: the output projection and the token cross-entropy in one step.

The trainer sums token cross-entropies over every micro-batch of an optimizer step and divides once by the
step's total number of target tokens (exact gradient accumulation). So everything here returns a SUM of
per-token losses and the COUNT of target tokens, never a mean.

Three implementations with the same semantics:

* ``torch``: the naive reference. Builds the full ``[N, V]`` float32 logits; simple and obviously right.
* ``chunked``: pure torch. Walks the target rows in chunks of ``chunk_size`` so that at most one chunk of
  logits exists at a time, in forward and backward (the gradients are computed during the forward, chunk by
  chunk, the way Liger-Kernel does it; backward only scales them).
* ``liger``: Liger-Kernel's Triton fused linear cross-entropy (optional dependency). CUDA, or any device under
  Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported): a testing mode, ~5x slower, that lets the
  test suite run Liger's kernels on the CPU.

``auto`` is ``chunked`` everywhere. On an H100 (issue 13) chunked-1024 took 1.11x the naive loss's time with 0.151
of its memory, Liger 1.5x with 0.130; and Liger reads the device from the host about twice per micro-batch (an
``.item()`` in its forward, a ``torch.equal`` in its backward), where a training step reads it once.

Optional extras, identical in all three: ``z_loss`` adds ``z_loss * logsumexp(logits)**2`` per target token
(PaLM's z-loss, Liger's ``lse_square_scale``); ``softcap`` maps ``logits -> softcap * tanh(logits / softcap)``
before the softmax (Gemma-2 style, Liger's ``softcap``); the z-loss uses the capped logits.

This module imports only torch, finetune.errors and finetune.loss.liger so that it stays cheap to import;
liger_kernel is imported lazily (liger.py) because importing it without a GPU fails ("0 active drivers") unless
Triton's interpreter is on.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.loss.liger import (
    INTERPRETED,
    INTERPRETER_VAR,
    LIGER_FIX,
    liger_import,
    liger_loss,
    triton_interpreter,
)

if TYPE_CHECKING:  # only a type here: the loss module stays light to import
    from finetune.batch import Targets

IMPLS = ("auto", "liger", "chunked", "torch")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T]: position t gets labels[..., t+1]; the last position gets IGNORE_INDEX.

    Position t's hidden state predicts token t+1. Packed rows rely on the data pipeline having set the first
    label of every packed document to IGNORE_INDEX, so that no position predicts across a document boundary.
    """
    shifted = labels.new_full(labels.shape, IGNORE_INDEX)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """'auto' -> 'chunked' on every device (the module docstring has the measured reason). 'liger' needs a CUDA
    device, or Triton's interpreter (TRITON_INTERPRET=1, a testing mode), and liger-kernel importable: otherwise a
    UserError naming `loss.impl` and the fix. Unknown names raise UserError listing IMPLS."""
    if impl not in IMPLS:
        raise UserError(f"loss.impl: unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    device = torch.device(device)
    if impl == "auto":
        return "chunked"
    if impl == "liger":
        if device.type != "cuda" and not triton_interpreter():
            raise UserError(
                f"loss.impl: liger needs a CUDA device but the model is on {device.type!r}; "
                "set `loss.impl: chunked` (or `auto`) on this machine, or set "
                f"{INTERPRETER_VAR}=1 in the environment to run Liger's kernels in Triton's interpreter "
                "(a testing mode, ~5x slower)"
            )
        fn, why = liger_import()
        if fn is None:
            raise UserError(f"loss.impl: liger is selected but liger-kernel cannot be imported ({why}); {LIGER_FIX}")
    return impl


def describe_impl(impl: str, device: torch.device | str) -> str:
    """The resolved loss.impl as the run log and versions.json's run record name it: Liger under Triton's interpreter
    says so, so that no one reads a testing run as a Liger run on a GPU."""
    if impl != "liger" or not triton_interpreter():
        return impl
    kind = torch.device(device).type
    return INTERPRETED if kind == "cpu" else f"liger (Triton interpreter on {kind}, testing mode)"


# --------------------------------------------------------------------------------------------------------------
# helpers shared by the implementations


@functools.cache
def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """torch.promote_types, remembered: each call is a dispatched op, asked several times a micro-batch."""
    return torch.promote_types(a, b)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32, or float64 when the inputs are float64 (keeps the gradcheck exact)."""
    return promote(dtype, torch.float32)


@functools.lru_cache(maxsize=8)
def has_mm_out_dtype(device: torch.device) -> bool:
    """Whether torch.mm(..., out_dtype=torch.float32) works for bf16/fp16 on this device.

    Only CUDA implements it (the CPU backend has no `aten::mm.dtype` kernel); Liger gates the same call on
    compute capability >= 8 (Ampere)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "get_device_capability"):
        return False
    try:
        return torch.cuda.get_device_capability(device)[0] >= 8
    except Exception:  # a broken CUDA setup: the fallback below is still correct
        return False


def mm_f32(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """a @ b with an acc_dtype result. For bf16/fp16 on recent GPUs the GEMM writes fp32 directly (no rounding
    of the logits to 16 bits); elsewhere it computes in the input dtype and upcasts."""
    if a.dtype == acc_dtype:
        return torch.mm(a, b)
    if has_mm_out_dtype(a.device):
        return torch.mm(a, b, out_dtype=acc_dtype)
    return torch.mm(a, b).to(acc_dtype)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the projection runs in: what nn.Linear would use. Under autocast that is the autocast dtype;
    otherwise the promoted dtype of hidden and weight (they normally match)."""
    dtype = promote(hidden.dtype, weight.dtype)
    dev = hidden.device.type
    # autocast leaves float64 alone, and so do we
    if dev in ("cuda", "cpu") and dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return dtype


# --------------------------------------------------------------------------------------------------------------
# chunked implementation


def _chunk_loss_and_grad(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    z_loss: float,
    softcap: float | None,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss of one chunk of rows and, if need_grad, d(loss)/d(logits) for it ([c, V], acc dtype).

    Works in place on the chunk's logits buffer so that, without softcap, one [c, V] buffer is live (two with
    softcap: the tanh values are needed again for the chain rule)."""
    acc = acc_dtype(h.dtype)
    logits = mm_f32(h, weight.t(), acc)  # [c, V]
    if bias is not None:
        logits.add_(bias)
    if softcap is not None:
        t = logits.div_(softcap).tanh_()  # the logits buffer now holds tanh(logits / softcap)
        x = t * softcap
    else:
        t = None
        x = logits
    del logits
    y1 = y.unsqueeze(1)
    x_y = x.gather(1, y1).squeeze(1)  # target logit, read before x is overwritten
    m = x.amax(dim=1, keepdim=True)
    e = x.sub_(m).exp_()  # x is consumed: e = exp(x - max), in place
    s = e.sum(dim=1, keepdim=True)
    lse = (m + s.log()).squeeze(1)
    per_token = lse - x_y
    if z_loss:
        per_token = per_token + z_loss * lse.square()
    loss = per_token.sum()
    if not need_grad:
        return loss, None
    grad = e.div_(s)  # softmax, in place
    if z_loss:
        # d(z * lse^2)/dx_i = 2 z lse softmax_i, so the softmax is scaled by (1 + 2 z lse)
        grad.mul_((1.0 + 2.0 * z_loss * lse).unsqueeze(1))
    grad.scatter_add_(1, y1, grad.new_full((y.numel(), 1), -1.0))  # - onehot(y)
    if t is not None:
        grad.mul_(t.square_().neg_().add_(1.0))  # chain rule through softcap: 1 - tanh^2, in t's buffer
    return loss, grad


def _chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_size: int,
    z_loss: float,
    softcap: float | None,
    grad_flags: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(summed loss, [grad_hidden, grad_weight, grad_bias]) for rows that all have a target, one chunk at a time.

    grad_flags says which gradients to compute (None for the others). They are d(loss_sum)/d(input), in the
    input dtypes; weight/bias gradients are accumulated over the chunks in fp32."""
    need_h, need_w, need_b = grad_flags
    need_grad = need_h or need_w or need_b
    n = hidden.shape[0]
    if n <= chunk_size:
        return _one_chunk(hidden, weight, bias, targets, z_loss, softcap, grad_flags)
    acc = acc_dtype(hidden.dtype)
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b and bias is not None else None
    # sum the chunk losses in fp64 (a scalar, so free); MPS has no fp64
    total = torch.zeros((), dtype=acc if hidden.device.type == "mps" else torch.float64, device=hidden.device)
    for start in range(0, n, chunk_size):
        h = hidden[start : start + chunk_size]
        loss, g = _chunk_loss_and_grad(h, weight, bias, targets[start : start + chunk_size], z_loss, softcap,
                                       need_grad)
        total += loss
        if g is None:
            continue
        # The two backward GEMMs take bf16/fp16 operands where the inputs are 16-bit (tensor cores), with the
        # products accumulated in fp32; the bias gradient is summed from the fp32 chunk directly.
        g_lp = g if g.dtype == hidden.dtype else g.to(hidden.dtype)
        if grad_h is not None:
            torch.mm(g_lp, weight, out=grad_h[start : start + chunk_size])
        if grad_b is not None:
            grad_b.add_(g.sum(dim=0))
        if grad_w is not None:
            if g.dtype == hidden.dtype:
                grad_w.addmm_(g.t(), h)
            elif has_mm_out_dtype(hidden.device):
                torch.addmm(grad_w, g_lp.t(), h, out_dtype=acc, out=grad_w)
            else:
                # no 16-bit GEMM with fp32 output here (CPU): do this one in fp32 from the fp32 chunk
                grad_w.addmm_(g.t(), h.to(acc))
        del g, g_lp  # free this chunk before the next one is built
    # cast once at the end (for 16-bit weights this also frees the fp32 accumulators before backward)
    grads = [
        grad_h,
        grad_w.to(weight.dtype) if grad_w is not None else None,
        grad_b.to(bias.dtype) if grad_b is not None and bias is not None else None,
    ]
    return total.to(acc), grads


def _one_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
               z_loss: float, softcap: float | None,
               grad_flags: tuple[bool, bool, bool]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """_chunked_forward of rows that fit one chunk (short rows, small micro-batches: where the host's time per
    micro-batch shows): the same operations without the accumulators, slices and final casts the chunk loop needs,
    so the same numbers (a sum of one term in float64 cast back is the term) in about ten fewer ops."""
    need_h, need_w, need_b = grad_flags
    loss, g = _chunk_loss_and_grad(hidden, weight, bias, targets, z_loss, softcap, need_h or need_w or need_b)
    if g is None:
        return loss, [None, None, None]
    g_lp = g if g.dtype == hidden.dtype else g.to(hidden.dtype)
    grad_h = torch.mm(g_lp, weight) if need_h else None
    grad_b = g.sum(dim=0).to(bias.dtype) if need_b and bias is not None else None
    grad_w = None
    if need_w:  # as in the chunk loop; the last: no 16-bit GEMM with fp32 output here (CPU)
        grad_w = (torch.mm(g.t(), hidden) if g.dtype == hidden.dtype else torch.mm(g_lp.t(), hidden, out_dtype=g.dtype)
                  if has_mm_out_dtype(hidden.device) else torch.mm(g.t(), hidden.to(g.dtype))).to(weight.dtype)
    return loss, [grad_h, grad_w, grad_b]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of (hidden @ weight.T + bias) against targets, one chunk of rows at a time.

    All inputs share one dtype (the caller casts). Gradients are computed during forward (memory: one chunk of
    logits plus the gradient buffers, never [N, V]) and kept on ctx; backward scales them by grad_output IN
    PLACE and hands them over, so no second [V, H] buffer appears and AccumulateGrad can adopt the tensor
    instead of copying it. A repeated backward (retain_graph=True, gradcheck) recomputes them from the saved
    inputs, which the matmul in an unfused lm_head would have saved as well."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_size: int,
        z_loss: float,
        softcap: float | None,
        grad_flags: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        # grad_flags is decided by the caller: ctx.needs_input_grad is True even under torch.no_grad()
        loss, grads = _chunked_forward(hidden, weight, bias, targets, chunk_size, z_loss, softcap, grad_flags)
        if any(grad_flags):
            ctx.grads = grads
            ctx.config = (chunk_size, z_loss, softcap, grad_flags)
            ctx.save_for_backward(hidden, weight, bias, targets)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = ctx.grads
        ctx.grads = None  # drop our reference: the tensors now belong to autograd
        if grads is None:  # this graph is being backpropagated through again
            hidden, weight, bias, targets = ctx.saved_tensors
            _, grads = _chunked_forward(hidden, weight, bias, targets, *ctx.config)
        for g in grads:
            if g is not None:
                g.mul_(grad_output)  # 0-dim fp32 factor: computed in fp32, rounded once to g's dtype
        grad_h, grad_w, grad_b = grads
        del grads
        return grad_h, grad_w, grad_b, None, None, None, None, None


# --------------------------------------------------------------------------------------------------------------
# the other two implementations (on rows that all have a target)


def _torch_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, z_loss: float,
                softcap: float | None) -> torch.Tensor:
    """Naive reference: full [N, V] logits upcast to fp32, F.cross_entropy(reduction='sum') + z-loss."""
    logits = F.linear(h, weight, bias)
    logits = logits.to(acc_dtype(logits.dtype))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, y, reduction="sum")
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).square().sum()
    return loss


# --------------------------------------------------------------------------------------------------------------
# public entry point


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    impl: str = "chunked",
    chunk_size: int = 1024,
    z_loss: float = 0.0,
    softcap: float | None = None,
    targets: Targets | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T, H] (or [T, H]), weight [V, H] (the output layer's weight), labels [B, T] (or [T]) UNSHIFTED,
    IGNORE_INDEX where no loss. Shifts the labels itself, drops ignored positions BEFORE the projection
    (index_select the hidden rows that have a target), then computes the cross entropy summed over targets.
    Returns (loss_sum: float32 scalar tensor with grad, n_targets: int64 scalar tensor).
    impl must already be resolved ('liger' | 'chunked' | 'torch'). With zero targets, returns a loss_sum that
    is 0.0 but still connected to the graph (e.g. hidden.sum() * 0 + weight.sum() * 0) so backward works and
    distributed gradient hooks fire.

    loss_sum is float64 instead when the inputs are float64 (tests). z_loss adds z_loss * logsumexp^2 per
    target; softcap caps the logits with softcap * tanh(logits / softcap) before the softmax. `targets`
    (finetune/batch.py: the labels' target positions and id range, found on the CPU) spares two host syncs.
    """
    _check_arguments(hidden, weight, labels, bias, impl, chunk_size, softcap)
    vocab, hsize = weight.shape

    keep, y = target_rows(labels, targets)
    count = targets.count if targets is not None else keep.numel()
    n_targets = torch.full((), count, dtype=torch.int64, device=hidden.device)
    dtype = compute_dtype(hidden, weight)
    out_dtype = acc_dtype(dtype)

    if count == 0:
        # 0.0 that still reaches every parameter: backward runs and DDP/FSDP hooks fire. Empty slices instead of
        # x.sum() * 0 so that an inf/nan somewhere in hidden cannot turn the zero into a nan.
        zero = hidden.reshape(-1)[:0].sum() + weight.reshape(-1)[:0].sum()
        if bias is not None:
            zero = zero + bias[:0].sum()
        return zero.to(out_dtype), n_targets

    # On CUDA a bad id is an opaque device assert: checked on the host range, else by a second (tiny) sync.
    bad_id = _bad_id(y, vocab) if targets is None else next((t for t in (targets.low, targets.high)
                                                             if not 0 <= t < vocab), None)
    if bad_id is not None:
        raise UserError(
            f"labels contain token ids outside the model's vocabulary [0, {vocab}) (e.g. "
            f"{bad_id}); the tokenizer and model do not match, or labels were masked with a value "
            f"other than {IGNORE_INDEX}"
        )
    h = hidden.reshape(-1, hsize).index_select(0, keep)  # [N, H]: only rows with a target are projected

    # Cast explicitly (differentiably) to the dtype nn.Linear would use, then compute with autocast off, so the
    # three implementations see the same operands and autocast cannot silently downcast the fp32 work.
    b = bias.to(dtype) if bias is not None else None
    dev = hidden.device.type
    autocast = dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev)  # entering it costs host time per call
    with torch.autocast(device_type=dev, enabled=False) if autocast else contextlib.nullcontext():
        loss = _summed_loss(impl, h.to(dtype), weight.to(dtype), b, y, chunk_size, z_loss, softcap)
    return loss.to(out_dtype), n_targets


def target_rows(labels: torch.Tensor, targets: Targets | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the flat positions in [B*T] that have a target, their target ids) of UNSHIFTED labels: from `targets` when
    it carries both (finetune/batch.py found them on the CPU: no host sync, no device op), else from the labels
    shifted here (without `targets`: a host sync, the row count being a dynamic shape)."""
    if targets is not None and targets.ids is not None:
        return targets.index, targets.ids
    shifted = shift_labels(labels).reshape(-1)
    keep = (shifted != IGNORE_INDEX).nonzero().squeeze(1) if targets is None else targets.index
    return keep, shifted.index_select(0, keep)


def _bad_id(y: torch.Tensor, vocab: int) -> int | None:
    bad = (y < 0) | (y >= vocab)
    return int(y[bad][0]) if bool(bad.any()) else None


def _check_arguments(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
                     impl: str, chunk_size: int, softcap: float | None) -> None:
    if impl not in ("liger", "chunked", "torch"):
        raise ValueError(f"impl must be resolved with resolve_impl() first; got {impl!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise UserError(f"loss.chunk_size must be a positive integer, got {chunk_size!r}")
    if softcap is not None and not softcap > 0:
        raise UserError(f"loss.softcap must be a positive number or null, got {softcap!r}")
    if hidden.dim() not in (2, 3) or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)}: want [B, T, H] and [B, T]"
                         " (or [T, H] and [T])")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match vocab size {weight.shape[0]}")


def _summed_loss(impl: str, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor,
                 chunk_size: int, z_loss: float, softcap: float | None) -> torch.Tensor:
    """The summed loss of the target rows h [N, H] by one implementation, operands already in the compute dtype."""
    if impl == "torch":
        return _torch_loss(h, w, b, y, z_loss, softcap)
    if impl == "liger":
        if h.device.type != "cuda":
            resolve_impl("liger", h.device)  # raises the UserError naming loss.impl, unless the interpreter is on
        return liger_loss(h, w, b, y, z_loss, softcap)
    grad_on = torch.is_grad_enabled()
    flags = (grad_on and h.requires_grad, grad_on and w.requires_grad, grad_on and b is not None and b.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(h, w, b, y, chunk_size, float(z_loss), softcap, flags)

