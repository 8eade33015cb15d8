"""Whole-sequence sums under context parallelism: what a per-sequence objective (DPO, ORPO) needs of rows split
across ranks.

A pair's loss is a non-linear function f of each side's summed log-probability S = s_0 + ... + s_{N-1}, where s_r
is the part of the sum over the positions rank r holds. Every rank of the group gets S by one all-reduce, and its
backward is the all-reduce's true adjoint (each s_r receives the sum of the gradients every rank's copy of S got),
so rank r's parameters see f'(S) ds_r. The loss itself is counted once per group (`counted_here`: the group's first
rank), like every figure of whole rows: the other ranks weigh their copy by 0, which still takes part in the
backward and its collective. Summed over the ranks by the gradient sync, the gradient is f'(S) dS, the one-process
one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _GroupSum(torch.autograd.Function):
    """S = the sum of every rank's x over the group; the gradient of each x is the sum of every rank's gradient of S."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def group_sum(x: torch.Tensor, context: Any) -> torch.Tensor:
    """`x` summed over the context-parallel group `context` (context_parallel.shard.ContextGroup; None: x itself),
    differentiably."""
    if context is None:
        return x
    return _GroupSum.apply(x, context.group)


def counted_here(context: Any) -> bool:
    """Whether this rank counts a figure of whole rows (a pair's loss, its count): always in one process; under
    context parallelism, on the group's first rank only."""
    return context is None or context.rank == 0
