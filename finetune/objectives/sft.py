"""Supervised fine-tuning: the summed cross-entropy of the target tokens over the step's target tokens."""

from __future__ import annotations

import torch

from finetune.batch import MicroBatch
from finetune.objectives.base import MicroResult, Preparation
from finetune.objectives.rows import DatasetRows


class SFT(DatasetRows):
    """One term, the summed token cross-entropy of the micro-batch, over the step's target tokens."""

    name = "sft"
    units = ("tokens",)
    metrics: dict[str, str] = {}
    needs: tuple[str, ...] = ()

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """Nothing to prepare."""

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        return {"tokens": batch.targets}

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        loss_sum, _ = net(**batch.to(device).model_inputs())
        return MicroResult({"tokens": loss_sum})
