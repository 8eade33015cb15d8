"""The recipe's `grpo:` section: group relative policy optimization (train.objective: grpo; docs/rl.md)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from finetune.recipe.code import BUILT_IN_REWARDS, spec_problem
from finetune.recipe.section import Section


class ExactAnswerArgs(Section):
    """The args of the built-in exact_answer."""

    field: str = "answer"
    """The prompt rows' field holding the expected answer."""


class FormatRegexArgs(Section):
    """The args of the built-in format_regex."""

    pattern: str
    """The regular expression the whole completion must match (re.fullmatch, DOTALL)."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return value


class LengthArgs(Section):
    """The args of the built-in length."""

    target: int = Field(100, ge=0)
    """The completion length in characters that scores highest (0)."""
    scale: float = Field(100.0, gt=0)
    """Characters per point of penalty."""


class RewardModelArgs(Section):
    """The args of the built-in reward_model."""

    path: str = Field(min_length=1)
    """The reward model: a finished run of train.objective reward (or its final/), or a model directory of a
    transformers sequence classifier with one label. A relative path is taken from the recipe's folder when it
    exists there, else from the current directory."""
    batch_size: int = Field(8, gt=0)
    """Conversations scored per forward."""


BUILT_IN_ARGS: dict[str, type[Section]] = {"exact_answer": ExactAnswerArgs, "format_regex": FormatRegexArgs,
                                           "length": LengthArgs, "reward_model": RewardModelArgs}
"""Each built-in reward's args, checked like recipe keys (recipe/validation.py); keys: code.BUILT_IN_REWARDS."""


class RewardConfig(Section):
    """One reward function and its weight in the total reward."""

    function: str
    """A built-in (exact_answer, format_regex, length, reward_model: a trained reward model's score) or
    `module.path:function` from your code, called as f(prompts, completions, **row_fields) -> list of floats (None:
    no opinion on that completion). Your code runs only with your consent: --allow-code, or allow_code: true in the
    recipe you run (docs/rl.md, "Code in recipes")."""
    weight: float = 1.0
    """Its weight in the total reward (weighted sum; a function's None counts as 0 unless every function says None,
    which leaves the completion unscored: advantage 0)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the function. A built-in's are checked like recipe keys: exact_answer: field (the rows'
    answer field, default answer); format_regex: pattern (required, a regular expression); length: target (characters,
    default 100), scale (default 100); reward_model: path (required: a reward model run or model directory),
    batch_size (default 8). A function of yours gets them as they are."""
    name: str | None = None
    """Its name in the metrics and in a replay file's `rewards` (default: the function's name)."""

    @field_validator("function")
    @classmethod
    def _is_a_reference(cls, value: str) -> str:
        if value in BUILT_IN_REWARDS:
            return value
        if ":" not in value:
            raise ValueError(f"unknown reward function {value!r}; built-ins: {', '.join(BUILT_IN_REWARDS)}, or "
                             "module.path:function from your code")
        problem = spec_problem(value)
        if problem is not None:
            raise ValueError(f"{value!r} is not module.path:function ({problem})")
        return value

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
    engine: Literal["auto", "generate", "paged"] = "auto"
    """What generates the rollouts: generate (transformers' generate on left-padded batches), paged (its continuous
    batching, generate_batch: a paged KV cache, no padding, requests leaving the batch as they finish; greedy gives
    generate's tokens exactly), auto (generate: paged was measured slower on an H100, 0.31-0.78x; README)."""
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
    importance_correction: Literal["none", "tis", "mis"] = "none"
    """The sampling engine's log-probabilities against the trainer's (the replay file's `logprobs`: another engine's
    numbers), corrected by an importance weight exp(trainer - engine) on each completion token's policy loss (TRL's
    vllm_importance_sampling_correction): tis truncates it to [importance_min, importance_max] (TRL's *_truncate), mis
    zeroes it outside (TRL's *_mask); per token or per sequence (importance_level). none: no weight. A token without
    an engine log-probability gets weight 1. Needs ratio_against: policy (docs/rl.md)."""
    importance_level: Literal["token", "sequence"] = "sequence"
    """The weight per token, or one per completion from the sum of its tokens' log-ratios (TRL's default,
    sequence_mask, is importance_correction mis at this level)."""
    importance_max: float | None = Field(3.0, gt=0)
    """The upper bound of the importance weight (TRL's vllm_importance_sampling_clip_max); null: none."""
    importance_min: float | None = Field(None, ge=0)
    """The lower bound (TRL's vllm_importance_sampling_clip_min); null: none."""
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
    reward_timeout_s: float | None = Field(1800.0, gt=0)
    """The longest one call of a reward function may take (it scores a batch of completions); past it the run
    stops naming the function (a hung function would otherwise hold the run forever). null: no limit."""
    replay: str | None = None
    """A JSON-lines file of rollouts used instead of generating (docs/rl.md, "The replay file"): each optimizer step
    takes the next micro_batch_size x gradient_accumulation_steps x ranks lines."""
    tools: list[str] = Field(default_factory=list)
    """Functions the policy may call, each module.path:function with type hints and a docstring (their schema is
    transformers' get_json_schema); generated rollouts then run over several turns (docs/rl.md, "Tools and
    environments"). Your code: it runs only with --allow-code or allow_code: true."""
    environment: str | None = None
    """A class (module.path:Class), one instance per rollout: reset(**row) -> text added to the prompt's last message
    (or None); its public methods are tools; get_reward() (optional) is a reward read after the episode. A TRL
    environment_factory class runs unchanged. Your code: it runs only with --allow-code or allow_code: true."""
    max_turns: int = Field(8, ge=1)
    """The most policy turns of one rollout (a turn that calls no tool ends it sooner); max_new_tokens budgets the
    whole multi-turn completion, the environment's tokens included (TRL's max_completion_length)."""
    tool_timeout_s: float | None = Field(60.0, gt=0)
    """The longest one tool call may take; past it the call's result is an error (counted in tool_timeouts)."""
    tool_result_max_tokens: int | None = Field(512, gt=0)
    """The most tokens a tool result's text keeps (cut on the side tool_result_keep does not keep; counted in
    tool_results_cut). null: no limit."""
    tool_result_keep: Literal["head", "tail"] = "head"
    """Which end of a long tool result is kept: its start (head) or its end (tail)."""
    tool_call_format: Literal["auto", "tokenizer", "hermes", "llama3", "mistral", "mistral_v7", "harmony"] = "auto"
    """How tool calls are read from the policy's text: auto = the tokenizer's own response_template, else the format
    the chat template writes (hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], gpt-oss harmony); or one by
    name."""
    template_rewrites: Literal["keep", "refuse"] = "keep"
    """A chat template that rewrites earlier turns when a turn is added (Qwen3 drops earlier reasoning): keep trains
    the tokens the policy saw and renders the environment's turn after them; refuse stops naming the turn."""

    @field_validator("tools")
    @classmethod
    def _tools_are_references(cls, value: list[str]) -> list[str]:
        bad = [f"{spec!r} ({problem})" for spec in value if (problem := spec_problem(spec)) is not None]
        if bad:
            raise ValueError(f"each tool is module.path:function: {', '.join(bad)}")
        return value

    @field_validator("environment")
    @classmethod
    def _environment_is_a_reference(cls, value: str | None) -> str | None:
        problem = spec_problem(value) if value is not None else None
        if problem is not None:
            raise ValueError(f"{value!r} is not module.path:Class ({problem})")
        return value

    @property
    def multi_turn(self) -> bool:
        """Whether generated rollouts run over several turns (tools or an environment)."""
        return bool(self.tools or self.environment)

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
