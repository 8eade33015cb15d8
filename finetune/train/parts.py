"""The parts every command that runs a model on a recipe's data needs, built one way: the tokenizer, the samples,
the model, the resolved loss implementation, the objective (prepared) and the model with its fused loss.

`finetune train`, `finetune eval` and `finetune verify` all start from `load_parts`, so what the proof of exact
accumulation checks, what eval measures and what trains are the same samples, model and objective. What differs
is passed in: the trainer's model checks (disk room, packing isolation, compilation), a finished run's model for
eval, which splits the objective prepares.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune import dist
from finetune.data import DataStats, StepPlan
from finetune.data.cache import Prepared, prepare
from finetune.loss.fused import resolve_impl
from finetune.model.loading import load_model, load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.objectives import Objective, Preparation, objective_for
from finetune.recipe import Recipe
from finetune.rl.plan import RolloutPlan, policy_scorer
from finetune.rl.replay import read_replay
from finetune.rl.rollout import end_ids
from finetune.run.trained import load_trained


@dataclass
class Parts:
    """What `load_parts` built. `lm` is the model as loaded (PEFT-wrapped with an adapter): what is saved and
    what DDP/FSDP wrap around; `net` is it with its fused loss, unwrapped."""

    recipe: Recipe
    device: torch.device
    tokenizer: Any
    train: list[dict]
    evals: list[dict]
    train_stats: DataStats
    samples_key: str | None
    lm: torch.nn.Module
    impl: str
    objective: Objective
    net: CausalLMWithLoss


def load_parts(recipe: Recipe, world: dist.World, device: torch.device, say: Callable[[str], Any], *,
               trained_run: Path | None = None, fresh_model: bool = True, splits: tuple[str, ...] = ("train", "eval"),
               check_model: Callable[[torch.nn.Module, Any], None] | None = None) -> Parts:
    """Tokenizer, samples (from the data cache; rank 0 first under torchrun), model, objective and the model with
    its loss, for `recipe` on `device`.

    `trained_run`: evaluate a finished run's model (and its tokenizer) instead of loading the recipe's.
    `fresh_model`: the model has not trained yet (False on a resume: the objective's reference is reloaded).
    `splits`: the samples the objective prepares (the DPO reference pass costs a forward over each).
    `check_model(lm, tokenizer)`: the caller's checks of the loaded model, before the objective prepares."""
    if trained_run is not None:
        lm, tokenizer = load_trained(trained_run, recipe)
    else:
        lm, tokenizer = None, load_tokenizer(recipe.tokenizer, recipe.model)
    prepared = _prepared(recipe, tokenizer, world, say)
    if lm is None:
        lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, device,
                        trainable=recipe.train.trainable_parameters)
    lm = lm.to(device)
    if check_model is not None:
        check_model(lm, tokenizer)
    impl = resolve_impl(recipe.loss.impl, device)
    objective = objective_for(recipe)
    chosen = {name: samples for name, samples in (("train", prepared.train), ("eval", prepared.evals))
              if name in splits}
    objective.prepare(chosen, lm, Preparation(recipe, tokenizer, impl, device, prepared.samples_key, fresh_model, say))
    net = CausalLMWithLoss.for_recipe(lm, recipe.loss, impl, recipe.model.packed_attention)
    return Parts(recipe, device, tokenizer, prepared.train, prepared.evals, prepared.train_stats,
                 prepared.samples_key, lm, impl, objective, net)


def plan_for(recipe: Recipe, parts: Parts, world_size: int) -> StepPlan | RolloutPlan:
    """Which rows each optimizer step trains on: the datasets' samples, or GRPO's rollouts with their advantages."""
    if recipe.train.objective != "grpo":
        return StepPlan(parts.train, recipe, world_size)
    g = recipe.grpo
    rollouts = read_replay(g.replay, parts.tokenizer, g.num_generations, {r.label: r.weight for r in g.rewards},
                           recipe.tokenizer.chat_template_kwargs)
    scorer = policy_scorer(parts.net, recipe, parts.tokenizer.pad_token_id, parts.device)
    return RolloutPlan(rollouts, recipe, world_size, end_ids(parts.tokenizer, parts.lm), scorer)


def _prepared(recipe: Recipe, tokenizer: Any, world: dist.World, say: Callable[[str], Any]) -> Prepared:
    """The samples (from the data cache; rank 0 first under torchrun). A GRPO replay needs no datasets: its
    rollouts are read by the plan (finetune/rl/plan.py), and its identity is the file's content."""
    if not recipe.datasets and recipe.grpo.replay:
        digest = hashlib.sha256(Path(recipe.grpo.replay).read_bytes()).hexdigest()
        say(f"rollouts: replayed from {recipe.grpo.replay}")
        return Prepared([], [], DataStats(), DataStats(), False, None, "", samples_key=f"replay:{digest}")
    with dist.main_first(world, "rank 0 to preprocess the data"):
        prepared = prepare(recipe, tokenizer)
    say(prepared.note)  # reused the preprocessed-data cache, or wrote it
    say(data_summary(prepared.train_stats, len(prepared.evals)))
    for example in prepared.train_stats.bad_row_examples:  # the first few, so a user can see which rows and why
        say(f"  skipped: {example}")
    return prepared


def data_summary(stats: DataStats, n_eval: int) -> str:
    """The data line of the run log: samples, tokens, target tokens, eval samples, and what was cut or skipped."""
    line = (f"data: {stats.samples} samples, {stats.tokens} tokens, {stats.target_tokens} target tokens; "
            f"{n_eval} eval samples")
    if stats.truncated or stats.dropped_too_long:
        line += f"; {stats.truncated} truncated, {stats.dropped_too_long} dropped (too long)"
    if stats.bad_rows_skipped:
        line += f"; {stats.bad_rows_skipped} bad rows skipped"
    return line
