"""The kernels that attend within each packed document, and the run's choice among them.

A packed micro-batch's documents are found once on the CPU (finetune/batch.py, `Documents`) and reach every
attention call through the model call, so no attention layer reads a device tensor back and none repeats the work.
The kernels (dispatch.py asks `kernel_for` on each call, under the run's setting carried by the Documents):
- `varlen`: torch.nn.attention.varlen.varlen_attn (flash attention over the flattened rows with cu_seqlens;
  CUDA, bf16/fp16, torch >= 2.11): the default for packed rows on CUDA. A value head smaller than the query's (MLA:
  DeepSeek-V2/V3, LongCat-Flash, MiniCPM3) is zero-padded to it, and the output sliced back;
- `masked`: one sdpa call per layer behind a block-diagonal causal mask built once per micro-batch: auto's choice on
  CUDA wherever varlen_attn cannot run (fp32, attention dropout, a head size flash attention refuses);
- `flex`: flex_attention with one document BlockMask per micro-batch (compiled on CUDA; forward only on a CPU);
- `sdpa`: torch's sdpa one document at a time, a Python loop over the host spans: the CPU's fastest (measured,
  README "Packing").
The setting is model.packed_attention (auto|varlen|flex|sdpa); FINETUNE_PACKED_ATTENTION overrides it (`setting`).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F

from finetune.batch import Documents
from finetune.errors import UserError

KERNEL_ENV = "FINETUNE_PACKED_ATTENTION"
KERNELS = ("auto", "varlen", "flex", "sdpa")
KERNEL_NAMES = {"varlen": "varlen_attn", "masked": "sdpa with a block-diagonal mask",
                "flex": "flex_attention + BlockMask", "sdpa": "sdpa per document"}


# --- which kernel -----------------------------------------------------------------------------------------------

@functools.cache
def _environment() -> str:
    # Read once per process (a run of the CLI): every model, check and record of the run sees the same override.
    return os.environ.get(KERNEL_ENV, "").strip().lower()


def reread_environment() -> None:
    """Forget the FINETUNE_PACKED_ATTENTION read so far (tests, or a second run in one process after changing it)."""
    _environment.cache_clear()


def setting(recipe_value: str = "auto") -> str:
    """The run's packed-attention setting: FINETUNE_PACKED_ATTENTION when set (an override for benchmarks, or a
    kernel that misbehaves; read once per process), else the recipe's model.packed_attention. The model with its
    loss resolves it once; the attention reads it from each micro-batch's Documents."""
    override = _environment()
    value = override or recipe_value
    if value not in KERNELS:
        raise UserError(f"{KERNEL_ENV}={override!r}: choose one of {', '.join(KERNELS)}")
    return value


@functools.lru_cache(maxsize=64)
def choose(choice: str, device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int,
           dropout: float) -> tuple[str, str]:
    """(the kernel of an attention with these facts under the run's setting `choice`, why). auto: varlen where it
    applies (varlen_problem) and no attention dropout is asked for, else one masked sdpa call on CUDA and sdpa per
    document elsewhere. Cached: every attention call asks, with a handful of distinct answers per run."""
    if choice == "sdpa":
        return "sdpa", f"model.packed_attention sdpa (or {KERNEL_ENV})"
    if choice != "auto" and dropout:
        raise UserError(f"packed attention {choice}: the kernel has no attention dropout and this model trains with "
                        f"{dropout}; set model.packed_attention: auto")
    if choice == "flex":
        return "flex", f"model.packed_attention flex (or {KERNEL_ENV})"
    problem = varlen_problem(device, dtype, head_dim, v_head_dim)
    if choice == "varlen":
        if problem:
            raise UserError(f"packed attention varlen: {problem}; set model.packed_attention: auto")
        return "varlen", f"model.packed_attention varlen (or {KERNEL_ENV})"
    if problem is None and dropout:
        problem = f"attention dropout {dropout} (varlen_attn has none)"
    if problem is None:
        padded = f", value head {v_head_dim} padded to {head_dim}" if v_head_dim < head_dim else ""
        return "varlen", f"auto: {device.type}, {str(dtype).replace('torch.', '')}, head_dim {head_dim}{padded}"
    return ("masked" if device.type == "cuda" else "sdpa"), f"auto: {problem}"


def kernel_for(query: torch.Tensor, value: torch.Tensor, dropout: float, docs: Documents) -> str:
    """varlen, masked, flex or sdpa (one document at a time) for this attention call (`choose`)."""
    return choose(docs.kernel, query.device, query.dtype, query.shape[-1], value.shape[-1], dropout)[0]


def varlen_problem(device: torch.device, dtype: torch.dtype, head_dim: int,
                   v_head_dim: int | None = None) -> str | None:
    """Why torch's varlen_attn cannot run this attention, or None. `v_head_dim`: the value head size, when it
    differs from the query's (MLA)."""
    if device.type != "cuda":
        return f"varlen_attn runs on CUDA only (here: {device.type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"varlen_attn needs bfloat16 or float16 (here: {dtype})"
    fn = _varlen_attn()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if "window_size" not in _params(fn):  # torch 2.10's (is_causal, no scale): older than the two we support
        return f"torch {torch.__version__}'s varlen_attn predates 2.11 (no scale, no window_size)"
    if head_dim % 8 or head_dim > 256:
        return f"flash attention takes head dimensions up to 256 in multiples of 8 (here: {head_dim})"
    if v_head_dim is not None and v_head_dim > head_dim:
        return f"value head size {v_head_dim} larger than the query's {head_dim}"
    return None


def describe(layers: list[tuple[str, int, int, float]], device: torch.device, dtype: torch.dtype,
             choice: str = "auto") -> tuple[str, str]:
    """(the kernel packed rows run with, why) for a model's attention layers, each (layer kind, query head size,
    value head size, training attention dropout), on this device and dtype under the setting `choice`: what each
    attention call will choose (`choose`), named per layer kind where the kinds differ. For the run log and the run
    directory's record."""
    by_kind: dict[str, tuple[str, str]] = {}
    for kind, head_dim, v_head_dim, dropout in layers or [("attention", 64, 64, 0.0)]:
        kernel, why = choose(choice, device, dtype, head_dim, v_head_dim, dropout)
        by_kind.setdefault(kind, (KERNEL_NAMES[kernel], why))
    if len(set(by_kind.values())) == 1:
        return next(iter(by_kind.values()))
    kernels = "; ".join(f"{name} ({kind} layers)" for kind, (name, _) in by_kind.items())
    return kernels, "; ".join(f"{kind}: {why}" for kind, (_, why) in by_kind.items())


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
    [b, S, heads, d_v] out. `kernel` (default torch's varlen_attn) takes varlen_attn's arguments, as torch 2.11
    (keyword-only scale and window_size; key/value heads equal to the query's) or 2.13 (and enable_gqa) has them."""
    fn = kernel or _varlen_attn()
    params = _params(fn)
    b, heads, length, dim = query.shape
    v_dim = value.shape[-1]
    if v_dim < dim:  # flash attention takes one head size: V's zero columns give output columns of zeros, cut below
        value = F.pad(value, (0, dim - v_dim))
    q, k, v = (t.transpose(1, 2).reshape(b * length, t.shape[1], dim) for t in (query, key, value))
    windowed = sliding_window is not None and sliding_window < docs.max_length
    # (left, right): (-1, 0) is causal; transformers' window rule q - k < window is left = window - 1.
    kwargs: dict[str, Any] = {"scale": scaling, "window_size": (sliding_window - 1 if windowed else -1, 0)}
    if k.shape[1] != heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # torch 2.11: key/value repeated for grouped-query attention
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    out = fn(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_length, docs.max_length, **kwargs)
    out = out.view(b, length, heads, dim)
    return out[..., :v_dim] if v_dim < dim else out


# Why sdpa behind a mask, not flex_attention, for what varlen_attn cannot run on CUDA (fp32 above all): the mask
# needs no compilation (flex_attention must be compiled on CUDA, for the first step and again for new row lengths,
# and in fp32 it has not been measured), it runs forward and backward on every device (flex's backward needs the
# compiled kernel, so a CPU could not test it), and torch's memory-efficient kernel takes fp32, any head size, any
# value head size and dropout. What it costs: every score of the row is computed, masked ones too (issue 13's H100
# figure, bf16, 4 x 2048 rows of 45 documents: 2.11 ms against the per-document loop's 19.2 ms and flex's 0.72), and
# the mask holds b x S x S values. model.packed_attention: flex keeps block sparsity for long rows.
def masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: Documents, scaling: float | None,
           sliding_window: int | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each document by one sdpa call behind the micro-batch's block-diagonal mask (built
    by the first layer, shared by the rest): [b, heads, S, d] in, [b, S, heads, d_v] out."""
    mask = dense_mask(docs, query.device, query.dtype, sliding_window)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # repeated rather than enable_gqa, which torch's memory-efficient kernel does not take
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


def dense_mask(docs: Documents, device: torch.device, dtype: torch.dtype,
               sliding_window: int | None = None) -> torch.Tensor:
    """The additive [b, 1, S, S] mask of causal attention within each document (and the window): 0 where a query
    may see a key, -inf elsewhere; one per micro-batch, dtype and window, made on the device without a host read."""
    key = ("dense", device, dtype, sliding_window)
    if key not in docs.block_masks:
        doc = _document_ids(docs, device)
        q = torch.arange(docs.length, device=device)
        allowed = (doc[:, :, None] == doc[:, None, :]) & (q[:, None] >= q[None, :])
        if sliding_window is not None:
            allowed &= q[:, None] - q[None, :] < sliding_window
        # The last dimension's storage rounded up to 16 elements: the memory-efficient kernel wants aligned rows
        # and would otherwise pad a copy of the mask in every layer.
        width = -(-docs.length // 16) * 16
        storage = torch.zeros(docs.batch, 1, docs.length, width, device=device, dtype=dtype)
        mask = storage[..., :docs.length]
        mask.masked_fill_(~allowed[:, None], float("-inf"))
        docs.block_masks[key] = mask
    return docs.block_masks[key]


def _document_ids(docs: Documents, device: torch.device) -> torch.Tensor:
    """Each position's document number [b, S] (over the flattened rows), from cu_seqlens on the device."""
    cu = docs.cu_seqlens.to(device)
    flat = torch.arange(docs.batch * docs.length, device=device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:], flat, right=True).view(docs.batch, docs.length)


def flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: Documents, scaling: float | None,
         sliding_window: int | None) -> torch.Tensor:
    """flex_attention with the micro-batch's document BlockMask (built by the first layer, shared by the rest):
    [b, heads, S, d] in, [b, S, heads, d_v] out. Compiled on CUDA; on a CPU torch runs it uncompiled, forward only."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = block_mask(docs, query.device, sliding_window)
    fn = _compiled(flex_attention) if query.device.type == "cuda" else flex_attention
    out = fn(query, key, value, block_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


@functools.cache
def _compiled(fn: Any) -> Any:
    return torch.compile(fn)


def block_mask_builder(device: torch.device) -> Any:
    """create_block_mask, compiled on CUDA as torch 2.13 recommends (torch.compile(create_block_mask); its
    `_compile=True` is deprecated there, and 2.11 takes both), plain elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    return _compiled(create_block_mask) if device.type == "cuda" else create_block_mask


def block_mask(docs: Documents, device: torch.device, sliding_window: int | None = None) -> Any:
    """The BlockMask of causal attention within each document (and the window), one per micro-batch and window."""
    key = (device, sliding_window)
    if key not in docs.block_masks:
        doc = _document_ids(docs, device)

        def within_document(b: Any, h: Any, q: Any, kv: Any) -> Any:
            allowed = (doc[b, q] == doc[b, kv]) & (q >= kv)
            return allowed & (q - kv < sliding_window) if sliding_window is not None else allowed

        docs.block_masks[key] = block_mask_builder(device)(within_document, docs.batch, None, docs.length,
                                                           docs.length, device=device)
    return docs.block_masks[key]
