"""The context-parallel groups of a torchrun world: world = data parallel x context parallel, consecutive ranks
sharing rows (ranks 0..N-1 the first group's, N..2N-1 the next, ...), so that on a multi-GPU machine a group's
all-to-all stays within a node's fast links."""

from __future__ import annotations

import torch.distributed as dist

from finetune.context_parallel.shard import ContextGroup
from finetune.errors import UserError


def context_group(rank: int, world_size: int, ranks: int, method: str = "ulysses") -> ContextGroup | None:
    """This rank's context-parallel group of `ranks` (distributed.context_parallel) splitting the attention by
    `method` (distributed.context_parallel_method), made on every rank (each group is a collective creation), or None
    when `ranks` is 1."""
    if ranks == 1:
        return None
    if world_size % ranks:
        raise UserError(f"distributed.context_parallel: {ranks} does not divide the world size {world_size}: the "
                        "ranks are data parallel x context parallel")
    mine = None
    for first in range(0, world_size, ranks):
        group = dist.new_group(list(range(first, first + ranks)))
        if first <= rank < first + ranks:
            mine = ContextGroup(rank - first, ranks, group, method)
    return mine


def data_parallel(rank: int, world_size: int, context: ContextGroup | None) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size): which rows it shares with its group."""
    if context is None:
        return rank, world_size
    return rank // context.ranks, world_size // context.ranks
