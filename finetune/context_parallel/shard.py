"""A micro-batch's rows split across the ranks of a context-parallel group (distributed.context_parallel).

Every rank of the group collates the same rows; each then keeps its N-th of every row's positions (`held`): with
Ulysses consecutive, rank r holding [r * S/N, (r + 1) * S/N) (rows padded to a multiple of N with one more isolated
document); with the ring two chunks of 2N, r and 2N - 1 - r (ring.ring_layout; rows padded to a multiple of 2N).
What crosses the cut is settled on the whole rows, once, before they are split:

* the targets: position t scores the label of position t + 1 (the shift), found on the whole rows, so the last
  position of a rank's share scores the first label of the next rank's (the bug of verl #6068 cannot happen: nothing
  is shifted after the split); each rank keeps the targets at its own positions, and its count is its share of the
  step's, which the trainer sums over every rank as any other count;
* the documents: the whole rows' boundaries (from their position ids: padded rows become packed rows of one document
  each), which every rank's attention sees (ulysses.py for its heads, ring.py at every block's positions), so
  packed documents stay isolated across the cut;
* the position ids travel with their tokens (rotary embeddings read them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from finetune.batch import Documents, MicroBatch, StoredTeacherFields, Targets, find_targets, to_device
from finetune.context_parallel.ring import document_ids, ring_attention, ring_layout
from finetune.context_parallel.ulysses import ulysses_attention
from finetune.labels import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its context-parallel group: its index in it, the group's size, the process group."""

    rank: int
    ranks: int
    group: Any
    method: str = "ulysses"
    """How the attention is split (distributed.context_parallel_method): ulysses or ring."""


def held_positions(context: ContextGroup, length: int) -> np.ndarray:
    """The positions of a row of `length` (a multiple of `multiple(context)`) that this rank holds, in its order."""
    if context.method == "ring":
        return ring_layout(context.rank, context.ranks, length).numpy()
    share = length // context.ranks
    return np.arange(context.rank * share, (context.rank + 1) * share)


def multiple(context: ContextGroup) -> int:
    """What the rows' length must divide by: N (Ulysses), 2N (the ring's load-balanced chunks)."""
    return 2 * context.ranks if context.method == "ring" else context.ranks


def shard_batch(batch: MicroBatch, context: ContextGroup, device: torch.device) -> MicroBatch:
    """This rank's share of a collated micro-batch (on the host), moved to `device`, its targets and documents found
    on the whole rows. Its real-token count (a metric) is the group's first rank's, whole: summed over the ranks it
    is the rows' count once."""
    ids, labels, positions = _padded_to(*_packed_form(batch), multiple(context))
    length = ids.shape[1]
    share = length // context.ranks
    held = held_positions(context, length)
    at = np.full(length, -1, dtype=np.int64)  # each position's place in this rank's share, -1 elsewhere
    at[held] = np.arange(share)
    take = torch.from_numpy(held)
    whole = find_targets(labels)
    index, target_ids = whole.index.numpy(), whole.ids.numpy()
    row, pos = index // length, at[index % length]
    mine = pos >= 0  # the whole rows' targets in order, and this rank's in the same order (held is increasing)
    local = torch.from_numpy(row[mine] * share + pos[mine])
    local_ids = torch.from_numpy(target_ids[mine].astype(np.int64))
    low, high = (int(local_ids.min()), int(local_ids.max())) if len(local_ids) else (0, 0)
    targets = Targets(to_device(local, device), len(local), low, high, to_device(local_ids, device))
    documents = Documents.of(positions, device)
    documents.sharded = _exchange(context, documents, device)
    teacher = batch.teacher
    if teacher is not None:  # a stored teacher's rows are in the order of the whole rows' targets
        keep = torch.from_numpy(mine)
        teacher = StoredTeacherFields(teacher.ids[keep], teacher.logprobs[keep]).to(device)
    pairs = batch.pairs
    if pairs is not None:  # each position's document travels with its token; the pairs' sums: sequence_sums.py
        doc_index = _lengthened(pairs.doc_index.cpu(), length - pairs.doc_index.shape[1], -1)  # padding: no pair
        pairs = dataclasses.replace(pairs, doc_index=doc_index[:, take]).to(device)
    return dataclasses.replace(
        batch, input_ids=to_device(ids[:, take], device), pairs=pairs, context=context,
        labels=to_device(labels[:, take], device), targets=len(local),
        seq_tokens=batch.seq_tokens if context.rank == 0 else 0, padded_tokens=ids.shape[0] * share,
        position_ids=to_device(positions[:, take], device), attention_mask=None, teacher=teacher,
        device=device, target_positions=targets, documents=documents)


def _exchange(context: ContextGroup, documents: Documents, device: torch.device) -> Any:
    """The attention's exchange for this micro-batch: sharded(attend, query, key, value, scaling=, sliding_window=,
    dropout=) -> this rank's output [B, H, S/N, D] (finetune/attention/dispatch.py calls it)."""
    if context.method == "ring":
        doc_ids = document_ids(documents.spans, documents.length, device)  # once per micro-batch, not per layer
        return functools.partial(_ring, doc_ids=doc_ids, group=context.group)
    return functools.partial(_ulysses, group=context.group)


def _ulysses(attend: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float | None,
             sliding_window: int | None, dropout: float, group: Any) -> torch.Tensor:
    """Ulysses around `attend`, which applies the scaling, the window and the dropout itself."""
    return ulysses_attention(attend, query, key, value, group=group)


def _ring(attend: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float | None,
          sliding_window: int | None, dropout: float, doc_ids: torch.Tensor, group: Any) -> torch.Tensor:
    """The ring's own blockwise attention (`attend` unused): no dropout."""
    if dropout:
        raise ValueError(f"distributed.context_parallel_method: ring has no attention dropout, and this model's is "
                         f"{dropout}: set model.config.attention_dropout=0, or use ulysses")
    return ring_attention(query, key, value, doc_ids, scaling=scaling, sliding_window=sliding_window, group=group)


def _packed_form(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, position ids) of the rows, [b, L] on the host: padded rows (right-padded, an attention mask) as
    packed rows of one document each, their padding one more document (its positions restart at 0)."""
    ids, labels = batch.input_ids.cpu(), batch.labels.cpu()
    if batch.attention_mask is None:
        return ids, labels, batch.position_ids.cpu()
    real = batch.attention_mask.cpu().bool()
    steps = torch.arange(ids.shape[1])[None]
    return ids, labels, torch.where(real, steps, steps - real.sum(dim=1, keepdim=True))


def _padded_to(ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
               ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows lengthened to a multiple of `ranks` with one more document (token 0, no label, positions from 0)."""
    extra = -ids.shape[1] % ranks
    if not extra:
        return ids, labels, positions
    rows = ids.shape[0]
    return (_lengthened(ids, extra, 0), _lengthened(labels, extra, IGNORE_INDEX),
            torch.cat([positions, torch.arange(extra).expand(rows, extra)], dim=1))


def _lengthened(rows: torch.Tensor, extra: int, fill: int) -> torch.Tensor:
    """[b, L] rows with `extra` more columns of `fill`."""
    return torch.cat([rows, rows.new_full((rows.shape[0], extra), fill)], dim=1) if extra else rows
