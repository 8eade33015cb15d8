"""`finetune verify`: prove on the user's own model and data that the configured accumulation is exact.

It takes the rows of the recipe's first optimizer step and computes the gradient three ways:
  - as configured: micro-batches of `micro_batch_size` on each of W simulated ranks, each backpropagating
    loss_sum / N_step (the trainer's contract);
  - the reference: the same rows as one batch (or as `--reference-micro-batch` rows at a time when one batch
    does not fit), loss_sum / N_step;
  - naive: the mean loss of each micro-batch divided by the number of micro-batches (what many trainers do).
The configured gradient must equal the reference up to float summation order; the naive one usually does not,
which shows the check has power on this data.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from finetune.data import build_samples, collate, epoch_rows, rank_micro_batches
from finetune.dist import default_device
from finetune.loss.fused import resolve_impl
from finetune.model.loading import load_model, load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.objectives.base import objective_for
from finetune.objectives.reference import attach_reference_logps
from finetune.recipe import Recipe

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

    @property
    def configured_max(self) -> float:
        return max(c for c, _ in self.groups.values())

    @property
    def naive_max(self) -> float:
        return max(n for _, n in self.groups.values())

    @property
    def passed(self) -> bool:
        return self.configured_max <= self.tolerance


def verify(recipe: Recipe, world_size: int = 1, reference_micro_batch: int | None = None) -> VerifyResult:
    """Gradients of the first optimizer step: configured vs reference vs naive (one process, W simulated)."""
    torch.manual_seed(recipe.seed)
    device = default_device()
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    samples, _, _, _ = build_samples(recipe, tokenizer)
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, device,
                    trainable=recipe.train.trainable_parameters).to(device)
    # Dropout would make the three passes differ for reasons unrelated to accumulation.
    lm.eval()
    impl = resolve_impl(recipe.loss.impl, device)
    if recipe.train.objective == "dpo":
        attach_reference_logps(recipe, {"train": samples}, lm, tokenizer, impl, device, samples_key=None,
                               fresh_model=True, say=lambda message: None)
    net = CausalLMWithLoss.for_recipe(lm, recipe.loss, impl)
    objective = objective_for(recipe)
    t = recipe.train
    step_rows = epoch_rows(samples, recipe.data, recipe.seed, 0)[: t.micro_batch_size * t.gradient_accumulation_steps
                                                                  * world_size]
    pad = tokenizer.pad_token_id

    configured = [collate(rows, recipe.data, pad) for rank in range(world_size)
                  for rows in rank_micro_batches(step_rows, t.micro_batch_size, world_size, rank)]
    size = reference_micro_batch or len(step_rows)
    reference = [collate(step_rows[i: i + size], recipe.data, pad) for i in range(0, len(step_rows), size)]
    totals = {u: sum(objective.counts(b)[u] for b in configured) for u in objective.units}

    def gradients(batches: list[dict], naive: bool) -> dict[str, torch.Tensor]:
        lm.zero_grad(set_to_none=True)
        for batch in batches:
            terms = objective.forward(net, batch, device).terms
            # naive: each micro-batch's own mean, divided by the number of micro-batches (what many trainers do)
            counts = {u: objective.counts(batch)[u] * len(batches) for u in terms} if naive else totals
            sum(terms[u] / max(counts[u], 1) for u in objective.units).backward()
        return {name: p.grad.detach().clone() for name, p in lm.named_parameters() if p.grad is not None}

    ref = gradients(reference, naive=False)
    got = gradients(configured, naive=False)
    naive = gradients(configured, naive=True)
    groups: dict[str, tuple[float, float]] = defaultdict(lambda: (0.0, 0.0))
    for name, g_ref in ref.items():
        scale = g_ref.abs().max().clamp_min(1e-30)
        c = float((got[name] - g_ref).abs().max() / scale)
        n = float((naive[name] - g_ref).abs().max() / scale)
        key = _group_of(name)
        groups[key] = (max(groups[key][0], c), max(groups[key][1], n))
    dtype = next(lm.parameters()).dtype
    return VerifyResult(dict(groups), TOLERANCE.get(dtype, 1e-5), len(step_rows), len(configured),
                        totals[objective.units[0]], objective.units[0])


def _group_of(name: str) -> str:
    """A readable parameter group: 'layers.3', 'embed_tokens', 'norm', ... (adapter prefixes dropped)."""
    parts = [p for p in name.split(".") if p not in ("base_model", "model", "weight", "bias", "default")]
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[i: i + 2])
    return parts[0] if parts else name
