"""The recipe's `dpo:`, `orpo:` and `reward:` sections: preference optimization and reward models (train.objective:
dpo | orpo | reward; docs/preference.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from finetune.recipe.section import Section


class DPOConfig(Section):
    """Direct preference optimization (train.objective: dpo)."""

    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL penalty: rewards are beta x (policy - reference) log-probabilities."""
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid: -log sigmoid(beta x margin) (the DPO paper). ipo: (length-averaged margin - 1 / (2 beta))^2.
    hinge: relu(1 - beta x margin)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """sigmoid only: conservative DPO, the assumed probability that a pair's preference is flipped."""
    reference: str = "auto"
    """The reference model: auto (the model as loaded, before training; with an adapter, the base with the adapter
    off), or a path to another model with the same tokenizer. Its log-probabilities are computed once before
    training and cached by content; a resume is refused if the weights at the path changed."""
    completion_end: Literal["marker", "template"] = "marker"
    """Which tokens a completion's log-probability covers. marker: its assistant turns as SFT scores them, each
    turn's content through its end-of-turn marker. template: on to the end of the chat template's rendering (with
    ChatML the newline after `<|im_end|>` too): TRL's DPOTrainer's completion (docs/preference.md)."""


class ORPOConfig(Section):
    """Odds-ratio preference optimization (train.objective: orpo): no reference model."""

    beta: float = Field(0.1, gt=0)
    """Weight of the odds-ratio term next to the chosen completions' cross-entropy."""
    completion_end: Literal["marker", "template"] = "marker"
    """Which tokens a completion covers. marker: its assistant turns as SFT scores them (content and end-of-turn
    marker). template: TRL's ORPOTrainer's: on to the end of the chat template's rendering, then the tokenizer's
    eos appended when the rendering does not end with it (with ChatML a second `<|im_end|>` after the newline)."""
    nll: Literal["completion", "sequence"] = "completion"
    """What the cross-entropy term covers. completion: the chosen completions' tokens. sequence: every token of
    the chosen side but its first, the prompt's too (TRL's ORPOTrainer); over the step's such tokens either way."""


class RewardModelConfig(Section):
    """A reward model (train.objective: reward): the model with a sequence classification head of one score, trained
    on preference pairs with the Bradley-Terry loss, -log sigmoid(score_chosen - score_rejected - margin), where a
    row's `margin` field, when it has one, is its pair's margin (TRL's layout; docs/preference.md, "Reward
    models")."""

    center_coefficient: float = Field(0.0, ge=0)
    """Reward centering: adds center_coefficient x (score_chosen + score_rejected)^2 to each pair's loss, which keeps
    the scores near 0 (TRL's and Axolotl's center_rewards_coefficient; 0.01 is usual). 0: off."""
