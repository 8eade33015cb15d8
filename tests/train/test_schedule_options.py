"""Recipe options that shape a run without changing its math: warmup as a ratio, evals and checkpoints per
fraction of an epoch, and training only some parameters (train.trainable_parameters)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_recipe
from helpers import QUICKSTART, TINY, eval_lines, final_weights, run_cli, train_lines

from finetune.data import StepPlan
from finetune.errors import UserError
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import TrainConfig, validate
from finetune.run.directory import read_recipe
from finetune.train.optim import lr_factor, warmup_steps


@pytest.mark.parametrize(("ratio", "total", "expected"), [(0.1, 100, 10), (0.1, 9, 0), (0.03, 250, 7),
                                                          (0.5, 7, 3), (0.0, 50, 0)])
def test_warmup_ratio_is_int_of_ratio_times_total_steps(ratio, total, expected):
    cfg = TrainConfig(lr=1.0, warmup_ratio=ratio, lr_scheduler="constant")
    assert warmup_steps(cfg, total) == expected
    steps = TrainConfig(lr=1.0, warmup_steps=expected, lr_scheduler="constant")
    assert [lr_factor(s, total, cfg) for s in range(total)] == [lr_factor(s, total, steps) for s in range(total)]


def test_schedule_options_are_checked(tmp_path):
    raw = tiny_recipe(tmp_path / "run", tmp_path / "d.jsonl")
    for extra, message in (({"train": {**raw["train"], "warmup_ratio": 0.1, "warmup_steps": 3}}, "not both"),
                           ({"eval": {"every_steps": 2, "every_epochs": 0.5}}, "eval.every_steps / eval.every_epochs"),
                           ({"checkpoint": {"every_steps": 2, "every_epochs": 1}}, "checkpoint.every_steps"),
                           ({"train": {**raw["train"], "warmup_ratio": 1.5}}, "train.warmup_ratio"),
                           ({"train": {**raw["train"], "trainable_parameters": ["model.(layers"]}},
                            "is not a regular expression"),
                           ({"train": {**raw["train"], "trainable_parameters": ["lm_head"]},
                             "adapter": {"type": "lora"}}, "only for full fine-tuning")):
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
            validate({**raw, **extra})


@pytest.mark.parametrize(("fraction", "expected"), [(0.5, 4), (0.25, 2), (1, 8), (2, 16), (0.1, 1), (0.3, 3)])
def test_every_epochs_resolves_against_the_first_epochs_steps(tmp_path, fraction, expected):
    raw = tiny_recipe(tmp_path / "run", tmp_path / "d.jsonl")
    raw["data"]["packing"] = False
    raw["train"].update(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=None, epochs=2)
    samples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 16  # 8 steps per epoch
    plan = StepPlan(samples, validate(raw), 1)
    assert plan.steps_in_epoch(0) == 8
    assert plan.cadence(None, fraction) == expected
    assert plan.cadence(5, None) == 5 and plan.cadence(None, None) is None


def test_evals_and_checkpoints_land_on_fractions_of_an_epoch(tmp_path):
    out = tmp_path / "run"
    # 48 samples, 2 x 3 = 6 rows per step, no packing: 8 steps per epoch, 16 in two epochs.
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "data.packing=false", "datasets.0.max_rows=48",
                "eval_datasets.0.max_rows=4", "train.max_steps=null", "train.epochs=2", "train.micro_batch_size=2",
                "train.gradient_accumulation_steps=3", "eval.every_epochs=0.5", "eval.at_start=true",
                "checkpoint.every_epochs=0.75", "checkpoint.keep_last=10", "train.warmup_steps=0",
                "train.warmup_ratio=0.25")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["step"] for e in eval_lines(out)] == [0, 4, 8, 12, 16]
    assert sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir()) == [6, 12]
    lrs = [line["lr"] for line in train_lines(out)]
    peak = 5.0e-3  # the quickstart's lr; int(0.25 x 16) = 4 warmup steps
    assert lrs[:4] == pytest.approx([peak * k / 4 for k in (1, 2, 3, 4)])


def test_trainable_parameters_freeze_everything_else(tmp_path):
    recipe = validate(tiny_recipe(tmp_path, tmp_path / "d.jsonl"))
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    model = load_model(recipe.model, recipe.adapter, tokenizer, 0, trainable=[r"model\.layers\.1\.", "lm_head"])
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("model.layers.1.") or n == "model.embed_tokens.weight" for n in trained)
    assert "model.embed_tokens.weight" in trained  # tied: lm_head.weight is the same tensor
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.layers.0."))
    with pytest.raises(UserError, match=r"'model\\\\.blocks' match no parameter.*model\.embed_tokens\.weight"):
        load_model(recipe.model, recipe.adapter, tokenizer, 0, trainable=[r"model\.blocks", "lm_head"])


def test_a_run_with_trainable_parameters_changes_only_those(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "train.max_steps=2", "data.packing_check=false",
                "train.trainable_parameters=['model\\.layers\\.0\\.mlp\\.']")
    assert r.returncode == 0, r.stderr[-3000:]
    recipe = read_recipe(out)
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    initial = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed).state_dict()
    final = final_weights(out)
    changed = {n for n, w in final.items() if not torch.equal(w, initial[n])}
    assert changed and all(n.startswith("model.layers.0.mlp.") for n in changed), changed
