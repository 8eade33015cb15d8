"""Supervised fine-tuning: the summed cross-entropy of the target tokens over the step's target tokens.

A mixture-of-experts model whose config has output_router_logits adds its router's load-balancing loss as its own
forward would (finetune/model/router_loss.py): each micro-batch's value times its target tokens joins the term, so
over the step's target tokens it weighs the micro-batch's share of them, and the step's value is logged as
`router_aux_loss` (docs/models.md, "The router's load-balancing loss").
"""

from __future__ import annotations

import torch

from finetune.batch import MicroBatch
from finetune.model.router_loss import METRIC as ROUTER_METRIC
from finetune.model.router_loss import router_loss
from finetune.objectives.base import MicroResult, Preparation
from finetune.objectives.rows import DatasetRows


class SFT(DatasetRows):
    """One term, the summed token cross-entropy of the micro-batch (with the router's load-balancing loss where the
    model adds one), over the step's target tokens."""

    name = "sft"
    units = ("tokens",)
    metrics: dict[str, str] = {}
    needs: tuple[str, ...] = ()
    adds_router_loss = True

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """The router's load-balancing loss logged when the model adds one (over the step's target tokens)."""
        self.metrics = {ROUTER_METRIC: "tokens"} if router_loss(lm) is not None else {}

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        return {"tokens": batch.targets}

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        loss_sum, metrics = net(**batch.to(device).model_inputs(), metrics=True)
        return MicroResult({"tokens": loss_sum}, {m: metrics[m] for m in self.metrics})
