"""What is optimized: the objective seam (base.py: what a micro-batch's loss terms and counts are), SFT (sft.py),
DPO and ORPO (preference.py; the per-pair losses as pure functions in pair_losses.py, the DPO reference's
log-probabilities in reference.py), reward models (reward.py), GRPO (grpo.py), where the datasets' rows come from
(rows.py), and which one a recipe trains (registry.py)."""

from finetune.objectives.base import MicroResult, Objective, Planning, Preparation
from finetune.objectives.registry import objective_for

__all__ = ["MicroResult", "Objective", "Planning", "Preparation", "objective_for"]
