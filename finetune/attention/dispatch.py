"""Attention one document at a time for packed rows, on any device: what flash-attn's varlen kernels do on
CUDA, from torch's own kernels.

Why: with `sdpa` or `eager`, transformers isolates packed documents with a block-diagonal [S, S] mask, so a
packed row pays attention over all of max_seq_len (on a CPU, sdpa has no variable-length kernel and computes
every masked score). Attending within each document costs the sum of the squared document lengths instead,
less than the padded batch's rows x longest-sample squared, so packing keeps its padding saving.

How: `register()` adds ATTN_NAME to transformers' AttentionInterface and AttentionMaskInterface, the library's
extension points for custom attention (nothing of transformers is replaced). The documents come, once per
micro-batch, from the micro-batch itself (finetune/batch.py, `Documents`: found on the CPU from the collated
position_ids): the model call passes them with transformers' own names for precomputed variable-length boundaries
(`cu_seq_lens_q/k`, `max_length_q/k`) and as the Documents object, which transformers hands every attention layer
(kernels.py runs them: torch's varlen_attn or flex_attention on CUDA, sdpa per document on a CPU, as the run's
setting in Documents.kernel says). Without them (a caller that passes only position_ids, the
start-up probe) the boundaries are read from `position_ids` in each call: a document starts wherever a position
does not follow the previous one (the rule of transformers' own `find_packed_sequence_indices`). Isolation is
structural either way: a document's queries only ever see its own keys, with the cache on or off. Batches with a
padding mask, or with a cache prefix (generation), go to transformers' own sdpa path unchanged.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from finetune.attention import kernels as packed_kernels
from finetune.batch import DOCUMENTS_KWARG, Documents, document_spans

__all__ = ["ATTN_NAME", "is_ours", "register", "serves", "sdpa_varlen_attention", "sdpa_varlen_mask"]

# The name a model's config carries in `attn_implementation` when our function computes its attention.
ATTN_NAME = "finetune_sdpa_varlen"


def register() -> None:
    """Make ATTN_NAME a valid `attn_implementation` for transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, sdpa_varlen_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_varlen_mask)


def is_ours(model: torch.nn.Module) -> bool:
    """Whether the model's attention is ours, the one attention implementation given the Documents (the others
    find the documents themselves, and some models refuse keywords they do not know)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_NAME


# Set by serves() while it probes a model: each attention call appends whether usable position_ids reached it.
_probe: ContextVar[list[bool] | None] = ContextVar("finetune_attention_probe", default=None)


def serves(model: torch.nn.Module) -> bool:
    """Whether our attention function can serve this model's architecture: every attention call receives 2D position_ids and the
    model stays causal without a mask, found by two 4-token forwards.

    Most do (80 of the architectures in docs/models.md). A few do not (GPTBigCode, Llama4, Persimmon: no
    position_ids; Doge: builds its own mask from ours; DeepSeek-V3.2, GLM-DSA and other indexer models read the
    mask they do not get, and fail): the caller keeps transformers' sdpa.
    """
    seen: list[bool] = []
    token = _probe.set(seen)
    training = model.training
    try:
        model.eval()
        device = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device),
                  position_ids=torch.tensor([[0, 1, 0, 1]], device=device), use_cache=False)
            # Causality too: a model that builds its own mask from the (absent) one, e.g. Doge, would let a token
            # see later ones. Two rows that differ only in their last token must agree everywhere before it.
            rows = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1]], device=device)
            logits = model(input_ids=rows, use_cache=False).logits.float()
    except Exception:  # noqa: BLE001 - a model that cannot run without a mask under ours runs transformers' sdpa
        return False
    finally:
        _probe.reset(token)
        model.train(training)
    causal = torch.allclose(logits[0, :3], logits[1, :3], rtol=1e-3, atol=1e-3)
    return bool(seen) and all(seen) and causal


def sdpa_varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                     attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask at all for a plain causal batch without padding and without a cache prefix (packed training rows):
    the attention function takes the documents from position_ids, so no [S, S] mask is built. Anything else gets
    transformers' sdpa mask, and with it transformers' sdpa path."""
    from transformers.masking_utils import sdpa_mask

    # Not for masks that carry more than causality (a sliding window or attention chunk the row exceeds, custom
    # or/and mask functions): some models (Qwen2-MoE) keep their window only in the mask.
    local_size = kwargs.get("local_size")
    plain_causal = not kwargs.get("use_vmap") and (local_size is None or kv_length <= local_size)
    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length and plain_causal:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


# Never traced by torch.compile (train.compile compiles each decoder layer around it): the documents are found on
# the host and attended in Python, which dynamo cannot trace and would recompile for every new set of documents. The
# layer's code before and after it is compiled. (In eager mode the wrapper costs ~0.4 us a call, measured.)
@torch.compiler.disable
def sdpa_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          position_ids: torch.Tensor | None = None, sliding_window: int | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [b, heads, S, d], key/value [b, kv_heads, S, d] ->
    ([b, S, heads, d_v], None). Documents of a row attend causally within themselves only."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    usable = position_ids is not None and position_ids.ndim == 2  # not None, not 3D (multimodal rope)
    probe = _probe.get()
    if probe is not None:
        probe.append(usable)
    batch, _, q_length, _ = query.shape
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    docs = kwargs.get(DOCUMENTS_KWARG)
    if isinstance(docs, Documents) and docs.sharded is not None and (docs.batch, docs.length) != (batch, q_length):
        # Rows split across context-parallel ranks: a mask the model built for this rank's share (a sliding window
        # longer than the share makes one) means nothing; the documents and the window apply over whole rows.
        return _sharded(module, query, key, value, dropout, scaling, position_ids, sliding_window, docs, kwargs)
    if attention_mask is not None or not usable or key.shape[2] != q_length or not causal:
        # A padding mask, a cache prefix or a bidirectional module: transformers' own path, mask and all.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_ids=position_ids, sliding_window=sliding_window, **kwargs)
    _refuse_unsupported(kwargs, _UNSUPPORTED_HERE)
    if not isinstance(docs, Documents) or (docs.batch, docs.length) != (batch, q_length):
        docs = None
    if docs is not None:
        kernel = packed_kernels.kernel_for(query, value, dropout, docs)
        if kernel == "varlen":
            return packed_kernels.varlen(query, key, value, docs, scaling, sliding_window), None
        if kernel == "masked":
            return packed_kernels.masked(query, key, value, docs, scaling, sliding_window, dropout), None
        if kernel == "flex":
            return packed_kernels.flex(query, key, value, docs, scaling, sliding_window), None
    spans = docs.spans if docs is not None else document_spans(position_ids, batch)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return _per_document(query, key, value, spans, dropout, scaling, sliding_window), None


def _per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[list[tuple[int, int]]],
                  dropout: float, scaling: float | None, sliding_window: int | None) -> torch.Tensor:
    """sdpa over each document of each row ([b, heads, S, d] in, [b, S, heads, d_v] out). The rows are unbound and
    cut by split, not sliced: the backward of a slice zero-fills a gradient of the whole input and adds it in, once
    per document (measured: 0.15 s of a 1.6 s step at 4 x 1024 tokens), where split's is one concatenation. The
    outputs are joined once, already in the [S, heads, d] layout the caller wants."""
    pieces = []
    for q_row, k_row, v_row, row_spans in zip(query.unbind(0), key.unbind(0), value.unbind(0), spans):
        sizes = [end - start for start, end in row_spans]
        # 4-D pieces: on a CPU, sdpa takes its flash kernel for [1, heads, L, d] and its math path for 3-D ones.
        for q, k, v in zip(*(t[None].split(sizes, dim=2) for t in (q_row, k_row, v_row))):
            window = _window_mask(q.shape[2], sliding_window, query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=window, dropout_p=dropout,
                                                 is_causal=window is None, scale=scaling)
            pieces.append(out[0].transpose(0, 1))  # [L, heads, d_v]
    joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return joined.reshape(query.shape[0], query.shape[2], *joined.shape[1:])


def _sharded(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
             scaling: float | None, position_ids: torch.Tensor, sliding_window: int | None, docs: Documents,
             kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """This rank's share of rows split across context-parallel ranks: the documents' exchange (docs.sharded), Ulysses's
    around this same attention over whole rows for this rank's heads, or the ring's own blockwise attention."""
    _refuse_unsupported(kwargs, "distributed.context_parallel does not support {} attention (this model's)")

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = sdpa_varlen_attention(module, q, k, v, None, dropout=dropout, scaling=scaling,
                                       position_ids=position_ids, sliding_window=sliding_window, **kwargs)
        return out.transpose(1, 2)  # [b, heads, S, d], as the exchange takes it

    out = docs.sharded(attend, query, key, value, scaling=scaling, sliding_window=sliding_window, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


_UNSUPPORTED_HERE = f"{ATTN_NAME} does not support {{}}; set model.attn_implementation: eager"


def _refuse_unsupported(kwargs: dict[str, Any], message: str) -> None:
    """A ValueError (`message` with the argument's name) for attention arguments our kernels do not apply."""
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(message.format(unsupported))


def _window_mask(length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Causal mask limited to the last `sliding_window` keys (transformers' rule: q - k < window), or None
    when the document is no longer than the window and plain causal attention is the same thing."""
    if sliding_window is None or length <= sliding_window:
        return None
    full = torch.ones(length, length, dtype=torch.bool, device=device)
    return full.tril() & full.triu(-(sliding_window - 1))
