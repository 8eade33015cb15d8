"""The kernels that attend within each packed document, and the run's choice among them.

A packed micro-batch's documents are found once on the CPU (finetune/batch.py, `Documents`) and reach every
attention call through the model call, so no attention layer reads a device tensor back and none repeats the work.
The kernels (dispatch.py picks one per call with `kernel_for`, under the run's setting carried by the Documents):
- `varlen`: torch.nn.attention.varlen.varlen_attn (flash attention over the flattened rows with cu_seqlens;
  CUDA, bf16/fp16): the default for packed rows on CUDA;
- `flex`: flex_attention with one document BlockMask per micro-batch (compiled on CUDA; forward only on a CPU);
- `sdpa`: torch's sdpa one document at a time, a Python loop over the host spans: the CPU's fastest (measured,
  README "Packing") and the fallback wherever the others do not apply (fp32 on CUDA, attention dropout, a
  sliding window this torch's varlen_attn cannot express).
The setting is model.packed_attention (auto|varlen|flex|sdpa); FINETUNE_PACKED_ATTENTION overrides it, read once
per run (`setting`).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

from finetune.batch import Documents
from finetune.errors import UserError

KERNEL_ENV = "FINETUNE_PACKED_ATTENTION"
KERNELS = ("auto", "varlen", "flex", "sdpa")


# --- which kernel -----------------------------------------------------------------------------------------------

def setting(recipe_value: str = "auto") -> str:
    """The run's packed-attention setting: FINETUNE_PACKED_ATTENTION when set (an override for benchmarks, or a
    kernel that misbehaves), else the recipe's model.packed_attention. Read once per run, when the model is wrapped
    with its loss; the attention reads it from each micro-batch's Documents."""
    value = os.environ.get(KERNEL_ENV, "").strip().lower() or recipe_value
    if value not in KERNELS:
        raise UserError(f"{KERNEL_ENV}={os.environ[KERNEL_ENV]!r}: choose one of {', '.join(KERNELS)}")
    return value


def kernel_for(query: torch.Tensor, dropout: float, sliding_window: int | None, docs: Documents) -> str:
    """varlen, flex or sdpa (one document at a time) for this attention call: the run's setting (docs.kernel), or
    under auto varlen where it applies (varlen_problem) and sdpa elsewhere."""
    choice = docs.kernel
    if choice == "sdpa":
        return "sdpa"
    if choice != "auto" and dropout:
        raise UserError(f"packed attention {choice}: the kernel has no attention dropout and this model trains with "
                        f"{dropout}; set model.packed_attention: auto")
    if choice == "flex":
        return "flex"
    problem = varlen_problem(query.device, query.dtype, query.shape[-1], sliding_window, docs.max_length)
    if choice == "varlen" and problem:
        raise UserError(f"packed attention varlen: {problem}; set model.packed_attention: auto")
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


KERNEL_NAMES = {"varlen": "varlen_attn", "flex": "flex_attention + BlockMask", "sdpa": "sdpa per document"}


def describe(device: torch.device, dtype: torch.dtype, head_dim: int, choice: str = "auto") -> tuple[str, str]:
    """(the kernel packed rows of a model on this device and dtype run under the setting `choice`, why), for the
    run log and the run directory's record."""
    if choice != "auto":
        return KERNEL_NAMES[choice], f"model.packed_attention {choice} (or {KERNEL_ENV})"
    problem = varlen_problem(device, dtype, head_dim)
    if problem:
        return KERNEL_NAMES["sdpa"], f"auto: {problem}"
    return KERNEL_NAMES["varlen"], f"auto: {device.type}, {str(dtype).replace('torch.', '')}, head_dim {head_dim}"


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
