"""Preference objectives, the pair as the unit: DPO (the summed pair losses over the step's pairs) and ORPO (the
chosen completions' token cross-entropy over their tokens, plus beta times the odds-ratio terms over the pairs).
A pair (chosen, rejected) is never split across rows, micro-batches or data-parallel ranks, so its non-linear loss
is always computed whole (under context parallelism from its sides' whole sums: context_parallel/sequence_sums.py);
docs/preference.md has the formulas and the choices.
"""

from __future__ import annotations

import torch

from finetune.batch import MicroBatch
from finetune.context_parallel.sequence_sums import counted_here
from finetune.objectives.base import MicroResult, Preparation
from finetune.objectives.pair_losses import dpo_losses, orpo_log_odds, orpo_ratio_losses
from finetune.objectives.pairs import PairLogps, chosen_sequence_tokens, pair_logps
from finetune.objectives.reference import attach_reference_logps
from finetune.objectives.rows import DatasetRows


def _reward_metrics(reward_c: torch.Tensor, reward_r: torch.Tensor, p: PairLogps) -> dict[str, torch.Tensor]:
    d = {"rewards_chosen": reward_c.sum(), "rewards_rejected": reward_r.sum(),
         "reward_margin": (reward_c - reward_r).sum(), "reward_accuracy": (reward_c > reward_r).sum(),
         "logps_chosen": p.chosen.sum(), "logps_rejected": p.rejected.sum()}
    return {k: v.detach().double() for k, v in d.items()}


_PAIR_METRICS = {m: "pairs" for m in ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy",
                                      "logps_chosen", "logps_rejected")}


class DPO(DatasetRows):
    """Direct preference optimization: the summed pair losses over the step's pairs. Rewards are
    beta * (policy - reference) summed log-probabilities; accuracy counts pairs whose chosen reward is strictly
    higher."""

    name = "dpo"
    units = ("pairs",)
    metrics = _PAIR_METRICS
    needs = ("pairs",)

    def __init__(self, beta: float, kind: str, label_smoothing: float) -> None:
        self.beta, self.kind, self.label_smoothing = beta, kind, label_smoothing
        self.reference_digest: str | None = None  # dpo.reference: PATH's weights, checked on a resume

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """The reference's log-probabilities of every pair, computed once (or read from the cache). A reference
        loaded from a path is identified by its weights, so a resume against other weights there is refused."""
        self.reference_digest = attach_reference_logps(
            setting.recipe, splits, lm, setting.tokenizer, setting.impl, setting.device,
            samples_key=setting.samples_key, fresh_model=setting.fresh_model, say=setting.say)

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        return {"pairs": batch.require("pairs", self.name).count if counted_here(batch.context) else 0}

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        p = pair_logps(net, batch, device, self.name)
        losses = dpo_losses(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, p.n_chosen, p.n_rejected,
                            beta=self.beta, kind=self.kind, label_smoothing=self.label_smoothing)
        rewards = self.beta * (p.chosen - p.ref_chosen), self.beta * (p.rejected - p.ref_rejected)
        return _once_per_group(MicroResult({"pairs": losses.sum()}, _reward_metrics(*rewards, p)), batch, ())


class ORPO(DatasetRows):
    """Odds-ratio preference optimization: the chosen completions' token cross-entropy over the step's chosen
    tokens, plus beta times the odds-ratio terms over the step's pairs (each part exact under any split).
    Rewards, as in TRL, are beta * the mean per-token log-probability of each completion. `nll` (orpo.nll):
    completion, or sequence (every chosen-side token but the first, as TRL's ORPOTrainer)."""

    name = "orpo"
    units = ("chosen_tokens", "pairs")
    metrics = {**_PAIR_METRICS, "nll_loss": "chosen_tokens", "or_loss": "pairs", "log_odds": "pairs"}
    needs = ("pairs",)

    def __init__(self, beta: float, nll: str = "completion") -> None:
        self.beta, self.whole_chosen = beta, nll == "sequence"

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """Nothing to prepare: ORPO has no reference model."""

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        pairs = batch.require("pairs", self.name)
        if not counted_here(batch.context):
            return {"chosen_tokens": 0, "pairs": 0}
        tokens = chosen_sequence_tokens(batch) if self.whole_chosen else pairs.chosen_tokens
        return {"chosen_tokens": tokens, "pairs": pairs.count}

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        p = pair_logps(net, batch, device, self.name, self.whole_chosen)
        nll = -(p.token_logps * p.token_is_chosen).sum()
        log_odds = orpo_log_odds(p.chosen, p.rejected, p.n_chosen, p.n_rejected)
        ratio = orpo_ratio_losses(log_odds).sum()
        rewards = (self.beta * p.chosen / p.n_chosen.clamp(min=1), self.beta * p.rejected / p.n_rejected.clamp(min=1))
        metrics = {**_reward_metrics(*rewards, p), "nll_loss": nll.detach().double(),
                   "or_loss": ratio.detach().double(), "log_odds": log_odds.detach().sum().double()}
        result = MicroResult({"chosen_tokens": nll, "pairs": self.beta * ratio}, metrics)
        return _once_per_group(result, batch, ("chosen_tokens", "nll_loss"))


def _once_per_group(result: MicroResult, batch: MicroBatch, per_token: tuple[str, ...]) -> MicroResult:
    """Under context parallelism, a pair's figures counted on the group's first rank only (sequence_sums.py): every
    rank computed them from the whole sums; the per-token ones (`per_token`: each rank's share of the positions)
    are kept on every rank, as SFT's are."""
    if counted_here(batch.context):
        return result
    terms = {k: v if k in per_token else v * 0 for k, v in result.terms.items()}
    metrics = {k: v if k in per_token else torch.zeros_like(v) for k, v in result.metrics.items()}
    return MicroResult(terms, metrics)
