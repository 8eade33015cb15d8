"""Runs that survive: exact resume, SIGKILL at random moments, broken checkpoints skipped, resume refused when
the recipe changed the training, and a run whose weights do not move made visible."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    QUICKSTART,
    ROOT,
    TEST_ENV,
    TINY,
    final_weights,
    run_cli,
    train_lines,
)
from safetensors.torch import load_file, save_file

from finetune.run import checkpoint

RUN = [*TINY, "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=2"]


def _assert_bitwise(a, b) -> None:
    la, lb = train_lines(a), train_lines(b)
    assert [(x["step"], x["loss"], x["grad_norm"]) for x in la] == [(x["step"], x["loss"], x["grad_norm"]) for x in lb]
    assert [x["tokens_seen"] for x in la] == [x["tokens_seen"] for x in lb]
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_resume_is_bitwise_identical(tmp_path, packing, adapter):
    """6 steps straight vs the same run stopped after its step-3 checkpoint and resumed to 6."""
    extra = [f"data.packing={packing}", f"adapter.type={adapter}", "model.config.attention_dropout=0.1"]
    straight = tmp_path / "straight"
    r = run_cli("train", str(QUICKSTART), f"output_dir={straight}", *RUN, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    # Make `resumed` what a run stopped right after step 3 would have left.
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    r = run_cli("train", str(QUICKSTART), f"output_dir={resumed}", *RUN, *extra, "resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step-3" in r.stdout
    _assert_bitwise(straight, resumed)


def test_sigkill_at_random_moments_then_resume_matches(tmp_path):
    """Kill -9 the run at random moments (during steps and checkpoint writes), resume: auto each time; the
    result equals the uninterrupted run, bit for bit. Each kill moment is drawn from the run's own progress
    (1 to 3 new metrics lines, then up to 0.05 s more: a step with its checkpoint takes ~0.05 s), not from
    wall-clock time alone, so that a fast machine cannot finish the run before the kill: every kill lands in
    the loop or in a checkpoint write."""
    args = [*TINY, "train.max_steps=20", "checkpoint.every_steps=1", "checkpoint.keep_last=2"]
    straight = tmp_path / "straight"
    assert run_cli("train", str(QUICKSTART), f"output_dir={straight}", *args).returncode == 0
    killed = tmp_path / "killed"
    metrics = killed / "metrics.jsonl"
    rng = random.Random(1234)
    kills, kills_after_a_checkpoint = 0, 0
    for attempt in range(5):
        cmd = [sys.executable, "-m", "finetune", "train", str(QUICKSTART), f"output_dir={killed}", *args,
               "resume=auto"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=TEST_ENV)
        if attempt < 4:  # four kills at random moments, then let it finish
            # At least 2 new lines the first time, so that a checkpoint exists before the first kill.
            wanted = _line_count(metrics) + rng.randint(2 if attempt == 0 else 1, 3)
            while proc.poll() is None and _line_count(metrics) < wanted:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.05))
            if proc.poll() is None:
                had_checkpoint = bool(checkpoint.complete_checkpoints(killed / "checkpoints"))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                kills_after_a_checkpoint += had_checkpoint
                continue
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
        break
    assert kills == 4 and kills_after_a_checkpoint >= 1, (kills, kills_after_a_checkpoint)
    _assert_bitwise(straight, killed)


def test_sigterm_ends_the_run_after_its_step_with_a_checkpoint_and_resume_continues(tmp_path):
    """SIGTERM (a preempted spot instance, Kubernetes, Slurm, torchrun passing its own on) ends the run after the
    step under way: that step's metrics line, a checkpoint of it (the recipe asked for none), exit 143 with a line
    saying where. resume: auto then runs the rest, every step logged once. (That a resume from any step's checkpoint
    ends bit for bit where the uninterrupted run does: test_sigkill_at_random_moments_then_resume_matches.)"""
    args = [*TINY, "train.max_steps=30"]
    stopped = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "finetune", "train", str(QUICKSTART), f"output_dir={stopped}", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=TEST_ENV)
    while proc.poll() is None and _line_count(stopped / "metrics.jsonl") < 3:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    steps = [r["step"] for r in train_lines(stopped)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 30, steps
    assert f"stopped on SIGTERM after step {last} of 30: {stopped / 'checkpoints' / f'step-{last}'}" in err
    assert "Traceback" not in err and not (stopped / "final").exists()
    assert [p.name for p in checkpoint.complete_checkpoints(stopped / "checkpoints")] == [f"step-{last}"]
    done = run_cli("train", str(QUICKSTART), f"output_dir={stopped}", *args, "resume=auto")
    assert done.returncode == 0 and f"resumed from {stopped / 'checkpoints' / f'step-{last}'}" in done.stdout
    assert [r["step"] for r in train_lines(stopped)] == list(range(1, 31)) and (stopped / "final").is_dir()


def _line_count(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_broken_checkpoints_are_skipped(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    root = out / "checkpoints"
    good = root / "step-6"
    # A half-written one (no marker), and a complete-looking one whose weights are truncated.
    shutil.copytree(good, root / "step-9")
    (root / "step-9" / checkpoint.MARKER).unlink()
    shutil.copytree(good, root / "step-8")
    data = (root / "step-8" / "model.safetensors").read_bytes()
    (root / "step-8" / "model.safetensors").write_bytes(data[: len(data) // 2])
    messages: list[str] = []
    assert checkpoint.find_latest(out, warn=messages.append) == good
    assert len(messages) == 1 and "step-8" in messages[0] and "unreadable" in messages[0]


def test_resume_refuses_changed_training_but_allows_harmless_changes(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", str(QUICKSTART), f"output_dir={out}", *RUN).returncode == 0
    shutil.rmtree(out / "final")
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *RUN, "resume=auto", "train.lr=1e-2",
                "data.max_seq_len=128")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "resume refused" in r.stderr and "train.lr" in r.stderr and "data.max_seq_len" in r.stderr
    # Same global batch split differently, and a different logging cadence: the same training.
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *RUN, "resume=auto", "train.micro_batch_size=2",
                "train.gradient_accumulation_steps=4", "logging.every_steps=5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout


def test_resume_follows_moved_data_by_content_and_refuses_changed_content(tmp_path):
    """The checkout (data, tokenizer) moves to another directory between the checkpoint and the resume, as on
    another machine, and the eval set changes: the resume continues, bit for bit. Changed data content at the
    same path is refused."""
    examples = QUICKSTART.parent.parent
    here, there = tmp_path / "here", tmp_path / "there"
    for root in (here, there):
        shutil.copytree(examples / "data", root / "data")
        shutil.copytree(examples / "tokenizer", root / "tokenizer")

    def at(root):
        return [f"datasets.0.path={root / 'data' / 'quickstart_train.jsonl'}", f"tokenizer.path={root / 'tokenizer'}"]

    straight = tmp_path / "straight"
    assert run_cli("train", str(QUICKSTART), f"output_dir={straight}", *RUN, *at(here)).returncode == 0
    moved = tmp_path / "moved"
    shutil.copytree(straight, moved)
    shutil.rmtree(moved / "final")
    shutil.rmtree(moved / "checkpoints" / "step-6")
    shutil.rmtree(here)
    r = run_cli("train", str(QUICKSTART), f"output_dir={moved}", *RUN, *at(there), "resume=auto",
                "eval_datasets.0.max_rows=50")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    _assert_bitwise(straight, moved)

    shutil.rmtree(moved / "final")
    train_file = there / "data" / "quickstart_train.jsonl"
    train_file.write_text(train_file.read_text().replace("What is", "What's", 1))
    r = run_cli("train", str(QUICKSTART), f"output_dir={moved}", *RUN, *at(there), "resume=auto")
    assert r.returncode == 2 and "resume refused" in r.stderr and "content" in r.stderr, r.stderr[-3000:]


def test_weights_that_do_not_move_are_reported(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "train.max_steps=2", "train.lr=1e-30",
                "train.warmup_steps=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the trainable weights did not change" in r.stdout
    assert all(line["update_ratio"] == 0.0 for line in train_lines(out))


def test_metrics_after_resume_have_no_duplicate_steps(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", str(QUICKSTART), f"output_dir={out}", *RUN).returncode == 0
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-6")
    assert run_cli("train", str(QUICKSTART), f"output_dir={out}", *RUN, "resume=auto").returncode == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2, 3, 4, 5, 6]



def test_non_finite_steps_are_skipped_then_the_run_aborts(tmp_path):
    """lr 1e30: step 1 is finite and its update blows the weights up, so every later step overflows to a
    non-finite loss: each is skipped (no update) and counted, and train.max_bad_steps consecutive ones stop
    the run with exit 2 and a clear message."""
    out = tmp_path / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "train.max_steps=10", "train.lr=1e30",
                "train.warmup_steps=0", "train.max_grad_norm=null", "data.packing=false", "train.max_bad_steps=2")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "consecutive steps with a non-finite loss or gradient" in r.stderr and "Traceback" not in r.stderr
    lines = train_lines(out)
    assert [x["skipped"] for x in lines] == [False, True, True]
    assert all(x["update_ratio"] == 0.0 for x in lines[1:])


def test_no_trainable_parameters_refuses_to_start(tmp_path):
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *TINY, "train.max_steps=1",
                "adapter.type=lora", "adapter.target_modules=[no_such_module]")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "adapter.target_modules" in r.stderr


def test_failed_checkpoint_write_keeps_the_last_checkpoint(tmp_path):
    """A checkpoint write that fails (here: its temporary directory cannot be created) raises a UserError that
    says the previous checkpoints are intact, and they are: find_latest still returns the last good one."""
    from finetune.errors import UserError

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"step": 3, "tokens_seen": 0}
    good = checkpoint.save(tmp_path, 3, model, optimizer, scheduler, state, keep_last=2)
    (tmp_path / "checkpoints" / ".tmp-step-6").write_text("a file where the temporary directory must go")
    with pytest.raises(UserError, match="previous checkpoints are intact"):
        checkpoint.save(tmp_path, 6, model, optimizer, scheduler, {**state, "step": 6}, keep_last=2)
    assert checkpoint.find_latest(tmp_path) == good
    assert not (tmp_path / "checkpoints" / "step-6").exists()


def test_a_resume_refuses_an_adapter_base_whose_weights_changed(tmp_path):
    """LoRA checkpoints hold the adapter only, so a resume loads the base from model.path again: its weights are
    recorded by content (model/digest.py). One base weight changed there between the run and its resume -> exit 2
    naming model.path, nothing trained (the adapter would go on over other weights). The original base moved to
    another model.path: the resume goes on from there (config, frozen weights and tokenizer are the run's)."""
    from finetune.model.loading import load_model
    from finetune.model.tokenizer import load_tokenizer
    from finetune.recipe import AdapterConfig, load_recipe

    recipe = load_recipe(QUICKSTART, TINY)
    base = tmp_path / "base"
    load_model(recipe.model, AdapterConfig(), load_tokenizer(recipe.tokenizer, recipe.model), 7, "cpu").save_pretrained(base)
    run = tmp_path / "run"
    args = ["train", str(QUICKSTART), *TINY, f"model.path={base}", "model.init=pretrained", "model.config=null",
            "adapter.type=lora", "train.max_steps=2", "checkpoint.every_steps=1", f"output_dir={run}"]
    done = run_cli(*args, "train.max_steps=1")
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((run / "checkpoints" / "step-1" / "trainer_state.json").read_text())
    assert len(state["frozen_digest"]) == 64
    shutil.rmtree(run / "final")
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    file = base / "model.safetensors"
    weights = load_file(str(file))
    weights[sorted(weights)[0]].view(-1)[0] += 1e-3
    save_file(weights, str(file), metadata={"format": "pt"})
    done = run_cli(*args, "resume=auto")
    assert done.returncode == 2 and f"the frozen weights loaded from model.path {base}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (run / "checkpoints" / "step-2").exists()
    done = run_cli(*args, "train.max_steps=1", f"model.path={moved}", "resume=auto")
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-3000:]
    assert (run / "final" / "adapter_model.safetensors").is_file()
