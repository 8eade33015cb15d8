"""The recipe's `grpo:` section: group relative policy optimization (train.objective: grpo; docs/rl.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from finetune.recipe.section import Section


class RewardConfig(Section):
    """One reward function and its weight in the total reward."""

    function: str
    """A built-in (exact_answer, format_regex, length) or `module.path:function` from your code, called as
    f(prompts, completions, **row_fields) -> list of floats (None: no opinion on that completion)."""
    weight: float = 1.0
    """Its weight in the total reward (weighted sum; a function's None counts as 0 unless every function says None,
    which leaves the completion unscored: advantage 0)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a built-in (format_regex: pattern; exact_answer: field; length: target, scale)."""
    name: str | None = None
    """Its name in the metrics and in a replay file's `rewards` (default: the function's name)."""

    @property
    def label(self) -> str:
        return self.name or self.function.rsplit(":", 1)[-1]


class GRPOConfig(Section):
    """Group relative policy optimization (train.objective: grpo): rollouts of the current policy (or a replay
    file), rewards, group-relative advantages, a clipped policy loss normalized exactly over the optimizer step."""

    num_generations: int = Field(4, ge=2)
    """Completions per prompt (the group). One optimizer step's completions (micro_batch_size x
    gradient_accumulation_steps x ranks) must be a multiple of it."""
    max_new_tokens: int = Field(128, gt=0)
    """Longest completion; a completion that reaches it without an end token is truncated."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts; the policy, its ratio and its KL are scored as logits / temperature
    (the policy that samples, as TRL does)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling of the rollouts."""
    beta: float = Field(0.0, ge=0)
    """Weight of the per-token KL to the reference (k3 estimator). 0: no reference pass."""
    kl_gradient: Literal["exact", "k3"] = "exact"
    """exact: k3 times the importance ratio (TRL's use_bias_correction_kl, its default): same value, and the
    gradient of KL(policy || reference). k3: plain k3, whose gradient is the reverse KL's."""
    reference: str = "auto"
    """The reference model (beta > 0): auto (the model as loaded; with an adapter, the base with the adapter off) or
    a path to another model with the same tokenizer."""
    epsilon: float = Field(0.2, ge=0)
    """Lower clipping of the importance ratio: 1 - epsilon."""
    epsilon_high: float | None = Field(None, ge=0)
    """Upper clipping: 1 + epsilon_high (null: epsilon; DAPO uses 0.28)."""
    iterations: int = Field(1, ge=1)
    """Optimizer steps on one batch of rollouts; the importance ratio is taken against the policy before the first
    of them (grpo.ratio_against)."""
    ratio_against: Literal["policy", "replay"] = "policy"
    """The importance ratio's denominator. policy (TRL's): the policy's own log-probabilities before the batch's
    first update (with iterations 1 the ratio is exactly 1). replay: the replay file's `logprobs` (rollouts sampled
    by another engine or an older policy; every line must have them)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage = (reward - group mean) / (std + 1e-4), std with Bessel's correction over the group (group), the
    whole step's rollouts (batch), or no division (none)."""
    normalize: Literal["tokens", "sequences", "constant"] = "tokens"
    """The policy loss over the step: tokens = sum over every completion token of the step (all micro-batches and
    ranks) / their number (TRL's dapo); sequences = mean over completions of each one's token mean (TRL's grpo);
    constant = sum / (completions x max_new_tokens) (Dr. GRPO). Exact under any split."""
    mask_truncated: bool = False
    """A truncated completion (its last token is no end token) trains nothing (it still counts as a completion)."""
    rewards: list[RewardConfig] = Field(default_factory=list)
    """The reward functions; their weighted sum is a completion's reward."""
    replay: str | None = None
    """A JSON-lines file of rollouts used instead of generating (docs/rl.md, "The replay file"): each optimizer step
    takes the next micro_batch_size x gradient_accumulation_steps x ranks lines."""

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
