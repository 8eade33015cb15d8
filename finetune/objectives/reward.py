"""Reward modelling (train.objective: reward): a sequence classification head scores each side of a preference
pair at its own last token (model/with_score.py), and the loss is the Bradley-Terry loss of each pair,
-log sigmoid(r_chosen - r_rejected - margin), plus center_coefficient x (r_chosen + r_rejected)^2 with reward
centering (pair_losses.bradley_terry_losses). A sum of per-pair terms over the step's pairs, so exact under any
split of the step, as DPO's; docs/preference.md, "Reward models".
"""

from __future__ import annotations

import torch

from finetune.batch import MicroBatch
from finetune.model.with_score import last_positions
from finetune.objectives.base import MicroResult, Preparation
from finetune.objectives.pair_losses import bradley_terry_losses
from finetune.objectives.rows import DatasetRows

METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "rewards_sum_squared")


def pair_scores(net: torch.nn.Module, batch: MicroBatch, device: torch.device,
                objective: str = "reward") -> tuple[torch.Tensor, torch.Tensor]:
    """The score of each pair's chosen and rejected sequence ([P] each, float32), read at each sequence's own last
    token: the last position of its document (pairs.doc_index: chosen 2i, rejected 2i+1, padding -1), in packed
    rows and padded ones alike, never a pad token."""
    batch.require("pairs", objective)
    batch = batch.to(device)
    pairs = batch.pairs
    ends = last_positions(pairs.doc_index, 2 * pairs.count)
    scores = net(input_ids=batch.input_ids, ends=ends, attention_mask=batch.attention_mask,
                 position_ids=batch.position_ids, documents=batch.documents)
    return scores[0::2], scores[1::2]


class Reward(DatasetRows):
    """A reward model: the summed Bradley-Terry pair losses over the step's pairs. Metrics per pair: the chosen and
    rejected scores, their margin, the accuracy (chosen scored strictly higher) and (r_c + r_r)^2, what centering
    penalizes."""

    name = "reward"
    units = ("pairs",)
    metrics = dict.fromkeys(METRICS, "pairs")
    needs = ("pairs",)

    def __init__(self, center_coefficient: float = 0.0) -> None:
        self.center_coefficient = center_coefficient

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """Nothing to prepare: a reward model has no reference."""

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        return {"pairs": batch.require("pairs", self.name).count}

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        r_c, r_r = pair_scores(net, batch, device, self.name)
        margins = batch.pairs.margins
        margin = None if margins is None else margins.to(device=r_c.device, dtype=r_c.dtype)
        losses = bradley_terry_losses(r_c, r_r, margin, self.center_coefficient)
        d = {"rewards_chosen": r_c.sum(), "rewards_rejected": r_r.sum(), "reward_margin": (r_c - r_r).sum(),
             "reward_accuracy": (r_c > r_r).sum(), "rewards_sum_squared": (r_c + r_r).square().sum()}
        return MicroResult({"pairs": losses.sum()}, {k: v.detach().double() for k, v in d.items()})
