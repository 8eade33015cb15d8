"""The per-pair losses of preference training, as pure functions of sequence log-probabilities.

Every loss here is a sum of per-pair terms, which is what lets the training loop normalize by the step's number
of pairs and stay exact under any split of the step (docs/design.md, "The loss contract"). Inputs per pair:
pi_c, pi_r, the policy's summed log-probabilities of the chosen and rejected completions; ref_c, ref_r, the
reference model's; n_c, n_r, their scored token counts. Formulas: docs/preference.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DPO_LOSSES = ("sigmoid", "ipo", "hinge")


def dpo_losses(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
               n_c: torch.Tensor, n_r: torch.Tensor, *, beta: float, kind: str,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """The DPO loss of each pair [P].

    sigmoid: -(1 - e) log sigmoid(beta D) - e log sigmoid(-beta D), D = (pi_c - ref_c) - (pi_r - ref_r), e the
    label smoothing (conservative DPO; e = 0 is the original DPO). hinge: relu(1 - beta D). ipo:
    ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2, the log-ratios averaged over each
    completion's tokens (as TRL 1.x does)."""
    chosen, rejected = pi_c - ref_c, pi_r - ref_r
    if kind == "sigmoid":
        z = beta * (chosen - rejected)
        return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    if kind == "hinge":
        return torch.relu(1 - beta * (chosen - rejected))
    if kind == "ipo":
        return (chosen / n_c.clamp(min=1) - rejected / n_r.clamp(min=1) - 1 / (2 * beta)).square()
    raise ValueError(f"unknown DPO loss {kind!r}; one of {', '.join(DPO_LOSSES)}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's two branches, split at -log 2)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


# The mean log-probability of a completion is < 0 unless every token has probability 1, which float32 can
# round to: log(1 - exp(0)) would be -inf. Capped just below 0 (a probability of 1 - 1e-7 per token).
_MAX_MEAN_LOGP = -1e-7


def orpo_log_odds(pi_c: torch.Tensor, pi_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor) -> torch.Tensor:
    """log(odds(chosen) / odds(rejected)) of each pair, odds(y) = p / (1 - p) with p the completion's mean
    per-token probability in log space: log p = (summed log-probabilities) / (scored tokens)."""
    a_c = (pi_c / n_c.clamp(min=1)).clamp(max=_MAX_MEAN_LOGP)
    a_r = (pi_r / n_r.clamp(min=1)).clamp(max=_MAX_MEAN_LOGP)
    return (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))


def orpo_ratio_losses(log_odds: torch.Tensor) -> torch.Tensor:
    """ORPO's odds-ratio term of each pair, -log sigmoid(log odds ratio); the objective weighs it by orpo.beta."""
    return -F.logsigmoid(log_odds)


def bradley_terry_losses(r_c: torch.Tensor, r_r: torch.Tensor, margin: torch.Tensor | None = None,
                         center_coefficient: float = 0.0) -> torch.Tensor:
    """A reward model's loss of each pair [P] from its scores r_c, r_r: -log sigmoid(r_c - r_r - margin) (the
    Bradley-Terry model; margin 0 without one), plus center_coefficient x (r_c + r_r)^2 (reward centering, TRL's
    center_rewards_coefficient, which TRL averages over the pairs as it averages the first term)."""
    diff = r_c - r_r if margin is None else r_c - r_r - margin
    losses = -F.logsigmoid(diff)
    return losses + center_coefficient * (r_c + r_r).square() if center_coefficient else losses
