"""The step plan as the user configured it, checked against the data it met: batch geometry that runs, but not
as written, is said at start (the plan itself, finetune/data/batching.py, only refuses what cannot run)."""

from __future__ import annotations

from finetune.data import StepPlan


def step_larger_than_epoch(plan: StepPlan, world_size: int) -> str | None:
    """A warning when one optimizer step asks for more rows than an epoch has, else None.

    Such a run trains (each epoch is one short step of all its rows) but not with the accumulation the recipe
    names: `gradient_accumulation_steps: 1e9` would silently be one step per epoch.
    """
    rows = len(plan.rows_of_epoch(0))
    if plan.global_batch <= rows:
        return None
    t, packed = plan.recipe.train, plan.recipe.data.packing
    processes = f" x {world_size} processes" if world_size > 1 else ""
    fits = max(1, rows // (t.micro_batch_size * world_size))
    return (f"warning: one optimizer step takes {plan.global_batch} rows (train.micro_batch_size {t.micro_batch_size}"
            f" x gradient_accumulation_steps {t.gradient_accumulation_steps}{processes}) but an epoch has only "
            f"{rows}{' packed' if packed else ''} rows: each epoch is one step of {rows} rows. "
            f"gradient_accumulation_steps {fits} or less fills every step")
