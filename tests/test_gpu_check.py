"""`make test-gpu` (scripts/test_gpu.py) and benchmarks/gpu_throughput.py, as far as a CPU can check them: without
CUDA they say so and exit non-zero (never a pretended pass), their run checks judge metrics.jsonl correctly, and the
benchmark's recipe overrides make a valid recipe."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import QUICKSTART, ROOT, TEST_ENV, run_cli

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


test_gpu = _load(ROOT / "scripts" / "test_gpu.py")
gpu_throughput = _load(ROOT / "benchmarks" / "gpu_throughput.py")


@no_cuda
@pytest.mark.parametrize("script", ["scripts/test_gpu.py", "benchmarks/gpu_throughput.py"])
def test_without_cuda_nothing_is_pretended(script):
    done = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, env=TEST_ENV,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no CUDA device here" in done.stdout and "PASS" not in done.stdout
    if script.startswith("scripts"):
        assert done.stdout.strip().splitlines()[-1].startswith("test-gpu: FAIL (")  # the one verdict, last


def _metrics(tmp_path: Path, losses: list[float], evals: tuple[float, float] = (7.0, 5.0)) -> Path:
    lines = [{"step": 0, "eval_loss": evals[0], "eval_tokens": 10}]
    lines += [{"step": i + 1, "loss": x, "tokens_per_s": 100.0 * (i + 1), "padded_tokens_per_s": 200.0,
               "mfu": None, "peak_memory_mb": 5.0} for i, x in enumerate(losses)]
    lines += [{"step": len(losses), "eval_loss": evals[1], "eval_tokens": 10}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return tmp_path


def test_check_run_judges_the_loss(tmp_path):
    stdout = "model: ...; device: cuda:0; world size 1"
    falling = [7.0 - 0.1 * i for i in range(20)]
    assert test_gpu.check_run(_metrics(tmp_path, falling), stdout)[0]
    assert not test_gpu.check_run(_metrics(tmp_path, falling), stdout.replace("cuda:0", "cpu"))[0]
    assert not test_gpu.check_run(_metrics(tmp_path, falling[::-1]), stdout)[0]
    assert not test_gpu.check_run(_metrics(tmp_path, [*falling[:-1], float("nan")]), stdout)[0]
    assert not test_gpu.check_run(_metrics(tmp_path, falling, evals=(5.0, 6.0)), stdout)[0]
    assert not test_gpu.check_run(_metrics(tmp_path, falling[:5]), stdout)[0]


def test_unknown_stage_is_refused():
    with pytest.raises(SystemExit):
        test_gpu.main(["--only", "suite,nope"])


@pytest.mark.parametrize("stage", sorted(test_gpu.TRAIN_STAGES))
def test_each_cli_stage_runs_a_valid_recipe(tmp_path, stage):
    # A typo in a stage's overrides would be found only on a lent GPU machine, at the cost of a call.
    from finetune.recipe import load_recipe

    recipe = load_recipe(QUICKSTART, [f"output_dir={tmp_path}", *test_gpu.TRAIN_STAGES[stage], *test_gpu.RUN_ARGS])
    assert recipe.model.dtype == "bfloat16" and recipe.train.max_steps == 20


def test_benchmark_summary_skips_the_warmup(tmp_path):
    figures = gpu_throughput.summarize(_metrics(tmp_path, [3.0, 2.0, 1.5, 1.2, 1.1]) / "metrics.jsonl")
    assert figures["steps"] == 5 and figures["last_loss"] == 1.1
    assert figures["tokens_per_s"] == 400.0  # median of steps 3-5: 300, 400, 500
    assert figures["padded_tokens_per_s"] == 200.0 and figures["peak_memory_mb"] == 5.0


def test_benchmark_overrides_make_a_valid_recipe(tmp_path):
    model = tmp_path / "llama1b"
    model.mkdir()
    (model / "config.json").write_text("{}")
    done = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--print-overrides", "--model",
                           str(model)], cwd=ROOT, capture_output=True, text=True, env=TEST_ENV, timeout=60)
    assert done.returncode == 0, done.stderr
    r = run_cli("validate", str(QUICKSTART), *done.stdout.split())
    assert r.returncode == 0, r.stderr
    assert f"path: {model}" in r.stdout and "dtype: bfloat16" in r.stdout and "max_seq_len: 2048" in r.stdout


@pytest.mark.parametrize("row", ["lora8b", "qlora8b"])
def test_the_8b_adapter_rows_make_valid_recipes(tmp_path, row):
    """The 8B rows (--8b) are cut for a lent GPU's minutes: their recipes must validate here first."""
    model = tmp_path / "llama8b"
    model.mkdir()
    (model / "config.json").write_text("{}")
    a = gpu_throughput.parse(["--8b", "--rows", row])
    cmd, _ = gpu_throughput.row_command(row, a, str(model), gpu_throughput.QUICKSTART_DATA, str(tmp_path / "run"))
    r = run_cli("validate", *cmd[cmd.index("train") + 1:])
    assert r.returncode == 0, r.stderr
    assert "gradient_checkpointing: true" in r.stdout and f"type: {row.removesuffix('8b')}" in r.stdout


def test_the_device_session_script_names_stages_and_rows_that_exist():
    # scripts/gpu_session.sh runs on a lent GPU machine, where a renamed stage or row would cost a call's minutes.
    import re

    text = (ROOT / "scripts" / "gpu_session.sh").read_text()
    stages = re.search(r'\{STAGES:-([\w,]+)', text).group(1).split(",")
    rows = re.search(r'\{ROWS:-([\w,+-]+)', text).group(1).split(",")
    assert set(stages) <= set(test_gpu.STAGES) - {"suite", "bench"}, stages
    assert set(rows) <= set(gpu_throughput.ALL_ROWS), rows
    for script in ("scripts/gpu_session.sh", "scripts/prepare_gpu.sh"):
        done = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
