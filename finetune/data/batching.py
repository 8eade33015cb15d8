"""Rows to optimizer steps: each epoch's rows, which rows each step takes, and each rank's micro-batches of them.

One optimizer step consumes `micro_batch_size x gradient_accumulation_steps x world_size` rows (a row is a
padded sample, or a packed row of up to max_seq_len tokens). The rows of step s are the same for every world
size: ranks only split them. That is what makes a run on 1 process and on N the same training.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from finetune.data.pack import PackPlan, checked_lengths, packed_row, plan_packing
from finetune.data.store import pair_flags
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.recipe import DataConfig, Recipe


class StepPlan:
    """Which rows each global optimizer step uses, worked out lazily one epoch at a time.

    Step s of an epoch takes rows [s * global_batch, (s + 1) * global_batch) of that epoch's rows, the same
    for every world size. Epochs are (re)packed only when reached, so `epochs: null` with a large max_steps
    costs nothing up front. An epoch is held as sample indices (EpochRows); a step's rows are read from the
    samples (the token store's memory maps) when the step is.
    """

    def __init__(self, samples: Sequence[dict], recipe: Recipe, world_size: int) -> None:
        t = recipe.train
        self.samples, self.recipe = samples, recipe
        self.global_batch = t.micro_batch_size * t.gradient_accumulation_steps * world_size
        self._steps_per_epoch: list[int] = []
        self._rows: tuple[int, EpochRows] | None = None  # (epoch, rows): the current epoch only
        if t.epochs is not None:
            total = sum(self.steps_in_epoch(e) for e in range(t.epochs))
            self.total = min(total, t.max_steps) if t.max_steps else total
        else:
            self.steps_in_epoch(0)  # fail early if one epoch cannot fill a step
            self.total = t.max_steps

    def rows_of_epoch(self, epoch: int) -> EpochRows:
        if self._rows is None or self._rows[0] != epoch:
            self._rows = (epoch, epoch_plan(self.samples, self.recipe.data, self.recipe.seed, epoch))
        return self._rows[1]

    def steps_in_epoch(self, epoch: int) -> int:
        while len(self._steps_per_epoch) <= epoch:
            e = len(self._steps_per_epoch)
            n_rows = len(self.rows_of_epoch(e))
            n_steps = steps_in(n_rows, self.global_batch, self.recipe.data.drop_last)
            if n_steps == 0:
                raise UserError(f"one optimizer step needs {self.global_batch} rows but an epoch has only {n_rows} "
                                "(data.drop_last: true drops them all); lower train.micro_batch_size or "
                                "gradient_accumulation_steps, or set data.drop_last: false")
            self._steps_per_epoch.append(n_steps)
        return self._steps_per_epoch[epoch]

    def cadence(self, every_steps: int | None, every_epochs: float | None) -> int | None:
        """Every how many optimizer steps something recurs (an eval, a checkpoint): every_steps, or a fraction of
        an epoch resolved against the first epoch's steps (at least 1); None: never."""
        if every_epochs is None:
            return every_steps
        # The tolerance keeps float noise from rounding up: 0.1 epochs of 30 steps is every 3 steps, not 4.
        return max(1, math.ceil(every_epochs * self.steps_in_epoch(0) - 1e-9))

    prefetch = True  # the next step's rows do not depend on this step's update
    evaluator = None  # eval is the objective's loss on the eval samples (train/evaluate.py)
    note = ""

    def info(self, step: int) -> dict[str, float]:
        """Figures of the step's data for its metrics line (none for rows read from datasets)."""
        return {}

    def step(self, step: int) -> tuple[int, list[dict]]:
        """(epoch, rows) of global optimizer step `step` (0-based)."""
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        rows = self.rows_of_epoch(epoch)
        return epoch, rows[step * self.global_batch: (step + 1) * self.global_batch]


class EpochRows(Sequence):
    """One epoch's rows in training order, as sample indices: packed rows (a PackPlan) or the samples in a
    shuffled order. A row is read from the samples when it is indexed (a slice gives a list)."""

    def __init__(self, samples: Sequence[dict], plan: PackPlan | None, order: list[int] | None) -> None:
        self.samples, self.plan, self.order = samples, plan, order

    def __len__(self) -> int:
        return len(self.plan) if self.plan is not None else len(self.order or ())

    def _row(self, r: int) -> dict:
        if self.plan is not None:
            return packed_row(self.samples, self.plan.row(r), self.plan.max_seq_len)
        return self.samples[self.order[r]]  # type: ignore[index]

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._row(r) for r in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._row(index)


def epoch_plan(samples: Sequence[dict], data: DataConfig, seed: int, epoch: int) -> EpochRows:
    """The rows of one epoch, in training order, as indices: packed rows (repacked per epoch, from the samples'
    lengths) or shuffled samples."""
    if data.packing:
        plan = plan_packing(checked_lengths(samples), pair_flags(samples), data.max_seq_len, seed=seed,
                            epoch=epoch, truncation=data.truncation)
        return EpochRows(samples, plan, None)  # the plan already orders rows by a (seed, epoch) shuffle
    return EpochRows(samples, None, epoch_order(len(samples), data, seed, epoch))


def epoch_order(n: int, data: DataConfig, seed: int, epoch: int) -> list[int]:
    """The order of n unpacked samples in an epoch: shuffled per (seed, epoch) unless data.shuffle is off."""
    order = list(range(n))
    if data.shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def epoch_rows(samples: Sequence[dict], data: DataConfig, seed: int, epoch: int) -> list[dict]:
    """The rows of one epoch, in training order, all read: packed rows (repacked per epoch) or shuffled samples."""
    return epoch_plan(samples, data, seed, epoch)[:]


def steps_in(n_rows: int, global_batch: int, drop_last: bool) -> int:
    """Optimizer steps an epoch of n_rows yields: a short last step runs unless drop_last."""
    return n_rows // global_batch if drop_last else -(-n_rows // global_batch)


def rank_micro_batches(step_rows: Sequence[dict], micro_batch_size: int, world_size: int, rank: int,
                       group_by_length: bool = False) -> list[list[dict]]:
    """This rank's micro-batches of one step's rows.

    The step's rows are cut into micro-batches of `micro_batch_size` in order and dealt round-robin to ranks.
    A rank left with fewer micro-batches than rank 0 (a short last step) gets filler micro-batches: a copy of
    a row with every label ignored, so every rank runs the same number of forward/backward passes (no
    distributed hang) while adding exactly nothing to the loss or the gradient.
    """
    rows = list(step_rows)
    if group_by_length:
        # Within the step only, so the step's set of rows (and its gradient) is unchanged.
        rows.sort(key=lambda r: len(r["input_ids"]), reverse=True)
    chunks = [rows[i: i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
    per_rank = -(-len(chunks) // world_size)
    mine = chunks[rank::world_size]
    if len(mine) == per_rank:
        return mine
    filler = [{**rows[0], "labels": [IGNORE_INDEX] * len(rows[0]["labels"]), "filler": True}]
    return mine + [filler] * (per_rank - len(mine))



def eval_rows(samples: Sequence[dict], data: DataConfig) -> list[dict]:
    """The eval samples' rows in a fixed order (packed as epoch 0 when packing is on)."""
    return epoch_rows(samples, data, seed=0, epoch=0) if data.packing else list(samples)
