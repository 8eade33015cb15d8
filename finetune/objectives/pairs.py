"""One forward of a preference micro-batch: each pair's summed log-probability of its chosen and rejected
completion, from per-token log-probabilities through the fused head (the full logits are never built)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.batch import MicroBatch


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


def pair_logps(net: torch.nn.Module, batch: MicroBatch, device: torch.device, objective: str = "dpo") -> PairLogps:
    """One forward of a preference micro-batch: per-token log-probabilities summed per document. Documents are
    numbered in the batch (pairs.doc_index, -1 for padding) with pair i's chosen document at 2i, rejected at 2i+1."""
    batch = batch.to(device)
    pairs = batch.require("pairs", objective)
    logp, keep = net(**batch.model_inputs(), per_token=True)
    doc = pairs.doc_index.reshape(-1).index_select(0, keep)
    n_docs = 2 * pairs.count
    sums = torch.zeros(n_docs, dtype=logp.dtype, device=device).index_add(0, doc, logp)
    tokens = torch.zeros(n_docs, dtype=logp.dtype, device=device).index_add(0, doc, torch.ones_like(logp))
    ref = pairs.ref_logps.to(dtype=logp.dtype).reshape(-1, 2)
    return PairLogps(sums[0::2], sums[1::2], tokens[0::2], tokens[1::2], ref[:, 0], ref[:, 1], logp, doc % 2 == 0)
