"""Packing isolation under context parallelism, checked at run start (as model/isolation.py checks it whole): two
packed rows, [A | B] and [B | padding], split across the group's ranks with the cut inside the documents, run
twice, A's tokens changed the second time; B's logits on every rank must not move (TRL #6843's failure: packed
documents attending to earlier ones once the rows are split)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from finetune.batch import MicroBatch
from finetune.context_parallel.shard import ContextGroup, held_positions, shard_batch
from finetune.labels import IGNORE_INDEX

DOCUMENTS = (13, 9)  # A and B: with 2 or 4 ranks, the cuts fall inside both
SEED = 1234


def sharded_isolation_error(model: torch.nn.Module, vocab_size: int, context: ContextGroup,
                            device: torch.device) -> float:
    """The largest change of B's logits, over the group's ranks (the same value on each), caused by changing A."""
    gen = torch.Generator().manual_seed(SEED)
    n_a, n_b = DOCUMENTS
    a = torch.randint(0, vocab_size, (n_a,), generator=gen)
    changed = (a + torch.randint(1, vocab_size, (n_a,), generator=gen)) % vocab_size
    b = torch.randint(0, vocab_size, (n_b,), generator=gen)
    training = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            first, held = _logits(model, a, b, context, device)
            second, _ = _logits(model, changed, b, context, device)
    finally:
        for m, was in training:
            m.training = was
    at = {int(t): i for i, t in enumerate(held)}  # a position of the whole rows -> its place in this rank's share
    b_in_row0 = [at[t] for t in range(n_a, n_a + n_b) if t in at]
    b_in_row1 = [at[t] for t in range(n_b) if t in at]
    errors = [(first[0, b_in_row0] - second[0, b_in_row0]).abs().max() if b_in_row0 else first.new_zeros(()),
              (first[1, b_in_row1] - second[1, b_in_row1]).abs().max() if b_in_row1 else first.new_zeros(())]
    error = torch.stack(errors).max().reshape(1).double()
    error = torch.nan_to_num(error, nan=float("inf"))  # NaN must fail the check
    dist.all_reduce(error, op=dist.ReduceOp.MAX, group=context.group)
    return float(error)


def _logits(model: torch.nn.Module, a: torch.Tensor, b: torch.Tensor, context: ContextGroup,
            device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """(this rank's share of the two rows' logits, float32, the positions of the whole rows it holds)."""
    n_a, n_b = len(a), len(b)
    width = n_a + n_b
    ids = torch.zeros(2, width, dtype=torch.long)
    ids[0] = torch.cat([a, b])
    ids[1, :n_b] = b
    positions = torch.stack([torch.cat([torch.arange(n_a), torch.arange(n_b)]),
                             torch.cat([torch.arange(n_b), torch.arange(n_a)])])  # row 1's padding: a document
    labels = torch.full_like(ids, IGNORE_INDEX)
    batch = MicroBatch(ids, labels, targets=0, seq_tokens=width + n_b, padded_tokens=2 * width,
                       position_ids=positions)
    part = shard_batch(batch, context, device)
    out = model(input_ids=part.input_ids, position_ids=part.position_ids, use_cache=False,
                **part.documents.model_kwargs())
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float(), held_positions(context, part.documents.length).tolist()
