"""`make test-gpu`: what a CUDA machine must pass, in stages, ending with one verdict line.

    python3 scripts/test_gpu.py [--only suite,lora,qlora,liger,compile,bench] [--out runs/test-gpu] [--pytest-args "..."]

Stages (all by default, in this order):
  suite  the whole test suite with the `gpu` tests (pytest -q; -n 8 when pytest-xdist is installed);
  lora   `finetune train` of the quickstart in bf16 with LoRA, 20 steps on the GPU: exit 0, finite and falling loss;
  qlora  the same with QLoRA (an NF4 base through bitsandbytes);
  liger  the LoRA run with model.liger_kernels: true (lora and qlora run with its default, auto: on with CUDA);
  compile  the quickstart in bf16, all weights, with train.compile: true;
  bench  benchmarks/gpu_throughput.py --smoke (the default recipe path on a 2-layer Llama-1B-shaped model).
Each stage's output goes to OUT/STAGE.log; its last lines are shown when it fails. The verdict is the last line:
`test-gpu: PASS (...)` with exit 0, or `test-gpu: FAIL (...)` with exit 1. Without CUDA nothing runs: the verdict
says so and the exit is 1 (these checks mean nothing on a CPU; `make test` is the CPU suite).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "yaml" / "quickstart.yaml"
STAGES = ("suite", "lora", "qlora", "liger", "compile", "bench")
# stage -> the recipe overrides of its CLI run, beside RUN_ARGS
TRAIN_STAGES = {"lora": ["adapter.type=lora"], "qlora": ["adapter.type=qlora"],
                "liger": ["adapter.type=lora", "model.liger_kernels=true"], "compile": ["train.compile=true"]}
RUN_ARGS = ["model.dtype=bfloat16", "train.max_steps=20", "train.lr=1e-2", "eval.every_steps=null",
            "eval.at_start=true", "logging.every_steps=5"]


def cuda_problem() -> str | None:
    """Why this machine cannot run the GPU checks, or None when it can."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import ({e})"
    if not torch.cuda.is_available():
        return f"no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda})"
    return None


def check_run(out: Path, stdout: str) -> tuple[bool, str]:
    """A finished CLI run on the GPU: finite losses, the mean of the last 5 below the first 5, eval loss down."""
    if "device: cuda" not in stdout:
        return False, "did not run on cuda (see the log's model: line)"
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return False, "no metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    losses = [r["loss"] for r in lines if "loss" in r]
    evals = [r["eval_loss"] for r in lines if "eval_loss" in r]
    if len(losses) < 10 or not all(math.isfinite(x) for x in losses):
        return False, f"{len(losses)} steps, losses {losses[:3]}...: want >= 10 finite"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    if not last < first:
        return False, f"loss did not fall: first 5 steps {first:.3f}, last 5 {last:.3f}"
    if len(evals) >= 2 and not evals[-1] < evals[0]:
        return False, f"eval loss did not fall: {evals[0]:.3f} -> {evals[-1]:.3f}"
    return True, f"loss {first:.2f} -> {last:.2f}"


def run(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    log.write_text(f"$ {shlex.join(cmd)}\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    return done


def stage_suite(out: Path, pytest_args: list[str]) -> tuple[bool, str]:
    parallel = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    done = run([sys.executable, "-m", "pytest", "-q", "-rfEs", *parallel, *pytest_args], out / "suite.log")
    summary = next((x for x in reversed(done.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", x)), "")
    return done.returncode == 0, summary.strip("= ") or f"pytest exit {done.returncode}"


def stage_train(out: Path, stage: str) -> tuple[bool, str]:
    run_dir = out / f"{stage}-run"
    done = run([sys.executable, "-m", "finetune", "train", str(QUICKSTART), f"output_dir={run_dir}",
                *TRAIN_STAGES[stage], *RUN_ARGS, "--overwrite"], out / f"{stage}.log")
    if done.returncode != 0:
        return False, f"exit {done.returncode}"
    return check_run(run_dir, done.stdout)


def stage_bench(out: Path) -> tuple[bool, str]:
    done = run([sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--smoke"], out / "bench.log")
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("gpu_throughput:")), "")
    figure = re.search(r"([\d,]+) tokens/s real", line)
    return done.returncode == 0, (f"{figure.group(1)} tokens/s (smoke)" if figure else f"exit {done.returncode}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(STAGES), help=f"comma-separated stages of {', '.join(STAGES)}")
    p.add_argument("--out", default=str(ROOT / "runs" / "test-gpu"), help="where logs and runs go")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments for the suite stage")
    a = p.parse_args(argv)
    stages = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stage(s) {', '.join(sorted(unknown))}; choose from {', '.join(STAGES)}")
    problem = cuda_problem()
    if problem:
        print(f"test-gpu: FAIL ({problem}: nothing was run; this target needs a CUDA machine, `make test` is the "
              "CPU suite)")
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for stage in stages:
        if stage == "suite":
            ok, note = stage_suite(out, shlex.split(a.pytest_args))
        elif stage == "bench":
            ok, note = stage_bench(out)
        else:
            ok, note = stage_train(out, stage)
        results[stage] = (ok, note)
        print(f"{stage:6s} {'ok  ' if ok else 'FAIL'} {note}  (log: {out / (stage + '.log')})", flush=True)
        if not ok:
            tail = (out / f"{stage}.log").read_text().splitlines()[-25:]
            print("\n".join(f"    {x}" for x in tail))
    failed = [s for s, (ok, _) in results.items() if not ok]
    detail = "; ".join(f"{s}: {note}" for s, (_, note) in results.items())
    print(f"test-gpu: {'FAIL' if failed else 'PASS'} ({detail})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
