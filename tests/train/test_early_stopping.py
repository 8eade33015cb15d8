"""eval.early_stopping_patience (train/early_stop.py): the run ends once that many evals in a row have not lowered the
best eval loss, as Hugging Face's EarlyStoppingCallback decides; the count survives a resume."""

from __future__ import annotations

import shutil

import pytest
from conftest import tiny_recipe
from helpers import QUICKSTART, TINY, eval_lines, run_cli, train_lines

from finetune.errors import UserError
from finetune.recipe import validate
from finetune.train.early_stop import EarlyStopping


def test_patience_counts_evals_without_a_new_best():
    early = EarlyStopping(2)
    # best 3.0, then 2.0 (a new best: the count restarts), 2.5 (1), 2.0 (equal is no better: 2, stop)
    assert [early.stops(s, loss) for s, loss in enumerate([3.0, 2.0, 2.5, 2.0], 1)] == [False, False, False, True]
    assert (early.best, early.best_step, early.since) == (2.0, 2, 2)
    assert "the best, 2, was at step 2" in early.message(4)
    assert not EarlyStopping(None).stops(1, 5.0) and EarlyStopping(None).state() is None
    again = EarlyStopping.resumed(2, {"early_stopping": early.state()})
    assert (again.best, again.best_step, again.since) == (2.0, 2, 2)


# A learning rate so small that no weight moves in float32: every eval loss equals the first, so none improves.
FROZEN = [*TINY, "train.max_steps=8", "train.lr=1e-30", "train.warmup_steps=0", "eval.every_steps=1",
          "eval.early_stopping_patience=2", "checkpoint.every_steps=1", "checkpoint.keep_last=8"]


def test_a_run_stops_early_and_a_resume_stops_at_the_same_step(tmp_path):
    straight = tmp_path / "straight"
    r = run_cli("train", str(QUICKSTART), f"output_dir={straight}", *FROZEN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "early stopping at step 3" in r.stdout
    assert [x["step"] for x in train_lines(straight)] == [1, 2, 3]
    assert [x["step"] for x in eval_lines(straight)] == [1, 2, 3]
    assert (straight / "final").is_dir()
    # Resumed from step 2's checkpoint, the run still stops at 3: the best and the count came with it (a fresh count
    # would take the eval at 3 as its first and stop at 5).
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "final")
    assert not (resumed / "checkpoints" / "step-3").exists()  # the run ended at 3 without a checkpoint there
    r = run_cli("train", str(QUICKSTART), f"output_dir={resumed}", *FROZEN, "resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step-2" in r.stdout and "early stopping at step 3" in r.stdout


def test_early_stopping_needs_evals_during_training(tmp_path):
    recipe = tiny_recipe(tmp_path)
    recipe["eval"]["early_stopping_patience"] = 3
    with pytest.raises(UserError, match="eval.early_stopping_patience: needs evals during training"):
        validate(recipe)
