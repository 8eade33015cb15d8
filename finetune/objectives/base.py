"""What a micro-batch's loss is: the seam between the training loop and the thing being optimized.

The loop owns the loss contract (docs/design.md, "The loss contract"): it sums each count of the step over
every micro-batch and rank before the first backward, backpropagates each micro-batch's summed loss terms
divided by those step-wide counts, and logs the step's loss as the sum of all terms over all counts. An
objective only says, for one micro-batch, what its counts are (known from the collated batch, before any
forward) and what its summed loss terms are. A term is normalized by the count of the same name, so an
objective may mix units (tokens and pairs) and each stays exact under any split of the step. Metrics are sums
too, each divided by the step's count of its unit when logged.

SFT: one term, the summed token cross-entropy, over the target tokens. DPO: the summed pair losses over the
pairs. ORPO: the chosen completions' summed token cross-entropy over their tokens, plus beta times the summed
odds-ratio terms over the pairs.

An objective also says where its rows come from (`samples`, `plan`): the datasets' samples dealt by the StepPlan
(objectives/rows.py), or GRPO's rollouts with their advantages (finetune/rl), so the trainer never asks which
objective it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from finetune import dist
from finetune.batch import MicroBatch
from finetune.data import StepPlan
from finetune.data.cache import Prepared
from finetune.recipe import Recipe
from finetune.rl.plan import RolloutPlan


@dataclass
class MicroResult:
    """One micro-batch's summed loss per unit (in the graph) and summed metrics (detached)."""

    terms: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Preparation:
    """What an objective's preparation before training (or eval, or verify) may use: the run's recipe, tokenizer,
    resolved loss implementation and device, the samples' identity (for caches; None: nothing is cached), whether
    the model is as loaded (False on a resume), and where to say what was done."""

    recipe: Recipe
    tokenizer: Any
    impl: str
    device: torch.device
    samples_key: str | None = None
    fresh_model: bool = True
    say: Callable[[str], Any] = print


@dataclass
class Planning:
    """What an objective's plan may use: the run's recipe and training samples, its tokenizer, the model as loaded
    (`lm`) and with its fused loss (`net`, unwrapped), the device, this process's world, and the ranks the step is
    split over (`verify` simulates other than the world's)."""

    recipe: Recipe
    train: list[dict]
    tokenizer: Any
    lm: torch.nn.Module
    net: torch.nn.Module
    device: torch.device
    world: dist.World
    world_size: int


class Objective(Protocol):
    """One training objective (SFT, DPO, ORPO)."""

    name: str
    units: tuple[str, ...]
    """The names of its counts and loss terms, in a fixed order (e.g. ("tokens",), ("chosen_tokens", "pairs"))."""
    metrics: dict[str, str]
    """Each metric it reports -> the unit whose step count it is averaged over."""
    needs: tuple[str, ...]
    """The typed sections of MicroBatch its micro-batches must carry (e.g. ("pairs",)): checked on every micro-batch
    of a step before its counts (MicroBatch.check_needs, from train.step.step_micro_batches)."""
    adds_router_loss: bool
    """Whether its loss adds a mixture-of-experts router's load-balancing loss where the model's own forward would
    (output_router_logits; finetune/model/router_loss.py): SFT's does. Optional (False when absent): a model that asks
    for it is refused for an objective that does not (train.parts.load_parts)."""

    def samples(self, recipe: Recipe, tokenizer: Any, world: dist.World, say: Callable[[str], Any]) -> Prepared:
        """The samples its rows are made of (the datasets', through the data cache; none for GRPO, whose plan makes
        its rows), with their identity (`samples_key`), saying what was read."""
        ...

    def plan(self, planning: Planning) -> StepPlan | RolloutPlan:
        """Which rows each optimizer step trains on."""
        ...

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """Whatever the samples need before the first step (the DPO reference's log-probabilities); `lm` is the
        model as loaded, before any wrapping."""
        ...

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        """This micro-batch's units by name (target tokens, pairs, ...): the denominators of its loss terms."""
        ...

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        """The micro-batch's summed loss per unit as 0-dim tensors in the graph, which the loop divides by the
        step's count of that unit. A micro-batch with no units still returns terms in the graph (zeros), so every
        rank joins every collective."""
        ...
