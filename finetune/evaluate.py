"""The token-weighted eval loss: `finetune eval` uses it directly, the trainer for its eval lines.

Both give the same number: the sum of every eval target token's loss over the count of eval target tokens,
whatever the micro-batch size, the number of ranks and whether packing is on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune import dist
from finetune.data import build_samples, collate, eval_rows, rank_micro_batches
from finetune.errors import UserError
from finetune.loss import resolve_impl
from finetune.model import load_model, load_tokenizer
from finetune.model_with_loss import CausalLMWithLoss
from finetune.objective import SFT, Objective
from finetune.recipe import Recipe
from finetune.trained import load_trained


def evaluate_loss(objective: Objective, net: torch.nn.Module, samples: list[dict], recipe: Recipe,
                  micro_batch_size: int, pad_id: int, world: dist.World,
                  device: torch.device) -> tuple[float, dict[str, int]]:
    """The objective's loss over the eval set, each term over its count of all eval micro-batches and ranks
    (SFT: the sum of token losses over all eval target tokens); and those counts."""
    # Dealt to ranks like a training step's rows: a rank with fewer micro-batches runs fillers that count
    # nothing, so every rank makes the same forward calls (FSDP gathers parameters in each).
    micro_batches = rank_micro_batches(eval_rows(samples, recipe.data), micro_batch_size, world.size, world.rank)
    units = objective.units
    totals = torch.zeros(2 * len(units), device=device, dtype=torch.float64)  # the terms, then the counts
    net.eval()
    with torch.no_grad():
        for rows in micro_batches:
            batch = collate(rows, recipe.data, pad_id)
            terms, counts = objective.loss_terms(net, batch, device), objective.counts(batch)
            totals += torch.stack([*(terms[u].double() for u in units),
                                   *(torch.tensor(float(counts[u]), device=device, dtype=torch.float64)
                                     for u in units)])
    sums = dist.all_reduce_sum(totals).tolist()
    loss = sum(term / max(count, 1) for term, count in zip(sums[:len(units)], sums[len(units):]))
    return loss, {u: int(n) for u, n in zip(units, sums[len(units):])}


def run_eval(recipe: Recipe, run_dir: Path | None = None) -> tuple[float, dict[str, int]]:
    """`finetune eval`: the recipe's model (or, given a run directory, that run's trained model) on the
    recipe's eval data, in one process."""
    world = dist.from_env()
    with dist.process_group(world) as device:
        if run_dir is not None:
            lm, tokenizer = load_trained(run_dir, recipe)
        else:
            tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
            lm = None
        _, eval_samples, _, _ = build_samples(recipe, tokenizer)
        if not eval_samples:
            raise UserError("the recipe has no eval data: set eval_datasets or data.val_fraction")
        if lm is None:
            lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, device)
        lm = lm.to(device)
        impl = resolve_impl(recipe.loss.impl, device)
        net = CausalLMWithLoss.for_recipe(lm, recipe.loss, impl)
        micro = recipe.eval.micro_batch_size or recipe.train.micro_batch_size
        return evaluate_loss(SFT(), net, eval_samples, recipe, micro, tokenizer.pad_token_id, world, device)
