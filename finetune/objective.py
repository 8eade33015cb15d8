"""What a micro-batch's loss is: the seam between the training loop and the thing being optimized.

The loop owns the loss contract (docs/design.md, "The loss contract"): it sums each count of the step over
every micro-batch and rank before the first backward, backpropagates each micro-batch's summed loss terms
divided by those step-wide counts, and logs the step's loss as the sum of all terms over all counts. An
objective only says, for one micro-batch, what its counts are (known from the collated batch, before any
forward) and what its summed loss terms are. A term is normalized by the count of the same name, so an
objective may mix units (tokens and pairs) and each stays exact under any split of the step.

SFT is the first objective: one term, the summed token cross-entropy, normalized by the target tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch

from finetune.model_with_loss import model_inputs


class Objective(Protocol):
    """One training objective (SFT, later DPO and ORPO)."""

    name: str
    units: tuple[str, ...]
    """The names of its counts and loss terms, in a fixed order (e.g. ("tokens",), ("tokens", "pairs"))."""

    def counts(self, batch: dict) -> dict[str, int]:
        """This micro-batch's units by name (target tokens, pairs, ...): the denominators of its loss terms."""
        ...

    def loss_terms(self, net: torch.nn.Module, batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
        """The micro-batch's summed loss per count name, as 0-dim tensors in the graph: the loop divides each by
        the step's count of that name. A micro-batch with no units still returns terms in the graph (zeros), so
        every rank joins every collective."""
        ...


class SFT:
    """Supervised fine-tuning: the summed cross-entropy of the target tokens over the step's target tokens."""

    name = "sft"
    units = ("tokens",)

    def counts(self, batch: dict) -> dict[str, int]:
        return {"tokens": batch["targets"]}

    def loss_terms(self, net: torch.nn.Module, batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
        loss_sum, _ = net(**model_inputs(batch, device))
        return {"tokens": loss_sum}

