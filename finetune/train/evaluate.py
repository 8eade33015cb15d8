"""The token-weighted eval loss: `finetune eval` uses it directly, the trainer for its eval lines.

Both give the same number: the sum of every eval target token's loss over the count of eval target tokens,
whatever the micro-batch size, the number of ranks and whether packing is on. So a mixture-of-experts model's router
load-balancing loss (output_router_logits), a per-forward value that depends on how the rows are cut, stays out of
it: the eval loss is the cross-entropy, and the router loss is reported beside it (eval_router_aux_loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune import dist
from finetune.batch import to_device
from finetune.context_parallel.groups import data_parallel
from finetune.context_parallel.shard import ContextGroup, shard_batch
from finetune.data import collate, eval_rows, rank_micro_batches
from finetune.errors import UserError
from finetune.model.isolation import check_packable
from finetune.model.with_loss import router_loss_off
from finetune.objectives import Objective
from finetune.recipe import Recipe
from finetune.train.parts import load_parts


@dataclass
class EvalResult:
    """The objective's loss over the eval set (each term over its count of every eval micro-batch and rank), the
    counts, and the objective's metrics over the same."""

    loss: float
    counts: dict[str, int]
    metrics: dict[str, float]

    def record(self, step: int) -> dict[str, float | int]:
        """The metrics.jsonl eval line: step, eval_loss, eval_<count>, eval_<metric>."""
        return {"step": step, "eval_loss": self.loss, **{f"eval_{k}": v for k, v in {**self.counts,
                                                                                     **self.metrics}.items()}}


def evaluate_loss(objective: Objective, net: torch.nn.Module, samples: list[dict], recipe: Recipe,
                  micro_batch_size: int, pad_id: int, world: dist.World, device: torch.device,
                  context: ContextGroup | None = None) -> EvalResult:
    """The objective's loss and metrics over the eval set (SFT: the sum of token losses over all eval target
    tokens); `context`: this rank's context-parallel group (the rows split across it, as in training)."""
    # Dealt to ranks like a training step's rows: a rank with fewer micro-batches runs fillers that count
    # nothing, so every rank makes the same forward calls (FSDP gathers parameters in each).
    dp_rank, dp_size = data_parallel(world.rank, world.size, context)
    micro_batches = rank_micro_batches(eval_rows(samples, recipe.data), micro_batch_size, dp_size, dp_rank)
    units, metrics = objective.units, list(objective.metrics)
    # On the device: the loss terms and metrics, added up without a read. On the host: the counts, known from the
    # collated rows (a count put on the device per micro-batch would be a blocking copy, a sync, each time).
    sums_on_device = torch.zeros(len(units) + len(metrics), device=device, dtype=torch.float64)
    counted = dict.fromkeys(units, 0)
    net.eval()
    with torch.no_grad(), router_loss_off(net):
        for rows in micro_batches:
            # Copied from pinned memory without blocking on CUDA (MicroBatch.to): the host collates the next
            # micro-batch while the device runs this one.
            collated = collate(rows, recipe.data, pad_id)
            batch = collated.to(device) if context is None else shard_batch(collated, context, device)
            result = objective.forward(net, batch, device)
            counts = objective.counts(batch)
            for u in units:
                counted[u] += counts[u]
            sums_on_device += torch.stack([*(result.terms[u].double() for u in units),
                                           *(result.metrics[m] for m in metrics)])
    # The one copy to the device and the one read: terms, counts and metrics summed over ranks together.
    host_counts = torch.tensor([float(counted[u]) for u in units], dtype=torch.float64)
    totals = torch.cat([sums_on_device[:len(units)], to_device(host_counts, device), sums_on_device[len(units):]])
    sums = dist.all_reduce_sum(totals).tolist()
    terms, counts = sums[:len(units)], dict(zip(units, sums[len(units):2 * len(units)]))
    loss = sum(term / max(counts[u], 1) for term, u in zip(terms, units))
    per_unit = {m: total / max(counts[objective.metrics[m]], 1) for m, total in zip(metrics, sums[2 * len(units):])}
    return EvalResult(loss, {u: int(n) for u, n in counts.items()}, per_unit)


def run_eval(recipe: Recipe, run_dir: Path | None = None) -> EvalResult:
    """`finetune eval`: the recipe's model (or, given a run directory, that run's trained model) on the
    recipe's eval data, in one process."""
    world = dist.from_env()
    with dist.process_group(world) as device:
        parts = load_parts(recipe, world, device, lambda message: None, trained_run=run_dir,
                           fresh_model=run_dir is None, splits=("eval",), check_model=_check_packable(recipe))
        if not parts.evals:
            raise UserError("the recipe has no eval data: set eval_datasets or data.val_fraction")
        micro = recipe.eval.micro_batch_size or recipe.train.micro_batch_size
        return evaluate_loss(parts.objective, parts.net, parts.evals, recipe, micro, parts.tokenizer.pad_token_id,
                             world, device)


def _check_packable(recipe: Recipe) -> Callable[[torch.nn.Module, Any], None]:
    def check(lm: torch.nn.Module, tokenizer: Any) -> None:
        if recipe.data.packing:
            check_packable(lm, tokenizer.pad_token_id)
    return check
