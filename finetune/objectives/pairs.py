"""One forward of a preference micro-batch: each pair's summed log-probability of its chosen and rejected
completion, from per-token log-probabilities through the fused head (the full logits are never built)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from finetune.batch import MicroBatch
from finetune.context_parallel.sequence_sums import group_sum


@dataclass
class PairLogps:
    """The policy's summed log-probabilities of each pair's chosen and rejected completion, their scored token
    counts, and the reference's (precomputed) log-probabilities: all [P]."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    n_chosen: torch.Tensor
    n_rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    token_logps: torch.Tensor  # every scored token's log-probability (what the NLL sums)
    token_is_chosen: torch.Tensor


def pair_logps(net: torch.nn.Module, batch: MicroBatch, device: torch.device, objective: str = "dpo",
               whole_chosen: bool = False) -> PairLogps:
    """One forward of a preference micro-batch: per-token log-probabilities summed per document. Documents are
    numbered in the batch (pairs.doc_index, -1 for padding) with pair i's chosen document at 2i, rejected at 2i+1.

    `whole_chosen` (orpo.nll: sequence) also scores every token of each chosen side but its first, the prompt's
    too: they are in token_logps (the NLL), while the sums and counts stay the completions'."""
    batch.require("pairs", objective)
    completion = None
    if whole_chosen and batch.context is not None:  # refused by the recipe's checks (objective_checks.py)
        raise ValueError("orpo.nll: sequence rescores the whole rows, which context parallelism has split")
    if whole_chosen:
        batch, completion = _whole_chosen(batch)
    batch = batch.to(device)
    pairs = batch.pairs
    logp, keep = net(**batch.model_inputs(), per_token=True)
    doc = pairs.doc_index.reshape(-1).index_select(0, keep)
    n_docs = 2 * pairs.count
    counted = torch.ones_like(logp)
    if completion is not None:  # the completions' tokens among the scored ones
        counted = completion.reshape(-1).to(device).index_select(0, keep).to(logp.dtype)
    sums = torch.zeros(n_docs, dtype=logp.dtype, device=device).index_add(0, doc, logp * counted)
    tokens = torch.zeros(n_docs, dtype=logp.dtype, device=device).index_add(0, doc, counted)
    # Rows split across context-parallel ranks: each rank summed its positions; every rank gets the whole sums.
    sums, tokens = group_sum(sums, batch.context), group_sum(tokens, batch.context)
    ref = pairs.ref_logps.to(dtype=logp.dtype).reshape(-1, 2)
    return PairLogps(sums[0::2], sums[1::2], tokens[0::2], tokens[1::2], ref[:, 0], ref[:, 1], logp, doc % 2 == 0)


def _whole_chosen(batch: MicroBatch) -> tuple[MicroBatch, torch.Tensor]:
    """The micro-batch with every chosen-side token but each side's first as a target, and which positions score
    a completion token ([B, T] bool; position t scores labels[t + 1], as the loss's targets do)."""
    labels, ids, doc = batch.labels.cpu(), batch.input_ids.cpu(), batch.pairs.doc_index.cpu()
    first = torch.ones_like(doc, dtype=torch.bool)
    first[..., 1:] = doc[..., 1:] != doc[..., :-1]
    chosen = (doc >= 0) & (doc % 2 == 0) & ~first
    completion = torch.zeros_like(first)
    completion[..., :-1] = labels[..., 1:] >= 0  # a token id; IGNORE_INDEX is negative
    widened = dataclasses.replace(batch, labels=torch.where(chosen, ids, labels), device=None,
                                  target_positions=None, documents=None)
    return widened, completion


def chosen_sequence_tokens(batch: MicroBatch) -> int:
    """The tokens of the micro-batch's chosen sides but each side's first: what orpo.nll: sequence scores."""
    pairs = batch.pairs
    doc = pairs.doc_index.cpu()
    return int(((doc >= 0) & (doc % 2 == 0)).sum()) - pairs.count
