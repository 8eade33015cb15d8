"""A micro-batch's rows split across the ranks of a context-parallel group (distributed.context_parallel).

Every rank of the group collates the same rows; each then keeps its N-th of every row's positions, consecutive:
rank r holds positions [r * S/N, (r + 1) * S/N) (rows padded to a multiple of N with one more isolated document).
What crosses the cut is settled on the whole rows, once, before they are split:

* the targets: position t scores the label of position t + 1 (the shift), found on the whole rows, so the last
  position of a rank's share scores the first label of the next rank's (the bug of verl #6068 cannot happen: nothing
  is shifted after the split); each rank keeps the targets at its own positions, and its count is its share of the
  step's, which the trainer sums over every rank as any other count;
* the documents: the whole rows' boundaries (from their position ids: padded rows become packed rows of one document
  each), which every rank's attention sees for its heads (ulysses.py), so packed documents stay isolated across the
  cut;
* the position ids travel with their tokens (rotary embeddings read them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from finetune.batch import Documents, MicroBatch, StoredTeacherFields, Targets, find_targets, to_device
from finetune.context_parallel.ulysses import ulysses_attention
from finetune.labels import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its context-parallel group: its index in it, the group's size, the process group."""

    rank: int
    ranks: int
    group: Any


def shard_batch(batch: MicroBatch, context: ContextGroup, device: torch.device) -> MicroBatch:
    """This rank's share of a collated micro-batch (on the host), moved to `device`, its targets and documents found
    on the whole rows. Its real-token count (a metric) is the group's first rank's, whole: summed over the ranks it
    is the rows' count once."""
    ids, labels, positions = _padded_to(*_packed_form(batch), context.ranks)
    length = ids.shape[1]
    share = length // context.ranks
    lo, hi = context.rank * share, (context.rank + 1) * share
    whole = find_targets(labels)
    index, target_ids = whole.index.numpy(), whole.ids.numpy()
    row, pos = index // length, index % length
    mine = (pos >= lo) & (pos < hi)
    local = torch.from_numpy((row[mine] * share + pos[mine] - lo).astype(np.int64))
    local_ids = torch.from_numpy(target_ids[mine].astype(np.int64))
    low, high = (int(local_ids.min()), int(local_ids.max())) if len(local_ids) else (0, 0)
    targets = Targets(to_device(local, device), len(local), low, high, to_device(local_ids, device))
    documents = Documents.of(positions, device)
    documents.sharded = functools.partial(ulysses_attention, group=context.group)
    teacher = batch.teacher
    if teacher is not None:  # a stored teacher's rows are in the order of the whole rows' targets
        keep = torch.from_numpy(mine)
        teacher = StoredTeacherFields(teacher.ids[keep], teacher.logprobs[keep]).to(device)
    pairs = batch.pairs
    if pairs is not None:  # each position's document travels with its token; the pairs' sums: sequence_sums.py
        doc_index = _padded_to(pairs.doc_index.cpu(), labels, positions, context.ranks, fill=-1)[0]
        pairs = dataclasses.replace(pairs, doc_index=doc_index[:, lo:hi].contiguous()).to(device)
    return dataclasses.replace(
        batch, input_ids=to_device(ids[:, lo:hi].contiguous(), device), pairs=pairs, context=context,
        labels=to_device(labels[:, lo:hi].contiguous(), device), targets=len(local),
        seq_tokens=batch.seq_tokens if context.rank == 0 else 0, padded_tokens=ids.shape[0] * share,
        position_ids=to_device(positions[:, lo:hi].contiguous(), device), attention_mask=None, teacher=teacher,
        device=device, target_positions=targets, documents=documents)


def _packed_form(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, position ids) of the rows, [b, L] on the host: padded rows (right-padded, an attention mask) as
    packed rows of one document each, their padding one more document (its positions restart at 0)."""
    ids, labels = batch.input_ids.cpu(), batch.labels.cpu()
    if batch.attention_mask is None:
        return ids, labels, batch.position_ids.cpu()
    real = batch.attention_mask.cpu().bool()
    steps = torch.arange(ids.shape[1])[None]
    return ids, labels, torch.where(real, steps, steps - real.sum(dim=1, keepdim=True))


def _padded_to(ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, ranks: int,
               fill: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows lengthened to a multiple of `ranks` with one more document (token `fill`, no label, positions from
    0)."""
    extra = -ids.shape[1] % ranks
    if not extra:
        return ids, labels, positions
    rows = ids.shape[0]
    return (torch.cat([ids, ids.new_full((rows, extra), fill)], dim=1),
            torch.cat([labels, labels.new_full((rows, extra), IGNORE_INDEX)], dim=1),
            torch.cat([positions, torch.arange(extra).expand(rows, extra)], dim=1))
