"""A rollout (one completion of one prompt, with its rewards) and the training row made of it.

TRL's conventions (docs/rl.md): the completion's tokens are exactly the ids sampled, the end token included, and
each is scored from the logits at the position before it; a completion is truncated when its last id is neither
an end token nor padding, and with mask_truncated it trains nothing but still counts as a completion.

A multi-turn completion (tool calls, an environment) holds tokens the environment wrote between the policy's turns
(tool results, the headers the template adds): `env_mask` says which (1: sampled by the policy, 0: written by the
environment; TRL's polarity). They stay in the row, as context the model attends to, but carry no label: no loss,
no KL, no entropy, and no place in any count of the step (docs/rl.md, "Multi-turn rollouts").
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from finetune.labels import IGNORE_INDEX


@dataclass
class Rollout:
    """One completion: its prompt's and its own token ids, its group, its rewards by function (NaN: unscored),
    the sampling policy's log-probabilities of its tokens (None: not known), and where it came from (file:line or
    the prompt's row), for messages."""

    group: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = math.nan
    logprobs: list[float] | None = None
    where: str = ""
    prompt: Any = None
    completion: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    env_mask: list[int] | None = None
    """One per completion token: 1 sampled by the policy, 0 written by the environment (None: all sampled)."""

    @property
    def env_tokens(self) -> int:
        return 0 if self.env_mask is None else len(self.env_mask) - sum(self.env_mask)

    def truncated(self, end_ids: Collection[int]) -> bool:
        return not self.completion_ids or self.completion_ids[-1] not in end_ids


def training_row(rollout: Rollout, advantage: float, masked: bool, sampled_logprobs: bool = False) -> dict[str, Any]:
    """The row the objective trains on: prompt + completion, labels on the completion's sampled tokens only (none
    when `masked`, none on the environment's), and the completion's advantage under "rollout", with its sampling
    log-probabilities as the ratio's denominator when `sampled_logprobs` (grpo.ratio_against: replay; else the
    policy's own, found later) and, as "sampling", the engine's (grpo.importance_correction)."""
    n_prompt = len(rollout.prompt_ids)
    sampled = rollout.env_mask or [1] * len(rollout.completion_ids)
    labels = [IGNORE_INDEX] * n_prompt + [IGNORE_INDEX if masked or not mine else token
                                          for token, mine in zip(rollout.completion_ids, sampled)]
    return {"input_ids": [*rollout.prompt_ids, *rollout.completion_ids], "labels": labels,
            "rollout": {"advantage": advantage, "logprobs": rollout.logprobs if sampled_logprobs else None,
                        "sampling": rollout.logprobs, "where": rollout.where,
                        "prompt_length": n_prompt}}


def end_ids(tokenizer: Any, lm: Any = None) -> set[int]:
    """The ids that end a completion: the tokenizer's end and padding tokens and the model's generation config's
    end tokens (one id or a list)."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    config_eos = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
    ids |= set(config_eos) if isinstance(config_eos, list | tuple) else {config_eos}
    return {i for i in ids if i is not None}
