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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from finetune.model.with_loss import model_inputs
from finetune.objectives.pair_losses import dpo_losses, orpo_log_odds, orpo_ratio_losses
from finetune.recipe import Recipe


@dataclass
class MicroResult:
    """One micro-batch's summed loss per unit (in the graph) and summed metrics (detached)."""

    terms: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(Protocol):
    """One training objective (SFT, DPO, ORPO)."""

    name: str
    units: tuple[str, ...]
    """The names of its counts and loss terms, in a fixed order (e.g. ("tokens",), ("chosen_tokens", "pairs"))."""
    metrics: dict[str, str]
    """Each metric it reports -> the unit whose step count it is averaged over."""

    def counts(self, batch: dict) -> dict[str, int]:
        """This micro-batch's units by name (target tokens, pairs, ...): the denominators of its loss terms."""
        ...

    def forward(self, net: torch.nn.Module, batch: dict, device: torch.device) -> MicroResult:
        """The micro-batch's summed loss per unit as 0-dim tensors in the graph, which the loop divides by the
        step's count of that unit. A micro-batch with no units still returns terms in the graph (zeros), so every
        rank joins every collective."""
        ...


class SFT:
    """Supervised fine-tuning: the summed cross-entropy of the target tokens over the step's target tokens."""

    name = "sft"
    units = ("tokens",)
    metrics: dict[str, str] = {}

    def counts(self, batch: dict) -> dict[str, int]:
        return {"tokens": batch["targets"]}

    def forward(self, net: torch.nn.Module, batch: dict, device: torch.device) -> MicroResult:
        loss_sum, _ = net(**model_inputs(batch, device))
        return MicroResult({"tokens": loss_sum})


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


def pair_logps(net: torch.nn.Module, batch: dict, device: torch.device) -> PairLogps:
    """One forward of a preference micro-batch: per-token log-probabilities summed per document. Documents are
    numbered in the batch (doc_index, -1 for padding) with each pair's chosen document at 2i, rejected at 2i+1."""
    logp, keep = net(**model_inputs(batch, device), per_token=True)
    doc = batch["doc_index"].to(device).reshape(-1).index_select(0, keep)
    n_docs = 2 * batch["pairs"]
    sums = torch.zeros(n_docs, dtype=logp.dtype, device=device).index_add(0, doc, logp)
    tokens = torch.zeros(n_docs, dtype=logp.dtype, device=device).index_add(0, doc, torch.ones_like(logp))
    ref = batch["ref_logps"].to(device=device, dtype=logp.dtype).reshape(-1, 2)
    return PairLogps(sums[0::2], sums[1::2], tokens[0::2], tokens[1::2], ref[:, 0], ref[:, 1], logp, doc % 2 == 0)


def _reward_metrics(reward_c: torch.Tensor, reward_r: torch.Tensor, p: PairLogps) -> dict[str, torch.Tensor]:
    d = {"rewards_chosen": reward_c.sum(), "rewards_rejected": reward_r.sum(),
         "reward_margin": (reward_c - reward_r).sum(), "reward_accuracy": (reward_c > reward_r).sum(),
         "logps_chosen": p.chosen.sum(), "logps_rejected": p.rejected.sum()}
    return {k: v.detach().double() for k, v in d.items()}


_PAIR_METRICS = {m: "pairs" for m in ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy",
                                      "logps_chosen", "logps_rejected")}


class DPO:
    """Direct preference optimization: the summed pair losses over the step's pairs. Rewards are
    beta * (policy - reference) summed log-probabilities; accuracy counts pairs whose chosen reward is strictly
    higher."""

    name = "dpo"
    units = ("pairs",)
    metrics = _PAIR_METRICS

    def __init__(self, beta: float, kind: str, label_smoothing: float) -> None:
        self.beta, self.kind, self.label_smoothing = beta, kind, label_smoothing

    def counts(self, batch: dict) -> dict[str, int]:
        return {"pairs": batch["pairs"]}

    def forward(self, net: torch.nn.Module, batch: dict, device: torch.device) -> MicroResult:
        p = pair_logps(net, batch, device)
        losses = dpo_losses(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, p.n_chosen, p.n_rejected,
                            beta=self.beta, kind=self.kind, label_smoothing=self.label_smoothing)
        rewards = self.beta * (p.chosen - p.ref_chosen), self.beta * (p.rejected - p.ref_rejected)
        return MicroResult({"pairs": losses.sum()}, _reward_metrics(*rewards, p))


class ORPO:
    """Odds-ratio preference optimization: the chosen completions' token cross-entropy over the step's chosen
    tokens, plus beta times the odds-ratio terms over the step's pairs (each part exact under any split).
    Rewards, as in TRL, are beta * the mean per-token log-probability of each completion."""

    name = "orpo"
    units = ("chosen_tokens", "pairs")
    metrics = {**_PAIR_METRICS, "nll_loss": "chosen_tokens", "or_loss": "pairs", "log_odds": "pairs"}

    def __init__(self, beta: float) -> None:
        self.beta = beta

    def counts(self, batch: dict) -> dict[str, int]:
        return {"chosen_tokens": batch["chosen_tokens"], "pairs": batch["pairs"]}

    def forward(self, net: torch.nn.Module, batch: dict, device: torch.device) -> MicroResult:
        p = pair_logps(net, batch, device)
        nll = -(p.token_logps * p.token_is_chosen).sum()
        log_odds = orpo_log_odds(p.chosen, p.rejected, p.n_chosen, p.n_rejected)
        ratio = orpo_ratio_losses(log_odds).sum()
        rewards = (self.beta * p.chosen / p.n_chosen.clamp(min=1), self.beta * p.rejected / p.n_rejected.clamp(min=1))
        metrics = {**_reward_metrics(*rewards, p), "nll_loss": nll.detach().double(),
                   "or_loss": ratio.detach().double(), "log_odds": log_odds.detach().sum().double()}
        return MicroResult({"chosen_tokens": nll, "pairs": self.beta * ratio}, metrics)


def objective_for(recipe: Recipe) -> Objective:
    """The objective the recipe trains (train.objective)."""
    name = recipe.train.objective
    if name == "dpo":
        return DPO(recipe.dpo.beta, recipe.dpo.loss, recipe.dpo.label_smoothing)
    if name == "orpo":
        return ORPO(recipe.orpo.beta)
    return SFT()
