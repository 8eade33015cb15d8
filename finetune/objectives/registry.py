"""The objective a recipe trains (train.objective): the one place that maps its name to an implementation."""

from __future__ import annotations

from finetune.objectives.base import Objective
from finetune.objectives.distill import Distill
from finetune.objectives.grpo import GRPO
from finetune.objectives.preference import DPO, ORPO
from finetune.objectives.reward import Reward
from finetune.objectives.sft import SFT
from finetune.recipe import Recipe


def objective_for(recipe: Recipe) -> Objective:
    """The objective the recipe trains (train.objective)."""
    name = recipe.train.objective
    if name == "dpo":
        return DPO(recipe.dpo.beta, recipe.dpo.loss, recipe.dpo.label_smoothing)
    if name == "orpo":
        return ORPO(recipe.orpo.beta, recipe.orpo.nll)
    if name == "reward":
        return Reward(recipe.reward.center_coefficient)
    if name == "grpo":
        return GRPO(recipe.grpo)
    if name == "distill":
        return Distill(recipe.distill)
    return SFT()
