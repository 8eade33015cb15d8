"""`finetune verify`: prove on the user's own model and data that the configured accumulation is exact.

It takes the rows of the recipe's first optimizer step and computes the gradient three ways:
  - as configured: micro-batches of `micro_batch_size` on each of W simulated ranks, each backpropagating
    loss_sum / N_step (the trainer's contract), by the trainer's own step functions (finetune/train/step.py:
    step_micro_batches cuts the step, step_counts sums N_step, forward_backward backpropagates): a drift in the
    code that trains fails verify;
  - the reference: the same rows as one batch (or as `--reference-micro-batch` rows at a time when one batch
    does not fit), loss_sum / N_step;
  - naive: the mean loss of each micro-batch divided by the number of micro-batches (what many trainers do).
The configured gradient must equal the reference up to float summation order; the naive one usually does not,
which shows the check has power on this data.

A mixture-of-experts model's router load-balancing loss (output_router_logits) is computed per forward, a product of
two means over the forward's tokens: no split of a step equals one batch there, so the three passes leave it out
(CausalLMWithLoss.router_loss_off: the gradient checked is the cross-entropy's, which the contract keeps exact) and
verify reports its value both ways instead: the configured micro-batches' values weighted by their target tokens (what
the trainer adds and logs), and the reference's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune import dist
from finetune.batch import MicroBatch
from finetune.data import collate
from finetune.model.router_loss import METRIC as ROUTER_METRIC
from finetune.model.with_loss import router_loss_off
from finetune.objectives import Objective
from finetune.progress import Phase
from finetune.recipe import Recipe
from finetune.train import padding_free
from finetune.train.parts import load_parts, plan_for
from finetune.train.step import forward_backward, step_counts, step_micro_batches

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


@dataclass
class VerifyResult:
    """Max relative gradient difference per parameter group, for the configured and the naive scheme."""

    groups: dict[str, tuple[float, float]]
    tolerance: float
    rows: int
    micro_batches: int
    targets: int
    unit: str = "tokens"
    """What `targets` counts: target tokens (SFT), pairs (DPO), chosen tokens (ORPO)."""
    router_aux: tuple[float, float] | None = None
    """The router's load-balancing loss (output_router_logits) as configured (each micro-batch's value weighted by
    its share of the step's target tokens) and by the reference's batches; None without one. Not in the check: the
    gradients compared leave it out (the module docstring says why)."""

    @property
    def configured_max(self) -> float:
        return max(c for c, _ in self.groups.values())

    @property
    def naive_max(self) -> float:
        return max(n for _, n in self.groups.values())

    @property
    def passed(self) -> bool:
        return self.configured_max <= self.tolerance


def verify(recipe: Recipe, world_size: int = 1, reference_micro_batch: int | None = None,
           say: Callable[[str], Any] = lambda message: None) -> VerifyResult:
    """Gradients of the first optimizer step: configured vs reference vs naive (one process, W simulated). `say`
    hears what loading the data and the model says (the CLI prints it on stderr)."""
    torch.manual_seed(recipe.seed)
    if recipe.distributed.context_parallel > 1:  # the all-to-all needs real ranks: verify sees whole rows
        say(f"distributed.context_parallel {recipe.distributed.context_parallel}: not simulated here; the step is "
            "checked with whole rows (the split across ranks: tests/context_parallel/)")
    device = dist.default_device()
    parts = load_parts(recipe, dist.from_env(), device, say, splits=("train",))
    lm, net, objective = parts.lm, parts.net, parts.objective
    lm.eval()  # dropout would make the three passes differ for reasons unrelated to accumulation
    step_rows = plan_for(recipe, parts, dist.from_env(), world_size).step(0)[1]
    pad = parts.tokenizer.pad_token_id
    # Each simulated rank's micro-batches, cut as the trainer cuts them (one function for both).
    # Padding-free where the run would be (train/padding_free.py): the reference below stays padded, so the check
    # also compares the two layouts.
    flat = padding_free.choose(recipe, lm, pad, device).on
    ranks = [step_micro_batches(objective, step_rows, recipe, pad, world_size, rank, device, flat=flat)
             for rank in range(world_size)]
    size = reference_micro_batch or len(step_rows)
    reference = [collate(step_rows[i: i + size], recipe.data, pad) for i in range(0, len(step_rows), size)]
    configured = [batch for rank in ranks for batch in rank]
    totals = step_counts(objective, configured, dist.World(), device)[0]

    routed = net.router is not None
    ref_metrics: dict[str, float] = {}
    sums: list[torch.Tensor] = []
    with (router_loss_off(net),
          Phase(f"verify: the first step's gradient three ways ({len(step_rows)} rows)", 3, "passes") as phase):
        ref = _gradients(lm, lambda: ref_metrics.update(_backward(net, objective, reference, device, naive=False)))
        phase.advance()
        # The trainer's own step, rank by rank: each backpropagates its micro-batches over the step's counts (one
        # process: no DDP average to undo), so the ranks' gradients add up as DDP's all-reduce would.
        got = _gradients(lm, lambda: sums.extend(forward_backward(net, objective, rank, totals, dist.World(), device)
                                                 for rank in ranks))
        phase.advance()
        naive = _gradients(lm, lambda: _backward(net, objective, configured, device, naive=True))
        phase.advance()
    lm.eval()  # forward_backward switches the model to training mode
    groups: dict[str, tuple[float, float]] = defaultdict(lambda: (0.0, 0.0))
    for name, g_ref in ref.items():
        scale = g_ref.abs().max().clamp_min(1e-30)
        c = float((got[name] - g_ref).abs().max() / scale)
        n = float((naive[name] - g_ref).abs().max() / scale)
        key = _group_of(name)
        groups[key] = (max(groups[key][0], c), max(groups[key][1], n))
    dtype = next(lm.parameters()).dtype
    router = None
    if routed:  # forward_backward's sums: the terms, then the metrics in the objective's order
        at = len(objective.units) + list(objective.metrics).index(ROUTER_METRIC)
        tokens = max(totals["tokens"], 1)
        router = (float(sum(float(s[at]) for s in sums)) / tokens, ref_metrics[ROUTER_METRIC] / tokens)
    return VerifyResult(dict(groups), TOLERANCE.get(dtype, 1e-5), len(step_rows), len(configured),
                        totals[objective.units[0]], objective.units[0], router)


def _gradients(lm: torch.nn.Module, backward: object) -> dict[str, torch.Tensor]:
    """The gradients `backward()` leaves on the trainable parameters, starting from none."""
    lm.zero_grad(set_to_none=True)
    backward()
    return {name: p.grad.detach().clone() for name, p in lm.named_parameters() if p.grad is not None}


def _backward(net: torch.nn.Module, objective: Objective, batches: list[MicroBatch], device: torch.device,
              naive: bool) -> dict[str, float]:
    """verify's own passes: the one-batch reference (each batch over the counts of all of them) and the naive
    scheme (each micro-batch's own mean, divided by the number of micro-batches: what many trainers do). Returns
    the objective's metrics summed over the batches."""
    totals = {u: sum(objective.counts(b)[u] for b in batches) for u in objective.units}
    metrics: dict[str, float] = defaultdict(float)
    for batch in batches:
        result = objective.forward(net, batch, device)
        terms = result.terms
        counts = {u: objective.counts(batch)[u] * len(batches) for u in terms} if naive else totals
        sum(terms[u] / max(counts[u], 1) for u in objective.units).backward()
        for name, value in result.metrics.items():
            metrics[name] += float(value)
    return dict(metrics)


def _group_of(name: str) -> str:
    """A readable parameter group: 'layers.3', 'embed_tokens', 'norm', ... (adapter prefixes dropped)."""
    parts = [p for p in name.split(".") if p not in ("base_model", "model", "weight", "bias", "default")]
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[i: i + 2])
    return parts[0] if parts else name
