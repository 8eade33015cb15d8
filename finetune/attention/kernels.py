"""The documents of a packed micro-batch, found once on the CPU, and the kernels that attend within them.

A packed micro-batch's documents are known on the host before it reaches the model (the collated position_ids
restart at 0 for each). `packed_kwargs` turns them into `cu_seq_lens_q/k` and `max_length_q/k`, the keyword
arguments transformers forwards to every attention call for precomputed variable-length boundaries, and keeps
the host-side facts of the same micro-batch (`Documents`: each row's spans, the longest document, a flex
BlockMask once one is built) for the attention function to find from the tensor it is handed. So no attention
layer reads a device tensor back (no host sync per layer) and no layer repeats the work.

The kernels (finetune/attention.py picks one per call with `kernel_for`):
- `varlen`: torch.nn.attention.varlen.varlen_attn (flash attention over the flattened rows with cu_seqlens;
  CUDA, bf16/fp16): the default for packed rows on CUDA;
- `flex`: flex_attention with one document BlockMask per micro-batch (compiled on CUDA; forward only on a CPU);
- `sdpa`: torch's sdpa one document at a time, a Python loop over the host spans: the CPU's fastest (measured,
  README "Packing") and the fallback wherever the others do not apply (fp32 on CUDA, attention dropout, a
  sliding window this torch's varlen_attn cannot express).
FINETUNE_PACKED_ATTENTION=auto|varlen|flex|sdpa overrides the choice (benchmarks, or a kernel that misbehaves).
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune.errors import UserError

KERNEL_ENV = "FINETUNE_PACKED_ATTENTION"
KERNELS = ("auto", "varlen", "flex", "sdpa")


def document_spans(position_ids: torch.Tensor, batch_size: int) -> list[list[tuple[int, int]]]:
    """[(start, end), ...] of the documents of each row: a document starts where a position does not follow
    the previous one (0 after 57, or 0 after 0). A host sync when position_ids are on a GPU."""
    position_ids = position_ids.expand(batch_size, -1)
    length = position_ids.shape[1]
    restarts = (position_ids[:, 1:] != position_ids[:, :-1] + 1).nonzero().tolist()
    starts: list[list[int]] = [[0] for _ in range(batch_size)]
    for row, col in restarts:
        starts[row].append(col + 1)
    return [list(zip(s, [*s[1:], length])) for s in starts]


@dataclass(eq=False)
class Documents:
    """One packed micro-batch's documents: each row's (start, end) spans on the host, and `cu_seqlens`, their
    cumulative lengths over the flattened rows (int32 [documents + 1], on the model's device)."""

    spans: list[list[tuple[int, int]]]
    cu_seqlens: torch.Tensor
    max_length: int
    batch: int
    length: int
    block_masks: dict[Any, Any] = field(default_factory=dict)  # (device, window) -> flex BlockMask, built once

    @staticmethod
    def of(cu_seqlens: Any, batch: int, length: int) -> Documents | None:
        """The Documents that packed_kwargs made with this very tensor, for rows of this shape; else None (the
        caller then reads the documents from position_ids)."""
        entry = _MADE.get(id(cu_seqlens)) if isinstance(cu_seqlens, torch.Tensor) else None
        if entry is None or entry[0]() is not cu_seqlens:
            return None
        docs = entry[1]
        return docs if (docs.batch, docs.length) == (batch, length) else None


# id(cu_seqlens) -> (a weak reference to it, its Documents); an entry goes when its tensor does.
_MADE: dict[int, tuple[weakref.ref, Documents]] = {}


def packed_kwargs(position_ids: torch.Tensor, device: torch.device | str | None = None) -> dict[str, Any]:
    """The model-call keyword arguments of packed rows with these position_ids (on the CPU: no host sync),
    [b, S] or [S]: cu_seq_lens_q/k on `device` (copied without blocking from pinned memory on CUDA) and
    max_length_q/k as ints, over the b x S flattened tokens (a row's padding is one more document)."""
    pos = position_ids if position_ids.ndim == 2 else position_ids[None]
    batch, length = pos.shape
    spans = document_spans(pos.cpu(), batch)
    lengths = torch.tensor([end - start for row in spans for start, end in row], dtype=torch.int32)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu[1:])
    target = torch.device(device) if device is not None else torch.device("cpu")
    if target.type == "cuda":
        cu = cu.pin_memory().to(target, non_blocking=True)
    elif target.type != "cpu":
        cu = cu.to(target)
    longest = int(lengths.max())
    docs = Documents(spans, cu, longest, batch, length)
    key, made = id(cu), _MADE  # the dict itself, not the module global (gone at interpreter exit)
    made[key] = (weakref.ref(cu, lambda _: made.pop(key, None)), docs)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


# --- which kernel -----------------------------------------------------------------------------------------------

def setting() -> str:
    """FINETUNE_PACKED_ATTENTION, lower-cased; unset or empty is auto."""
    value = os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"
    if value not in KERNELS:
        raise UserError(f"{KERNEL_ENV}={os.environ[KERNEL_ENV]!r}: choose one of {', '.join(KERNELS)}")
    return value


def kernel_for(query: torch.Tensor, dropout: float, sliding_window: int | None, docs: Documents) -> str:
    """varlen, flex or sdpa (one document at a time) for this attention call: FINETUNE_PACKED_ATTENTION, or under
    auto varlen where it applies (varlen_problem) and sdpa elsewhere."""
    choice = setting()
    if choice == "sdpa":
        return "sdpa"
    if choice != "auto" and dropout:
        raise UserError(f"{KERNEL_ENV}={choice}: the kernel has no attention dropout and this model trains with "
                        f"{dropout}; unset {KERNEL_ENV}")
    if choice == "flex":
        return "flex"
    problem = varlen_problem(query.device, query.dtype, query.shape[-1], sliding_window, docs.max_length)
    if choice == "varlen" and problem:
        raise UserError(f"{KERNEL_ENV}=varlen: {problem}; unset {KERNEL_ENV}")
    return "sdpa" if problem or dropout else "varlen"


def varlen_problem(device: torch.device, dtype: torch.dtype, head_dim: int, sliding_window: int | None = None,
                   longest: int = 0) -> str | None:
    """Why torch's varlen_attn cannot run this attention, or None."""
    if device.type != "cuda":
        return f"varlen_attn runs on CUDA only (here: {device.type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"varlen_attn needs bfloat16 or float16 (here: {dtype})"
    fn = _varlen_attn()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if head_dim % 8 or head_dim > 256:
        return f"flash attention takes head dimensions up to 256 in multiples of 8 (here: {head_dim})"
    if sliding_window is not None and sliding_window < longest and "window_size" not in _params(fn):
        return f"this torch's varlen_attn has no sliding window (window {sliding_window} < document {longest})"
    return None


def describe(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What packed rows of a model on this device and dtype run by default, for the run log."""
    choice = setting()
    if choice == "auto":
        choice = "sdpa" if varlen_problem(device, dtype, head_dim) else "varlen"
    return {"varlen": "varlen_attn", "flex": "flex_attention + BlockMask", "sdpa": "sdpa per document"}[choice]


# --- the kernels ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=8)
def _params(fn: Any) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: Documents, scaling: float | None,
           sliding_window: int | None, kernel: Any = None) -> torch.Tensor:
    """Causal attention within each document by one varlen call over the flattened rows: [b, heads, S, d] in,
    [b, S, heads, d] out. `kernel` (default torch's varlen_attn) takes varlen_attn's arguments."""
    fn = kernel or _varlen_attn()
    params = _params(fn)
    b, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(b * length, t.shape[1], dim) for t in (query, key, value))
    kwargs: dict[str, Any] = {"scale": scaling}
    if k.shape[1] != heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # torch before 2.13: key/value repeated for grouped-query attention
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    windowed = sliding_window is not None and sliding_window < docs.max_length
    if "window_size" in params:  # torch 2.13: (left, right); transformers' rule q - k < window
        kwargs["window_size"] = (sliding_window - 1 if windowed else -1, 0)
    else:
        kwargs["is_causal"] = True
    out = fn(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_length, docs.max_length, **kwargs)
    return out.view(b, length, heads, dim)


def flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: Documents, scaling: float | None,
         sliding_window: int | None) -> torch.Tensor:
    """flex_attention with the micro-batch's document BlockMask (built by the first layer, shared by the rest):
    [b, heads, S, d] in, [b, S, heads, d] out. Compiled on CUDA; on a CPU torch runs it uncompiled, forward only."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = block_mask(docs, query.device, sliding_window)
    fn = _compiled_flex() if query.device.type == "cuda" else flex_attention
    out = fn(query, key, value, block_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def block_mask(docs: Documents, device: torch.device, sliding_window: int | None = None) -> Any:
    """The BlockMask of causal attention within each document (and the window), one per micro-batch and window."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (device, sliding_window)
    if key not in docs.block_masks:
        cu = docs.cu_seqlens.to(device)
        flat = torch.arange(docs.batch * docs.length, device=device, dtype=cu.dtype)
        doc = torch.searchsorted(cu[1:], flat, right=True).view(docs.batch, docs.length)

        def within_document(b: Any, h: Any, q: Any, kv: Any) -> Any:
            allowed = (doc[b, q] == doc[b, kv]) & (q >= kv)
            return allowed & (q - kv < sliding_window) if sliding_window is not None else allowed

        docs.block_masks[key] = create_block_mask(within_document, docs.batch, None, docs.length, docs.length,
                                                  device=device, _compile=device.type == "cuda")
    return docs.block_masks[key]
