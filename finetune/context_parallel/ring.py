"""Ring attention (Liu et al., arXiv:2310.01889) for context parallelism: each rank keeps its queries and passes the
key/value blocks around the ring of the N ranks, one step at a time, so every query meets every key of its row
without any rank holding whole rows.

Ulysses (ulysses.py) trades positions for heads and so needs the query heads to divide by N; the ring splits
nothing but positions, so it works for any head count (grouped-query attention included), at the price of N - 1
point-to-point steps, each overlapped with the attention of the block in hand. Each block's attention is merged
into a running output by its log-sum-exp (online softmax), which is exact: the output and the gradients are one
process's. Positions are dealt in a "zigzag" (ring_layout): the row is cut into 2N chunks and rank r holds chunks r
and 2N - 1 - r, so under causal attention every rank has the same work (an early chunk pairs with a late one).
Packed documents stay isolated, and a sliding window applies, over whole rows: the mask of each block comes from
the whole rows' document ids at the two ranks' global positions. Chunk pairs that the mask hides entirely (a later
chunk, out of the window, no document in common) are skipped; the ring steps are not, so the ranks stay matched.

The backward recomputes each block's probabilities from the saved queries, output and log-sum-exp (flash
attention's backward) while the key/value blocks go round again; their gradients travel with them and arrive home
after the last step. The math is float32 for inputs of lower precision (bfloat16, float16), float64 for float64.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def check_length(length: int, ranks: int) -> None:
    """Rows that cut into 2 * ranks equal chunks (ring_layout), or a ValueError saying why not."""
    if length % (2 * ranks):
        raise ValueError(f"ring attention over {ranks} ranks deals each row in {2 * ranks} equal chunks (two per "
                         f"rank, load-balanced for causal attention): a row of {length} positions does not divide "
                         f"by {2 * ranks}; pad the rows to a multiple of it")


def ring_layout(rank: int, ranks: int, length: int) -> torch.Tensor:
    """The positions (int64, [length // ranks]) rank `rank` of `ranks` holds of a row of `length`: of the row cut in
    2 * ranks equal chunks, chunk `rank` then chunk 2 * ranks - 1 - rank."""
    check_length(length, ranks)
    chunk = length // (2 * ranks)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in _chunks(rank, ranks)])


def document_ids(spans: list[list[tuple[int, int]]], length: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Document ids [b, length] (int64) of packed rows from their (start, end) document spans (Documents.spans):
    what ring_attention takes as `doc_ids`. Positions outside every span get an id of their own each."""
    ids = torch.arange(length).repeat(len(spans), 1) + length  # apart from any document's
    for row, row_spans in enumerate(spans):
        for number, (start, end) in enumerate(row_spans):
            ids[row, start:end] = number
    return ids.to(device)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, doc_ids: torch.Tensor, *,
                   scaling: float | None = None, sliding_window: int | None = None, group: Any = None) -> torch.Tensor:
    """This rank's attention output [B, H, S/N, Dv] over whole rows, for its positions (ring_layout of its index in
    `group`) of query [B, H, S/N, D] and key, value [B, Hkv, S/N, D | Dv] (H a multiple of Hkv; query head h reads
    kv head h // (H / Hkv)). `doc_ids` [B, S]: the whole rows' document id at every position (the same on every
    rank); keys are visible to a query of the same document, at most as late, and fewer than `sliding_window`
    positions before it. `scaling`: the score scale (None: 1 / sqrt(D)). `group`: the context-parallel process
    group (None: the default group). Differentiable in query, key and value."""
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    batch, heads, share, dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if key.shape[2] != share or value.shape[:3] != key.shape[:3] or key.shape[0] != batch:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match query "
                         f"{tuple(query.shape)} in batch and positions")
    if tuple(doc_ids.shape) != (batch, share * ranks):
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} should be the whole rows' [{batch}, {share * ranks}] "
                         f"({ranks} ranks of {share} positions)")
    check_length(share * ranks, ranks)
    scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    return _RingAttention.apply(query, key, value, doc_ids, scale, window, group)


# --- the ring -------------------------------------------------------------------------------------------------------


def _chunks(rank: int, ranks: int) -> tuple[int, int]:
    """The two chunks (of 2 * ranks) rank `rank` holds, in order."""
    return rank, 2 * ranks - 1 - rank


class _Ring:
    """This rank's place in the ring of `group`: its index, the size, and the global ranks of its neighbours."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        if self.ranks > 1:
            pg = group if group is not None else dist.group.WORLD
            self.next = dist.get_global_rank(pg, (self.rank + 1) % self.ranks)
            self.prev = dist.get_global_rank(pg, (self.rank - 1) % self.ranks)

    def source(self, step: int) -> int:
        """Whose key/value block this rank holds at `step`."""
        return (self.rank - step) % self.ranks

    def start_pass(self, tensor: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list[Any]]:
        """Send `tensor` to the next rank and receive the previous rank's into a new buffer, without waiting: the
        buffer and the pending works (wait on them before reading the buffer or writing `tensor`). `tag` keeps two
        passes in flight at once apart (the blocks and their gradients, in the backward)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.prev, self.group, tag)]
        return received, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _mask(doc_ids: torch.Tensor, q_chunk: int, k_chunk: int, chunk: int, window: int | None) -> torch.Tensor:
    """[B, chunk, chunk] bool: which keys of chunk `k_chunk` each query of chunk `q_chunk` sees (same document, not
    later, within the window), positions counted in the whole rows."""
    device = doc_ids.device
    q_pos = torch.arange(q_chunk * chunk, (q_chunk + 1) * chunk, device=device)
    k_pos = torch.arange(k_chunk * chunk, (k_chunk + 1) * chunk, device=device)
    behind = q_pos[:, None] - k_pos[None, :]
    seen = behind >= 0
    if window is not None:
        seen = seen & (behind < window)
    return (doc_ids[:, q_pos, None] == doc_ids[:, None, k_pos]) & seen


def _statically_hidden(q_chunk: int, k_chunk: int, chunk: int, window: int | None) -> bool:
    """Whether every key of k_chunk is hidden from every query of q_chunk by position alone: later, or out of the
    window."""
    if k_chunk > q_chunk:
        return True
    return window is not None and (q_chunk - k_chunk - 1) * chunk + 1 >= window


def _visible_pairs(doc_ids: torch.Tensor, ring: _Ring, chunk: int, window: int | None) -> list[list[bool]]:
    """For each ring step, for each (query chunk, key chunk) pair of this rank and the step's source (row-major, 4),
    whether any query sees any key: one host sync for the whole pass."""
    flags: list[torch.Tensor | bool] = []
    for step in range(ring.ranks):
        for q_chunk in _chunks(ring.rank, ring.ranks):
            for k_chunk in _chunks(ring.source(step), ring.ranks):
                if _statically_hidden(q_chunk, k_chunk, chunk, window):
                    flags.append(False)
                elif q_chunk == k_chunk:
                    flags.append(True)  # the diagonal: every query sees itself
                else:
                    flags.append(_mask(doc_ids, q_chunk, k_chunk, chunk, window).any())
    tensors = [f for f in flags if isinstance(f, torch.Tensor)]
    found = iter(torch.stack(tensors).tolist() if tensors else [])
    values = [bool(next(found)) if isinstance(f, torch.Tensor) else f for f in flags]
    return [values[i:i + 4] for i in range(0, len(values), 4)]


# --- one block -----------------------------------------------------------------------------------------------------


# The scores of a block are built a tile of queries at a time, at most this many elements (float32: 16 MiB): a
# block of 8192 x 8192 positions and 8 heads would otherwise hold 2 GiB of scores, and as much again of probabilities.
TILE_ELEMENTS = 1 << 22


def _query_tiles(q: torch.Tensor, keys: int) -> int:
    """Queries per tile of q [B, Hkv, G, Lq, D] against `keys` keys."""
    per_query = q.shape[0] * q.shape[1] * q.shape[2] * max(keys, 1)
    return max(1, TILE_ELEMENTS // per_query)


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of q [B, Hkv, G, Lq, D] (already scaled) over k, v [B, Hkv, Lk, D]: the output
    [B, Hkv, G, Lq, Dv] and the log-sum-exp of the scores [B, Hkv, G, Lq] (-inf where a query sees no key, its
    output 0). A tile of queries at a time (TILE_ELEMENTS)."""
    tile = _query_tiles(q, k.shape[2])
    outs, lses = [], []
    for start in range(0, q.shape[3], tile):
        q_tile, m_tile = q[:, :, :, start:start + tile], mask[:, start:start + tile]
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q_tile, k).masked_fill(~m_tile[:, None, None], -math.inf)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(lse)[..., None])
        outs.append(torch.einsum("bhgqk,bhkd->bhgqd", probs, v))
        lses.append(lse)
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no key seen) as 0, so that exp(-inf - lse) is 0 rather than NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax attentions over disjoint keys, by their log-sum-exps, as one (online softmax)."""
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], merged


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one block (flash attention's backward, probabilities recomputed from the final lse) in q
    (scaled, as _block_forward takes it), k and v: dS = P * (dP - delta), delta = rowsum(dO * O). A tile of
    queries at a time, as the forward."""
    tile = _query_tiles(q, k.shape[2])
    d_qs, d_k, d_v = [], None, None
    for start in range(0, q.shape[3], tile):
        part = slice(start, start + tile)
        q_t, g_t, lse_t, delta_t = (t[:, :, :, part] for t in (q, grad, lse, delta))
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q_t, k).masked_fill(~mask[:, part][:, None, None], -math.inf)
        probs = torch.exp(scores - _finite(lse_t)[..., None])
        d_scores = probs * (torch.einsum("bhgqd,bhkd->bhgqk", g_t, v) - delta_t[..., None])
        d_qs.append(torch.einsum("bhgqk,bhkd->bhgqd", d_scores, k))
        k_part = torch.einsum("bhgqk,bhgqd->bhkd", d_scores, q_t)
        v_part = torch.einsum("bhgqk,bhgqd->bhkd", probs, g_t)
        d_k, d_v = (k_part, v_part) if d_k is None else (d_k + k_part, d_v + v_part)
    return torch.cat(d_qs, dim=3), d_k, d_v


# --- the autograd function -----------------------------------------------------------------------------------------


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _grouped(query: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    """query [B, H, L, D] -> [B, Hkv, H/Hkv, L, D] (float32 at least), scaled: query head h under kv head
    h // (H / Hkv)."""
    b, h, length, d = query.shape
    return query.to(_math_dtype(query)).reshape(b, kv_heads, h // kv_heads, length, d) * scale


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                doc_ids: torch.Tensor, scale: float, window: int | None, group: Any) -> torch.Tensor:
        ring = _Ring(group)
        chunk = query.shape[2] // 2
        visible = _visible_pairs(doc_ids, ring, chunk, window)
        q = _grouped(query, key.shape[1], scale)
        q_halves = q.split(chunk, dim=3)
        outs = [q.new_zeros(*h.shape[:-1], value.shape[-1]) for h in q_halves]
        lses = [q.new_full(h.shape[:-1], -math.inf) for h in q_halves]
        kv = torch.cat([key, value], dim=-1).contiguous()
        for step in range(ring.ranks):
            incoming, works = ring.start_pass(kv) if step < ring.ranks - 1 else (kv, [])
            k_block, v_block = kv.to(q.dtype).split([key.shape[-1], value.shape[-1]], dim=-1)
            k_halves, v_halves = k_block.split(chunk, dim=2), v_block.split(chunk, dim=2)
            pairs = [(i, j) for i in range(2) for j in range(2)]
            for (i, j), seen in zip(pairs, visible[step]):
                if seen:
                    mask = _mask(doc_ids, _chunks(ring.rank, ring.ranks)[i],
                                 _chunks(ring.source(step), ring.ranks)[j], chunk, window)
                    block = _block_forward(q_halves[i], k_halves[j], v_halves[j], mask)
                    outs[i], lses[i] = _merge(outs[i], lses[i], *block)
            _wait(works)
            kv = incoming
        out, lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
        ctx.save_for_backward(query, key, value, doc_ids, out, lse)
        ctx.ring, ctx.visible, ctx.scale, ctx.window = ring, visible, scale, window
        b, h, length, _ = query.shape
        return out.reshape(b, h, length, value.shape[-1]).to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        query, key, value, doc_ids, out, lse = ctx.saved_tensors
        ring, chunk, window = ctx.ring, query.shape[2] // 2, ctx.window
        q = _grouped(query, key.shape[1], ctx.scale)
        grad = grad_out.to(out.dtype).reshape(out.shape)
        delta = (grad * out).sum(dim=-1)
        halves = [t.split(chunk, dim=3) for t in (q, grad, lse, delta)]
        d_q = [torch.zeros_like(h) for h in halves[0]]
        split = [key.shape[-1], value.shape[-1]]
        kv = torch.cat([key, value], dim=-1).contiguous()
        d_kv = torch.zeros(kv.shape, dtype=q.dtype, device=kv.device)
        for step in range(ring.ranks):
            incoming, works = ring.start_pass(kv) if step < ring.ranks - 1 else (kv, [])
            k_halves, v_halves = (t.split(chunk, dim=2) for t in kv.to(q.dtype).split(split, dim=-1))
            d_k_halves, d_v_halves = (t.split(chunk, dim=2) for t in d_kv.split(split, dim=-1))  # views of d_kv
            pairs = [(i, j) for i in range(2) for j in range(2)]
            for (i, j), seen in zip(pairs, ctx.visible[step]):
                if seen:
                    mask = _mask(doc_ids, _chunks(ring.rank, ring.ranks)[i],
                                 _chunks(ring.source(step), ring.ranks)[j], chunk, window)
                    block = _block_backward(halves[0][i], k_halves[j], v_halves[j], halves[1][i], halves[2][i],
                                            halves[3][i], mask)
                    d_q[i] += block[0]
                    d_k_halves[j].add_(block[1])
                    d_v_halves[j].add_(block[2])
            if ring.ranks > 1:  # the block's gradient goes on with it; after the last step, home to its owner
                d_incoming, d_works = ring.start_pass(d_kv, tag=1)
                _wait(works + d_works)
                kv, d_kv = incoming, d_incoming
        d_key, d_value = d_kv.split(split, dim=-1)
        d_query = (torch.cat(d_q, dim=3) * ctx.scale).reshape(query.shape)
        return (d_query.to(query.dtype), d_key.to(key.dtype), d_value.to(value.dtype), None, None, None, None)
