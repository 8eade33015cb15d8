"""One optimizer step's figures, computed on the device and read by the host once.

The loss contract (docs/design.md, "The loss contract") needs the step's counts before the first backward: they
are summed on the host from the collated micro-batches (one all-reduce, and its read, under torchrun; nothing in
one process). Everything else stays on the device until the step's one read (`read_step`): each micro-batch's
loss terms and metrics are added up there and summed over ranks by one all-reduce, the gradient norm is clipping's
own foreach result, and the previous step's update ratio rides along (the trainer writes a step's metrics line
when that ratio arrives, one step later). That read is the host sync the skip-on-non-finite decision needs; on a
GPU the host otherwise runs ahead, queueing work (docs/design.md, "A step on the device").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from finetune import dist
from finetune.batch import MicroBatch
from finetune.context_parallel.groups import data_parallel
from finetune.context_parallel.shard import ContextGroup, shard_batch
from finetune.data import collate, rank_micro_batches
from finetune.objectives import Objective
from finetune.recipe import Recipe
from finetune.train.parallel import gradient_sync


def step_micro_batches(objective: Objective, step_rows: list[dict], recipe: Recipe, pad_id: int, world_size: int,
                       rank: int, device: torch.device, context: ContextGroup | None = None,
                       flat: bool = False) -> list[MicroBatch]:
    """Rank `rank`'s micro-batches of one step's rows, collated and on `device`: the trainer's and `finetune
    verify`'s one way to cut a step. Each must carry the sections the objective declares (Objective.needs),
    checked here, before any count or forward, so a mismatch is one clear error rather than one deep in a loss.
    `context`: this rank's context-parallel group; the rows are then dealt to its data-parallel index and each
    micro-batch split across the group (finetune/context_parallel/shard.py). `flat`: padding-free micro-batches
    (the run's choice, train/padding_free.py)."""
    dp_rank, dp_size = data_parallel(rank, world_size, context)
    dealt = rank_micro_batches(step_rows, recipe.train.micro_batch_size, dp_size, dp_rank, recipe.data.group_by_length)
    micro = [collate(rows, recipe.data, pad_id, flat).to(device) if context is None else
             shard_batch(collate(rows, recipe.data, pad_id), context, device) for rows in dealt]
    for batch in micro:
        batch.check_needs(objective.needs, objective.name)
    return micro


class StepCounts(NamedTuple):
    """A step's counts over all its micro-batches and ranks (step_counts)."""

    counts: dict[str, int]
    """The objective's units and the target tokens."""
    seq_tokens: int
    """Real input tokens."""
    padded_tokens: int
    """Tokens computed, padding included."""
    stop: bool = False
    """Some rank was asked to stop (train/stop.py): every rank stops after this step."""
    samples: int = 0
    """The samples (documents) of the step: every rank's `samples` summed."""


def step_counts(objective: Objective, micro: list[MicroBatch], world: dist.World, device: torch.device,
                stop: bool = False, samples: int = 0) -> StepCounts:
    """The step's counts, each summed over the step's micro-batches on every rank: host integers from the collated
    batches, one all-reduce under torchrun. `stop`, this rank's stop request, is summed with them, so that all
    ranks agree on the step to stop after without a sync of its own; so is `samples`, this rank's part of the step's
    sample count (where each rank reads its own rows, a streamed plan's, no rank knows the others')."""
    names = [*objective.units, *(("tokens",) if "tokens" not in objective.units else ())]
    local = [sum((objective.counts(m) if u in objective.units else {"tokens": m.targets})[u] for m in micro)
             for u in names]
    local += [sum(m.seq_tokens for m in micro), sum(m.padded_tokens for m in micro), samples, int(stop)]
    totals = local
    if world.distributed:  # the contract's one host sync before the backward: every rank needs the step's counts
        totals = [int(x) for x in dist.all_reduce_sum(torch.tensor(local, device=device)).tolist()]
    return StepCounts(dict(zip(names, totals)), totals[-4], totals[-3], totals[-1] > 0, totals[-2])


def forward_backward(net: torch.nn.Module, objective: Objective, micro: list[MicroBatch], counts: dict[str, int],
                     world: dist.World, device: torch.device) -> torch.Tensor:
    """Backpropagate every micro-batch's loss terms over the step's counts (times the world size: DDP and FSDP
    average gradients over ranks), reducing gradients only after the last one (parallel.gradient_sync). The model
    runs in the mode the caller set (the loop: training; verify: eval, without dropout). Returns
    [the step's summed loss terms..., its summed metrics...] (float64, on the device, summed over ranks)."""
    units, names = objective.units, list(objective.metrics)
    # Each micro-batch's terms and metrics (0-dim, on the device) are kept and summed once after the last, in
    # float64: two ops a step rather than a stack and an add per micro-batch (host time on a GPU's critical path).
    terms: list[torch.Tensor] = []
    metrics: list[torch.Tensor] = []
    for i, batch in enumerate(micro):
        with gradient_sync(net, last=i == len(micro) - 1):
            result = objective.forward(net, batch, device)
            scaled = [result.terms[u] * (world.size / max(counts[u], 1)) for u in units]
            sum(scaled[1:], scaled[0]).backward()
        terms.extend(result.terms[u].detach() for u in units)
        metrics.extend(result.metrics[m] for m in names)
    sums = _summed(terms, len(units), device)
    if names:
        sums = torch.cat([sums, _summed(metrics, len(names), device)])
    return dist.all_reduce_sum(sums)


def _summed(values: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """[width] float64 sums of 0-dim tensors listed `width` at a time (one micro-batch's), in their order."""
    if not values:
        return torch.zeros(width, device=device, dtype=torch.float64)
    return torch.stack(values).reshape(-1, width).sum(0, dtype=torch.float64)


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients in place; returns their pre-clip norm as a 0-dim tensor on the device (not read).

    Gradients of one device and dtype (one process, DDP): torch's clip_grad_norm_ op for op (the same foreach
    norms, total, coefficient and scaling, so the same numbers), without its per-call grouping and checks (host
    time each step), and without the scaling by 1 where nothing clips (max_norm inf). Anything else (FSDP2's
    DTensors, mixed dtypes or devices): clip_grad_norm_ itself."""
    grads = [p.grad for p in params if p.grad is not None]
    if not _one_kind(grads):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # FSDP2 returns the norm as a DTensor: its full value (a collective on the device, no read).
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if max_norm < math.inf:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _one_kind(grads: list[torch.Tensor]) -> bool:
    """Whether the gradients are plain tensors of one dtype on one CPU or CUDA device."""
    if not grads or type(grads[0]) is not torch.Tensor or grads[0].device.type not in ("cpu", "cuda"):
        return False
    dtype, device = grads[0].dtype, grads[0].device
    return all(type(g) is torch.Tensor and g.dtype == dtype and g.device == device for g in grads)


@dataclass
class StepFigures:
    """What the host learns of a step at its one read."""

    loss: float
    metrics: dict[str, float]
    grad_norm: float
    late: list[float]  # the tensors handed in as `late`, read with the rest (the previous step's update ratio)

    def healthy(self, counts: dict[str, int]) -> bool:
        """Whether the update may be applied: a finite loss and gradient norm, and something to learn from."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm) and all(n > 0 for n in counts.values())


def read_step(objective: Objective, sums: torch.Tensor, norm: torch.Tensor, counts: dict[str, int],
              late: list[torch.Tensor] = ()) -> StepFigures:
    """The step's one host read: forward_backward's sums, the gradient norm and `late` (0-dim tensors) in one
    copy. The loss is the sum of each term over its count; each metric is over the count of its unit."""
    values = torch.cat([sums, norm.detach().double().reshape(1), *(t.double().reshape(1) for t in late)]).tolist()
    units = objective.units
    loss = sum(total / max(counts[u], 1) for u, total in zip(units, values))
    metric_values = values[len(units):len(units) + len(objective.metrics)]
    metrics = {m: total / max(counts[u], 1) for (m, u), total in zip(objective.metrics.items(), metric_values)}
    rest = values[len(units) + len(objective.metrics):]
    return StepFigures(loss, metrics, rest[0], rest[1:])
