"""On-policy distillation (distill.lmbda: GKD's lambda; docs/distill.md): a seeded fraction of the optimizer steps
train on the student's own completions of their rows' prompts instead of the datasets' completions; with
distill.seq_kd, the other steps on the teacher's completions (sequence-level KD).

A step is on-policy when a draw from (seed, step) falls below lmbda: the same steps on a resume and on any number of
ranks. Its rows are the dataset step's rows, each cut before its last trained turn (its prompt, TRL's rule: the last
message is the completion) and completed by the student through the generation seam (finetune/rl/generation.py),
with the torch RNG seeded from (seed, step) for the generation only: the same completions on a resume, on every
rank, and in every split of the step (prompts are generated in batches of distill.generation_batch_size, whatever
the micro-batch). The teacher then scores those tokens as any others: the loss and its normalizer are unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from finetune.data import StepPlan
from finetune.labels import IGNORE_INDEX, trained_count
from finetune.recipe import Recipe
from finetune.rl.generation import Generator


class OnPolicyPlan(StepPlan):
    """The dataset step plan, with on-policy steps' rows remade from the student's completions and, with
    distill.seq_kd, the other steps' from the teacher's (`teacher`: its generator)."""

    prefetch = False  # an on-policy step's rows depend on the update of the step before

    def __init__(self, samples: Sequence[dict], recipe: Recipe, world_size: int, generator: Generator,
                 teacher: Generator | None = None) -> None:
        super().__init__(samples, recipe, world_size)
        self.generator, self.teacher, self.cfg = generator, teacher, recipe.distill
        self.stop: Any = lambda: False  # the run's stop request (the loop sets it), asked between sampled tokens
        self._current: tuple[int, int, list[dict]] | None = None

    def on_policy(self, step: int) -> bool:
        """Whether step `step` (0-based) trains on the student's completions: a draw seeded by (seed, step)."""
        return random.Random(f"on-policy:{self.recipe.seed}:{step}").random() < self.cfg.lmbda

    def source(self, step: int) -> Generator | None:
        """Who completes step `step`'s prompts: the student (on-policy), the teacher (seq_kd), or no one."""
        return self.generator if self.on_policy(step) else self.teacher

    def step(self, step: int) -> tuple[int, list[dict]]:
        """(epoch, rows) of step `step`: the datasets' rows, or the student's (or the teacher's) completions."""
        if self._current is None or self._current[0] != step:
            epoch, rows = super().step(step)
            generator = self.source(step)
            if generator is not None:
                rows = self._completed(step, rows, generator)
            self._current = (step, epoch, rows)
        return self._current[1], self._current[2]

    def info(self, step: int) -> dict[str, float]:
        """`on_policy` (1 or 0), `seq_kd` (the teacher completed the step: 1 or 0, with distill.seq_kd) and, on a
        step of completions, their mean length in tokens."""
        on_policy = self.on_policy(step)
        figures = {"on_policy": float(on_policy), **({"seq_kd": float(not on_policy)} if self.teacher else {})}
        if self.source(step) is not None:
            _, rows = self.step(step)
            lengths = [trained_count(r["labels"]) for r in rows]
            figures["completion_tokens"] = sum(lengths) / max(1, len(lengths))
        return figures

    def _completed(self, step: int, rows: list[dict], generator: Generator) -> list[dict]:
        prompts = [prompt_of(r) for r in rows]
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):  # the run's own RNG streams are left as they were
            torch.manual_seed(random.Random(f"on-policy-sample:{self.recipe.seed}:{step}").getrandbits(63))
            completions = generator.generate(prompts, stop=self.stop, max_new_tokens=self.cfg.max_new_tokens)
        return [completed_row(p, c, self.recipe.data.max_seq_len) for p, c in zip(prompts, completions)]


def prompt_of(row: dict) -> list[int]:
    """The row's tokens before its last trained turn (the last run of trained labels): its on-policy prompt."""
    labels = row["labels"]
    end = max((t for t in range(len(labels)) if labels[t] != IGNORE_INDEX), default=None)
    if end is None:
        return list(row["input_ids"])
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return list(row["input_ids"][:start])


def completed_row(prompt: list[int], completion: list[int], max_seq_len: int | None) -> dict:
    """A training row of the prompt and the student's completion, only the completion trained (cut to
    data.max_seq_len)."""
    ids = prompt + completion
    labels = [IGNORE_INDEX] * len(prompt) + completion
    labels[0] = IGNORE_INDEX  # nothing predicts the first token
    if max_seq_len is not None:
        ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    return {"input_ids": ids, "labels": labels}
