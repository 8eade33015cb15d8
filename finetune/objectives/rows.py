"""Where an objective's rows come from when they are the datasets' samples (SFT, DPO, ORPO): read through the
data cache, and dealt to optimizer steps by the StepPlan. GRPO makes its rows from rollouts instead
(objectives/grpo.py, finetune/rl/sources.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from finetune import dist
from finetune.data import DataStats, StepPlan
from finetune.data.cache import Prepared, prepare
from finetune.objectives.base import Planning
from finetune.recipe import Recipe


class DatasetRows:
    """The samples and the step plan of an objective that trains on the datasets' samples."""

    def samples(self, recipe: Recipe, tokenizer: Any, world: dist.World, say: Callable[[str], Any]) -> Prepared:
        """The samples from the data cache (rank 0 first under torchrun), and what was read, cut or skipped."""
        with dist.main_first(world, "rank 0 to preprocess the data"):
            prepared = prepare(recipe, tokenizer)
        say(prepared.note)  # reused the preprocessed-data cache, or wrote it
        if not recipe.data.streaming:  # a stream's samples are counted as they come (the metrics), not ahead
            say(data_summary(prepared.train_stats, len(prepared.evals)))
        for example in prepared.train_stats.bad_row_examples:  # the first few, so a user can see which rows and why
            say(f"  skipped: {example}")
        for example in prepared.train_stats.dropped_examples:  # and which samples were too long
            say(f"  dropped: {example}")
        return prepared

    def plan(self, planning: Planning) -> StepPlan:
        """Each step the next global batch of the epoch's rows (finetune/data/batching.py)."""
        return StepPlan(planning.train, planning.recipe, planning.world_size)


def data_summary(stats: DataStats, n_eval: int) -> str:
    """The data line of the run log: samples, tokens, target tokens, eval samples, and what was cut or skipped."""
    line = (f"data: {stats.samples} samples, {stats.tokens} tokens, {stats.target_tokens} target tokens; "
            f"{n_eval} eval samples")
    if stats.truncated or stats.dropped_too_long:
        line += f"; {stats.truncated} truncated, {stats.dropped_too_long} dropped (too long)"
    if stats.bad_rows_skipped:
        line += f"; {stats.bad_rows_skipped} bad rows skipped"
    if stats.duplicates_dropped:
        line += f"; {stats.duplicates_dropped} duplicate rows dropped (data.deduplicate)"
    return line
