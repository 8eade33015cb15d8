"""Distillation (train.objective: distill; finetune/objectives/distill.py): the loss contract (verify on the first
step; 8x1 = 1x8 = 2x4 in weights, with a short last step), the teacher frozen and unchanged, its tokenizer and
vocabulary checked, and the step's metrics. The fused divergence itself: tests/loss/test_distill.py."""

from __future__ import annotations

import pytest
import torch
from helpers import QUICKSTART, TINY, final_weights, rel_diff, run_cli, teacher_dir, train_lines


def distill_args(teacher, *extra: str) -> list[str]:
    return [*TINY, "train.objective=distill", f"distill.teacher={teacher}", "datasets.0.max_rows=40",
            "train.max_steps=null", "train.epochs=1", "train.warmup_steps=0", *extra]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return teacher_dir(tmp_path_factory.mktemp("teacher"))


@pytest.mark.parametrize("beta", [0.5])  # every beta's gradient: tests/loss/test_distill.py
def test_verify_passes_on_a_distill_recipe_and_the_naive_mean_does_not(teacher, beta):
    from finetune.commands.verify import verify
    from finetune.recipe import load_recipe

    recipe = load_recipe(QUICKSTART, distill_args(teacher, f"distill.beta={beta}", "distill.temperature=2",
                                                  "train.micro_batch_size=2", "train.gradient_accumulation_steps=4"))
    result = verify(recipe, world_size=2)
    assert result.passed and result.tolerance == 1e-5, result.groups
    assert result.naive_max > 1e-3, result.groups  # packed rows hold other numbers of targets: per-micro-batch means differ


def test_splits_train_the_same_weights_and_the_teacher_is_untouched(tmp_path, teacher):
    """40 rows packed into rows of 256, in steps of 8 rows: the last step short. 8 x 1, 1 x 8 and 2 x 4 give the
    same weights, each tensor within 1e-5; the teacher's files are as they were."""
    before = final_weights_of(teacher)
    weights = []
    for micro, accum in ((8, 1), (1, 8), (2, 4)):
        run = tmp_path / f"m{micro}"
        r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *distill_args(teacher, "distill.sft_weight=0.5"),
                    f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accum}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "distill teacher: " in r.stdout
        lines = train_lines(run)
        assert 0.0 <= lines[0]["agreement"] <= 1.0 and lines[0]["student_ce"] > 0 and lines[0]["loss"] > 0
        weights.append(final_weights(run))
    for name, ref in weights[0].items():
        assert rel_diff(weights[1][name], ref) < 1e-5 and rel_diff(weights[2][name], ref) < 1e-5, name
    after = final_weights_of(teacher)
    assert all(torch.equal(before[k], after[k]) for k in before)


def final_weights_of(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from transformers import AutoTokenizer

    other = teacher_dir(tmp_path / "t")
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(other)
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *distill_args(other))
    assert r.returncode == 2 and "its tokenizer differs from the student's" in r.stderr, r.stderr[-2000:]


def test_a_larger_teacher_vocabulary_is_distilled_over_the_shared_ids_and_its_outside_mass_logged(tmp_path):
    wide = teacher_dir(tmp_path / "t", vocab=1100)
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *distill_args(wide),
                "train.micro_batch_size=8", "train.gradient_accumulation_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "76 ids beyond the student's" in r.stdout
    assert 0.0 < train_lines(tmp_path / "run")[0]["teacher_outside"] < 1.0


def test_a_teacher_without_a_row_for_every_id_is_refused(tmp_path):
    """Loading would add random rows for the ids it lacks (the tokenizer's 1024, the teacher's 1000)."""
    small = teacher_dir(tmp_path / "t", vocab=1000)
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *distill_args(small))
    assert r.returncode == 2 and "its vocabulary has 1000 ids and the tokenizer 1024" in r.stderr, r.stderr[-2000:]


def test_a_4bit_teacher_distills_close_to_the_full_precision_one(tmp_path):
    """distill.teacher_4bit: the teacher's linear layers in NF4 (bitsandbytes on the CPU; its kernel wants widths in
    blocks of 32: hidden 64); one step's loss within 5% of the full-precision teacher's (NF4 rounds each weight to
    one of 16 levels), the teacher's log line says so."""
    teacher = teacher_dir(tmp_path / "teacher", hidden=64)
    losses = []
    for four_bit in ("false", "true"):
        run = tmp_path / four_bit
        args = distill_args(teacher, "train.max_steps=1", "eval_datasets.0.max_rows=8",
                            f"distill.teacher_4bit={four_bit}")
        r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *args)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("linear layers in 4-bit NF4" in r.stdout) == (four_bit == "true")
        losses.append(train_lines(run)[0]["loss"])
    assert losses[0] != losses[1] and abs(losses[1] - losses[0]) <= 0.05 * losses[0], losses


def test_a_teacher_that_does_not_fit_is_refused_before_loading(teacher):
    from finetune.errors import UserError
    from finetune.objectives.distill import check_fits

    cpu = torch.device("cpu")
    check_fits(str(teacher), "float32", False, cpu, free=1 << 30)  # ~0.1M weights: fits in a GiB
    with pytest.raises(UserError, match=r"weights take about 0\.0 GiB in float32, and the cpu has 0\.0 GiB free: use a "
                                        r"smaller teacher, distill.teacher_4bit: true"):
        check_fits(str(teacher), "float32", False, cpu, free=1000)
    check_fits(str(teacher), "float32", True, cpu, free=200_000)  # in 4-bit it does
