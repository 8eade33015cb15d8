"""Which completions each optimizer step trains on, with their advantages: StepPlan's counterpart for GRPO.

A batch of rollouts is one optimizer step's completions (micro_batch_size x gradient_accumulation_steps x ranks,
whole groups), taken in order; its advantages are computed once, over the whole batch, before it is split into
micro-batches (so batch 1 with accumulation still sees whole groups). With grpo.iterations > 1 each batch trains
that many optimizer steps, its importance ratio taken against the sampling policy's log-probabilities: the replay
file's, else the policy's own before the first of those steps (`score`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from typing import Any

from finetune.data.batching import steps_in
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.recipe import Recipe
from finetune.rl.advantages import group_advantages
from finetune.rl.rollout import Rollout, training_row

# The policy's log-probabilities of each row's completion tokens (rows as training_row makes them).
Scorer = Callable[[list[dict]], list[list[float]]]
STATE_FORMAT = 1  # of resume_state's record


class RolloutPlan:
    """The optimizer steps of batches of rollouts: `fetch(i)` gives batch i's (i counts over epochs), a replay
    file's slice or the policy's generations; `batches` per epoch."""

    def __init__(self, fetch: Callable[[int], list[Rollout]], batches: int, recipe: Recipe, world_size: int,
                 end_ids: Collection[int], score: Scorer | None = None, prefetch: bool = True) -> None:
        t, g = recipe.train, recipe.grpo
        self.fetch, self.batches, self.recipe, self.end_ids = fetch, batches, recipe, frozenset(end_ids)
        self.score = score
        # Not ahead when a batch's rows depend on the previous step's update: generated rollouts, and the policy's
        # log-probabilities that iterations > 1 take the ratio against (scored before the batch's first step).
        self.prefetch = prefetch and not (g.iterations > 1 and g.ratio_against == "policy")
        self.global_batch = t.micro_batch_size * t.gradient_accumulation_steps * world_size
        per_epoch = self.batches * g.iterations
        total = per_epoch * t.epochs if t.epochs is not None else t.max_steps
        self.total = min(total, t.max_steps) if t.max_steps else total
        self._current: tuple[int, list[dict], dict[str, float]] | None = None
        self.evaluator: Callable[[], dict[str, float]] | None = None  # held-out mean reward (generated rollouts)
        # The run's stop request (the loop sets it), asked while rollouts are generated: Interrupted once it is true.
        self.stop: Callable[[], bool] = lambda: False
        self.note = ""

    def steps_in_epoch(self, epoch: int) -> int:
        return self.batches * self.recipe.grpo.iterations

    def cadence(self, every_steps: int | None, every_epochs: float | None) -> int | None:
        if every_epochs is None:
            return every_steps
        return max(1, math.ceil(every_epochs * self.steps_in_epoch(0) - 1e-9))

    def step(self, step: int) -> tuple[int, list[dict]]:
        """(epoch, the step's training rows with their advantages)."""
        index = step // self.recipe.grpo.iterations
        epoch = index // self.batches
        if self._current is None or self._current[0] != index:
            self._current = (index, *self._rows(index))
        return epoch, self._current[1]

    def info(self, step: int) -> dict[str, float]:
        """The step's rollout figures for its metrics line (rewards, zero-advantage groups, lengths)."""
        self.step(step)
        return self._current[2]

    def resume_state(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint taken after `step` optimizer steps holds so that a resume continues exactly: inside a
        batch's iterations, that batch's rows (generated rollouts, advantages, the sampling log-probabilities
        scored before its first step) and figures, which a resume must not make again from the updated policy.
        None at a batch boundary: the next step makes its batch from the policy as it is, resumed or not."""
        index = step // self.recipe.grpo.iterations
        if step % self.recipe.grpo.iterations == 0 or self._current is None or self._current[0] != index:
            return None
        return {"format": STATE_FORMAT, "batch": index, "rows": self._current[1], "figures": self._current[2]}

    def restore(self, state: dict[str, Any] | None, step: int, where: str) -> str | None:
        """Take back the batch a checkpoint taken inside its iterations recorded (`resume_state`); returns a
        warning when one from before finetune recorded it must make the batch again (not an exact resume)."""
        iterations = self.recipe.grpo.iterations
        if step % iterations == 0:
            return None
        if state is None:
            return (f"{where} was taken inside a batch's {iterations} iterations by a finetune that did not record "
                    "the batch: it is made again from the resumed policy, so the resume is not exact")
        index = step // iterations
        if state.get("format") != STATE_FORMAT or state.get("batch") != index:
            raise UserError(f"resume: {where} records rollouts of batch {state.get('batch')!r} (format "
                            f"{state.get('format')!r}), not of batch {index} at step {step}; resume another "
                            "checkpoint")
        self._current = (index, state["rows"], state["figures"])
        return None

    def _rows(self, batch: int) -> tuple[list[dict], dict[str, float]]:
        g = self.recipe.grpo
        start = time.perf_counter()
        rollouts = self.fetch(batch)
        adv = group_advantages([r.reward for r in rollouts], g.num_generations, g.scale_rewards)
        truncated = [r.truncated(self.end_ids) for r in rollouts]
        rows = [training_row(r, a, g.mask_truncated and cut, g.ratio_against == "replay")
                for r, a, cut in zip(rollouts, adv.values, truncated)]
        if g.iterations > 1 and self.score is not None and any(row["rollout"]["logprobs"] is None for row in rows):
            for row, logps in zip(rows, self.score(rows)):  # the sampling policy: the policy before this batch's steps
                row["rollout"]["logprobs"] = row["rollout"]["logprobs"] or logps
        figures = rollout_figures(rollouts, truncated, adv.zero_std_groups) | getattr(self.fetch, "figures", {})
        # Making the batch (generation, rewards, gathering, the sampling log-probs): outside the training's tokens/s.
        return rows, figures | {"rollout_s": time.perf_counter() - start}


def group_batch(recipe: Recipe, world_size: int) -> int:
    """One optimizer step's completions, checked to be whole groups."""
    t, g = recipe.train, recipe.grpo
    size = t.micro_batch_size * t.gradient_accumulation_steps * world_size
    if size % g.num_generations:
        raise UserError(f"an optimizer step's {size} completions (train.micro_batch_size x "
                        f"gradient_accumulation_steps x ranks) are not whole groups of grpo.num_generations "
                        f"{g.num_generations}")
    return size


def replay_plan(rollouts: list[Rollout], recipe: Recipe, world_size: int, end_ids: Collection[int],
                score: Scorer | None = None) -> RolloutPlan:
    """The plan of a replay file's rollouts: each step the next global batch of lines, epochs in file order."""
    size = group_batch(recipe, world_size)
    batches = steps_in(len(rollouts), size, recipe.data.drop_last)
    if batches == 0:
        raise UserError(f"one optimizer step needs {size} completions but the replay file has {len(rollouts)}; "
                        "lower train.micro_batch_size or gradient_accumulation_steps")

    def fetch(index: int) -> list[Rollout]:
        b = index % batches
        return rollouts[b * size:(b + 1) * size]

    return RolloutPlan(fetch, batches, recipe, world_size, end_ids, score)


def rollout_figures(rollouts: list[Rollout], truncated: list[bool], zero_std: float) -> dict[str, Any]:
    """Reward mean and std (Bessel; unscored completions left out) in total and per function, the fraction of
    groups whose rewards are all equal (no advantage: nothing to learn), and completion lengths."""
    def mean_std(values: list[float]) -> tuple[float, float]:
        xs = [v for v in values if not math.isnan(v)]
        if not xs:
            return math.nan, math.nan
        mean = sum(xs) / len(xs)
        return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0

    reward, reward_std = mean_std([r.reward for r in rollouts])
    figures: dict[str, Any] = {"reward": reward, "reward_std": reward_std, "zero_std_groups": zero_std}
    for name in dict.fromkeys(k for r in rollouts for k in r.rewards if k != "reward"):  # "reward": the total
        mean, std = mean_std([r.rewards.get(name, math.nan) for r in rollouts])
        figures |= {f"rewards/{name}": mean, f"rewards_std/{name}": std}
    lengths = [len(r.completion_ids) for r in rollouts]
    figures |= {"completion_length": sum(lengths) / len(lengths), "completion_length_max": max(lengths),
                "truncated": sum(truncated) / len(truncated)}
    if any(r.env_mask is not None for r in rollouts):  # multi-turn: the environment's share of the completions
        figures["env_tokens"] = sum(r.env_tokens for r in rollouts) / len(rollouts)
    return figures


def policy_scorer(net: Any, recipe: Recipe, pad_id: int, device: Any) -> Scorer:
    """A Scorer running `net` (the policy with its fused loss) without gradients over micro-batches of rows."""
    import torch

    from finetune.data.collate import collate

    data = recipe.data.model_copy(update={"packing": False})
    size = recipe.train.micro_batch_size

    def score(rows: list[dict]) -> list[list[float]]:
        out: list[list[float]] = []
        with torch.no_grad():
            for start in range(0, len(rows), size):
                chunk = rows[start:start + size]
                batch = collate(chunk, data, pad_id).to(device)
                logp, _ = net(**batch.model_inputs(), per_token=True, temperature=recipe.grpo.temperature)
                values = logp.double().cpu().tolist()
                for n, row in zip(batch.rollouts.scored, chunk):
                    out.append(_per_completion_token(row, values[:n]) if n else None)
                    values = values[n:]
        return out

    return score


def _per_completion_token(row: dict, scored: list[float]) -> list[float]:
    """The log-probabilities of a row's scored tokens laid out one per completion token, as a replay file's are: a
    token with no label (the environment's, in a multi-turn completion) gets 0.0, which is never read."""
    start = row["rollout"]["prompt_length"]
    out, values = [], iter(scored)
    for label in row["labels"][start:]:
        out.append(0.0 if label == IGNORE_INDEX else next(values))
    return out
