"""The parts every command that runs a model on a recipe's data needs, built one way: the tokenizer, the samples,
the model, the resolved loss implementation, the objective (prepared) and the model with its fused loss.

`finetune train`, `finetune eval` and `finetune verify` all start from `load_parts`, so what the proof of exact
accumulation checks, what eval measures and what trains are the same samples, model and objective. What differs
is passed in: the trainer's model checks (disk room, packing isolation, compilation), a finished run's model for
eval, which splits the objective prepares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune import dist
from finetune.data import DataStats, StepPlan
from finetune.data.stream import StreamPlan
from finetune.errors import UserError
from finetune.loss.fused import resolve_impl
from finetune.model import hub, qat
from finetune.model.loading import load_model
from finetune.model.router_loss import router_loss
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.model.with_score import SequenceScorer
from finetune.objectives import Objective, Planning, Preparation, objective_for
from finetune.recipe import Recipe
from finetune.rl.plan import RolloutPlan
from finetune.run.trained import load_trained


@dataclass
class Parts:
    """What `load_parts` built. `lm` is the model as loaded (PEFT-wrapped with an adapter): what is saved and
    what DDP/FSDP wrap around; `net` is it with its fused loss (a reward model: with its score head read at each
    sequence's last token), unwrapped."""

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
    net: CausalLMWithLoss | SequenceScorer
    images_key: str | None = None  # the training images' bytes (Prepared.images_key), recorded in checkpoints


def load_parts(recipe: Recipe, world: dist.World, device: torch.device, say: Callable[[str], Any], *,
               trained_run: Path | None = None, fresh_model: bool = True, splits: tuple[str, ...] = ("train", "eval"),
               check_model: Callable[[torch.nn.Module, Any], None] | None = None) -> Parts:
    """Tokenizer, samples (from the data cache; rank 0 first under torchrun), model, objective and the model with
    its loss, for `recipe` on `device`.

    `trained_run`: evaluate a finished run's model (and its tokenizer) instead of loading the recipe's.
    `fresh_model`: the model has not trained yet (False on a resume: the objective's reference is reloaded).
    `splits`: the samples the objective prepares (the DPO reference pass costs a forward over each).
    `check_model(lm, tokenizer)`: the caller's checks of the loaded model, before the objective prepares."""
    hub.check_recipe(recipe)  # a hub id out of reach is one line now, not a minute of retries in the first load
    if trained_run is not None:
        lm, tokenizer = load_trained(trained_run, recipe)
    else:
        lm, tokenizer = None, load_tokenizer(recipe.tokenizer, recipe.model)
    objective = objective_for(recipe)
    prepared = objective.samples(recipe, tokenizer, world, say)  # GRPO: none; its plan makes the rows
    if lm is None:
        lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, device,
                        trainable=recipe.train.trainable_parameters, score_head=recipe.train.objective == "reward")
        qat.prepare(lm, recipe.qat, device)  # the trained model only: references and teachers load plain
    lm = lm.to(device)
    if check_model is not None:
        check_model(lm, tokenizer)
    check_router_loss(lm, objective)
    impl = resolve_impl(recipe.loss.impl, device)
    chosen = {name: samples for name, samples in (("train", prepared.train), ("eval", prepared.evals))
              if name in splits}
    objective.prepare(chosen, lm, Preparation(recipe, tokenizer, impl, device, prepared.samples_key, fresh_model, say))
    net = SequenceScorer(lm, recipe.model.packed_attention) if recipe.train.objective == "reward" else \
        CausalLMWithLoss.for_recipe(lm, recipe.loss, impl, recipe.model.packed_attention)
    return Parts(recipe, device, tokenizer, prepared.train, prepared.evals, prepared.train_stats,
                 prepared.samples_key, lm, impl, objective, net, prepared.images_key)


def check_router_loss(lm: torch.nn.Module, objective: Objective) -> None:
    """Refuse a model that adds its router's load-balancing loss (output_router_logits) under an objective whose loss
    does not add it (only SFT's does): it would train on another loss than the model's own."""
    if router_loss(lm) is not None and not getattr(objective, "adds_router_loss", False):
        raise UserError(f"model.config.output_router_logits is true, and train.objective {objective.name} does not add "
                        "the router's load-balancing loss to its loss (sft does; docs/models.md). Set "
                        "output_router_logits: false (model.config, or model.config_overrides for a pretrained model)")


def plan_for(recipe: Recipe, parts: Parts, world: dist.World,
             world_size: int | None = None) -> StepPlan | RolloutPlan | StreamPlan:
    """Which rows each optimizer step trains on, as the objective says: the datasets' samples, or GRPO's rollouts
    (a replay file's, or generated by the policy, each rank its share of the prompts) with their advantages; with
    data.streaming, each rank's share of the streamed datasets as it reads them (data/stream.py).
    `world_size`: the ranks the step is split over, when other than this process's world (verify simulates them)."""
    if recipe.data.streaming:  # sft only (recipe/streaming.py): the objective's own plan would need every sample
        return StreamPlan(recipe, parts.tokenizer, world.rank, world.size, world_size or world.size)
    return parts.objective.plan(Planning(recipe, parts.train, parts.tokenizer, parts.lm, parts.net, parts.device,
                                         world, world_size or world.size))
