"""Where a micro-batch's targets are, found on the CPU before the micro-batch reaches the device.

The fused loss and the per-token log-probabilities project only the positions that carry a target. Finding them
on the device is a dynamic shape (`nonzero`), and checking that their ids are in the vocabulary is a read: two
host syncs per micro-batch, which on a GPU stall the queue of work. The labels are on the CPU when a micro-batch is
collated, so both are done there, once (`find_targets`), and the device gets the positions with the other inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.labels import IGNORE_INDEX


@dataclass(frozen=True, eq=False)
class Targets:
    """The flat positions in [B*T] whose next token is a target (ascending, on the device: what the loss
    index_selects), how many there are, and the smallest and largest target id (0, 0 when there are none)."""

    index: torch.Tensor
    count: int
    low: int
    high: int


def find_targets(labels: torch.Tensor, device: torch.device | str | None = None) -> Targets:
    """The Targets of UNSHIFTED labels [B, T] (or [T]) on the CPU: position t scores labels[..., t + 1], as
    loss.shift_labels says. The positions are copied to `device` without blocking (from pinned memory on CUDA)."""
    rows = labels.reshape(-1, labels.shape[-1]).cpu()
    scored = rows[:, 1:] != IGNORE_INDEX
    where = scored.nonzero()
    index = where[:, 0] * rows.shape[1] + where[:, 1]
    ids = rows[:, 1:][scored]
    low, high = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
    return Targets(to_device(index, device), int(index.numel()), low, high)


def to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A CPU tensor on `device`: from pinned memory without blocking the host on CUDA, else a plain copy."""
    target = torch.device(device) if device is not None else tensor.device
    if target.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(target, non_blocking=True)
    return tensor.to(target)
