"""Group-relative advantages, computed once per batch of rollouts before it is split into micro-batches.

TRL's convention (docs/rl.md): advantage = (reward - group mean) / (std + 1e-4), the std with Bessel's correction
over the group (scale_rewards group) or over the whole batch (batch), or no division (none). A completion no reward
function scored (NaN) is left out of its group's mean and std and gets advantage 0; a group whose rewards are all
equal gets exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-4


@dataclass
class Advantages:
    """Each completion's advantage and, per completion, whether its group's (or batch's) reward std is zero."""

    values: list[float]
    zero_std: list[bool]

    @property
    def zero_std_groups(self) -> float:
        return sum(self.zero_std) / max(len(self.zero_std), 1)


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (n - 1), as TRL's nanstd."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return variance.sqrt() if dim is not None else variance.sqrt().reshape(())


def group_advantages(rewards: list[float], group_size: int, scale: str) -> Advantages:
    """The advantages of consecutive groups of `group_size` completions (float64; NaN = unscored)."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards are not whole groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64)
    groups = r.view(-1, group_size)
    mean = torch.nanmean(groups, dim=1, keepdim=True).expand_as(groups).reshape(-1)
    if scale == "batch":
        std = _nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    else:
        std = _nanstd(groups, dim=1).expand_as(groups).reshape(-1)
    advantages = r - mean
    if scale != "none":
        advantages = advantages / (std + EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)  # unscored completions (and all-unscored groups): 0
    zero_std = torch.isclose(torch.nan_to_num(std, nan=0.0), torch.zeros_like(std))
    return Advantages(advantages.tolist(), zero_std.tolist())
