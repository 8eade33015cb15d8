"""The step plan: which rows each optimizer step takes, for any world size, with and without drop_last, over
several epochs. Pure data: no model."""

from __future__ import annotations

import pytest
from conftest import tiny_recipe

from finetune.data import StepPlan, epoch_rows, rank_micro_batches
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.recipe import validate


def _samples(n: int) -> list[dict]:
    # Distinct lengths 3..n+2, so every row is recognisable by its first token.
    return [{"input_ids": [i] * (3 + i % 7), "labels": [i] * (3 + i % 7)} for i in range(n)]


def _recipe(tmp_path, *, micro=2, accum=3, epochs=1, max_steps=None, drop_last=False, packing=False):
    raw = tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl")
    raw["data"].update(packing=packing, drop_last=drop_last, shuffle=True)
    raw["train"].update(micro_batch_size=micro, gradient_accumulation_steps=accum, epochs=epochs,
                        max_steps=max_steps)
    return validate(raw)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_step_takes_global_batch_rows_of_its_epoch_in_order(tmp_path, world, drop_last):
    recipe = _recipe(tmp_path, epochs=2, drop_last=drop_last)
    samples = _samples(20)  # 20 rows per epoch; global batch 2 x 3 x world
    plan = StepPlan(samples, recipe, world)
    batch = 6 * world
    assert plan.global_batch == batch
    full, rest = divmod(20, batch)
    per_epoch = full + (0 if drop_last or not rest else 1)
    assert plan.total == 2 * per_epoch
    for epoch in range(2):
        rows = epoch_rows(samples, recipe.data, recipe.seed, epoch)
        taken = []
        for s in range(per_epoch):
            got_epoch, step_rows = plan.step(epoch * per_epoch + s)
            assert got_epoch == epoch
            assert step_rows == rows[s * batch:(s + 1) * batch]
            taken += step_rows
        # Every row once per epoch; drop_last leaves out exactly the short tail.
        assert taken == (rows[:full * batch] if drop_last else rows)
    first, second = epoch_rows(samples, recipe.data, recipe.seed, 0), epoch_rows(samples, recipe.data, recipe.seed, 1)
    assert first != second and sorted(map(str, first)) == sorted(map(str, second))  # reshuffled, same rows


def test_the_rows_of_a_step_do_not_depend_on_the_world_size(tmp_path):
    recipe = _recipe(tmp_path, micro=1, accum=4)
    samples = _samples(16)
    one = StepPlan(samples, recipe, 1)
    two = _recipe(tmp_path, micro=1, accum=2)  # 1 x 2 x 2 ranks: the same global batch of 4 rows
    assert [one.step(s) for s in range(one.total)] == [StepPlan(samples, two, 2).step(s) for s in range(one.total)]


def test_max_steps_caps_and_epochs_null_runs_on(tmp_path):
    samples = _samples(12)
    assert StepPlan(samples, _recipe(tmp_path, micro=2, accum=1, epochs=3, max_steps=5), 1).total == 5
    endless = StepPlan(samples, _recipe(tmp_path, micro=2, accum=1, epochs=None, max_steps=20), 1)
    assert endless.total == 20
    assert endless.step(6) == (1, endless.rows_of_epoch(1)[0:2])  # 6 steps per epoch: step 6 opens epoch 1
    assert endless.step(19)[0] == 3


def test_an_epoch_too_small_for_one_step_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="one optimizer step needs 12 rows but an epoch has only 5"):
        StepPlan(_samples(5), _recipe(tmp_path, micro=4, accum=3, drop_last=True), 1)
    assert StepPlan(_samples(5), _recipe(tmp_path, micro=4, accum=3), 1).total == 1  # a short step runs


def test_packed_plans_count_packed_rows(tmp_path):
    recipe = _recipe(tmp_path, micro=1, accum=2, packing=True)
    samples = _samples(30)
    rows = epoch_rows(samples, recipe.data, recipe.seed, 0)
    assert len(rows) < 30  # several samples per row
    assert StepPlan(samples, recipe, 1).total == -(-len(rows) // 2)


def test_short_step_gives_fillers_that_train_nothing():
    rows = _samples(5)
    dealt = [rank_micro_batches(rows, 2, world_size=2, rank=r) for r in (0, 1)]
    assert [len(m) for m in dealt] == [2, 2]  # 3 micro-batches for 2 ranks: rank 1 gets a filler
    filler = dealt[1][1]
    assert filler[0]["filler"] and set(filler[0]["labels"]) == {IGNORE_INDEX}
    # Micro-batches [0, 1], [2, 3], [4] dealt round-robin: every real row exactly once.
    assert dealt[0] == [rows[0:2], rows[4:5]] and dealt[1][0] == rows[2:4]
