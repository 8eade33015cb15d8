"""Ulysses attention (DeepSpeed-Ulysses, arXiv:2309.14509): around an attention function, a sequence-sharded batch
becomes head-sharded full sequences and back, by one all-to-all each way.

Each of the N ranks of the context-parallel group holds S / N consecutive positions of every sequence for all heads:
[B, H, S/N, D]. The exchange gives each rank every position for H / N of the heads, [B, H/N, S, D], so that the
attention it runs sees whole sequences: packed documents stay isolated exactly as in one process (the attention
gets the whole rows' document boundaries), whatever the shard boundaries cut. The output goes back the other way.
The exchanges are differentiable (each one's backward is the other), so the gradients are the one-process ones.

Key/value heads: split the same way when N divides their number (grouped-query attention keeps its grouping:
query head h of rank r still reads kv head h // (H / Hkv)); otherwise (fewer kv heads than ranks, say) they are
repeated to one per query head first, which costs memory, not exactness. Query heads must be a multiple of N, and
the sequence length too (the caller pads rows to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, split_dim: int, cat_dim: int, group: Any) -> torch.Tensor:
    """All-to-all: x cut into N equal parts along split_dim, part j sent to rank j; what arrives from the ranks is
    joined in rank order along cat_dim."""
    n = dist.get_world_size(group)
    parts = [p.contiguous() for p in x.chunk(n, dim=split_dim)]
    received = [torch.empty_like(parts[0]) for _ in range(n)]
    dist.all_to_all(received, parts, group=group)
    return torch.cat(received, dim=cat_dim)


class _SequenceToHeads(torch.autograd.Function):
    """[B, H, S/N, D] (this rank's positions, every head) -> [B, H/N, S, D] (every position, this rank's heads)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _exchange(x, 1, 2, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _exchange(grad, 2, 1, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """The inverse: [B, H/N, S, D] -> [B, H, S/N, D]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _exchange(x, 2, 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _exchange(grad, 1, 2, ctx.group), None


def check_heads(heads: int, ranks: int) -> None:
    """Query heads split evenly over the ranks, or a ValueError saying why not."""
    if heads % ranks:
        raise ValueError(f"Ulysses context parallelism over {ranks} ranks splits the attention heads among them: "
                         f"{heads} query heads do not divide by {ranks}")


def ulysses_attention(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any = None) -> torch.Tensor:
    """This rank's attention output [B, H, S/N, D] for its positions of query [B, H, S/N, D] and key, value
    [B, Hkv, S/N, D]: `attend(q, k, v)` runs on [B, H/N, S, D] and [B, Hkv', S, D] (whole sequences, this rank's
    heads) and returns [B, H/N, S, D]. `group`: the context-parallel process group (None: the default group)."""
    n = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, n)
    if kv_heads % n:  # too few kv heads to split: one per query head (GQA's own repetition, done before the split)
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_SequenceToHeads.apply(t, group) for t in (query, key, value))
    return _HeadsToSequence.apply(attend(q, k, v), group)
