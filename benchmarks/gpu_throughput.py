"""GPU throughput of the default recipe path: tokens/s of `finetune train` on a Llama-3.2-1B-shaped model.

    python3 benchmarks/gpu_throughput.py [--model DIR] [--steps 30] [--seq 2048] [--micro 4] [--smoke]

The run is the quickstart recipe with the model swapped: bf16, packed rows of --seq tokens, attention `auto` (sdpa
one document at a time), loss `auto` (Liger on CUDA when liger-kernel imports), AdamW, micro-batch --micro, no
accumulation, no eval. The model is --model, or a random Llama-3.2-1B-shaped one (vocab 128256, tied embeddings)
written by make_llama1b.py (from .gpu/ or ../shared/gpu/; `bash ../shared/gpu/prepare.sh` copies it) into
/tmp/llama1b: tokens/s do not depend on the weights' values. --smoke: the same with 2 layers, 6 steps of 1024
tokens, to check the path end to end in about a minute (its figures are not the 1B's).

Prints the median over the steps after the first two (warm-up) of real tokens/s and computed (padded) tokens/s,
MFU where the GPU is known, and peak memory, all read from the run's metrics.jsonl. Without CUDA it says so and
exits 1: these are GPU figures. `--print-overrides` prints the recipe overrides and exits (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "yaml" / "quickstart.yaml"
MAKERS = (ROOT / ".gpu" / "make_llama1b.py", ROOT.parent / "shared" / "gpu" / "make_llama1b.py")
WARMUP_STEPS = 2


def overrides(model: str, steps: int, seq: int, micro: int, out: str) -> list[str]:
    """The quickstart recipe turned into the benchmark's: the model from `model`, bf16, no eval."""
    return [f"output_dir={out}", f"model.path={model}", "model.init=pretrained", "model.config=null",
            "model.dtype=bfloat16", f"data.max_seq_len={seq}", f"train.micro_batch_size={micro}",
            "train.gradient_accumulation_steps=1", f"train.max_steps={steps}", "train.epochs=null",
            "train.warmup_steps=0", "eval.at_start=false", "eval.every_steps=null", "logging.every_steps=1"]


def summarize(metrics: Path) -> dict[str, float]:
    """Medians over the train lines after the warm-up steps of metrics.jsonl."""
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [r for r in lines if "loss" in r]
    timed = steps[WARMUP_STEPS:] or steps
    out = {"steps": float(len(steps)), "last_loss": float(steps[-1]["loss"]) if steps else float("nan")}
    for key in ("tokens_per_s", "padded_tokens_per_s", "mfu", "peak_memory_mb"):
        values = [float(r[key]) for r in timed if r.get(key) is not None]
        out[key] = statistics.median(values) if values else float("nan")
    return out


def model_dir(given: str | None, smoke: bool) -> str:
    """--model, else a Llama-1B-shaped random model made once by make_llama1b.py (2 layers for --smoke)."""
    if given:
        return given
    target = Path("/tmp/llama1b-2layers" if smoke else "/tmp/llama1b")
    if (target / "config.json").is_file():
        return str(target)
    maker = next((m for m in MAKERS if m.is_file()), None)
    if maker is None:
        raise SystemExit(f"no --model and no make_llama1b.py at {' or '.join(map(str, MAKERS))}: "
                         "run `bash ../shared/gpu/prepare.sh`, or pass --model DIR")
    subprocess.run([sys.executable, str(maker), str(target), *(["--layers", "2"] if smoke else [])], check=True)
    return str(target)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF model directory (default: a Llama-1B-shaped random model in /tmp)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="2 layers, 6 steps of 1024 tokens: the path, not figures")
    p.add_argument("--print-overrides", action="store_true", help="print the recipe overrides and exit")
    a = p.parse_args(argv)
    steps, seq = (6, 1024) if a.smoke else (a.steps, a.seq)
    if a.print_overrides:
        print(" ".join(overrides(a.model or "/tmp/llama1b", steps, seq, a.micro, "runs/gpu-throughput")))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_throughput: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
              "nothing measured")
        return 1
    model = model_dir(a.model, a.smoke)
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "finetune", "train", str(QUICKSTART), *overrides(model, steps, seq, a.micro,
                                                                                      str(out))]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            print(f"gpu_throughput: the run failed (exit {done.returncode})")
            return 1
        figures = summarize(out / "metrics.jsonl")
    mode = "smoke (2 layers)" if a.smoke else "Llama-1B-shaped"
    print(f"gpu_throughput: {torch.cuda.get_device_name()} | {mode} bf16, packed rows of {seq}, micro {a.micro}, "
          f"{int(figures['steps'])} steps (median of steps after {WARMUP_STEPS}): "
          f"{figures['tokens_per_s']:,.0f} tokens/s real, {figures['padded_tokens_per_s']:,.0f} computed, "
          f"MFU {figures['mfu']:.3f}, peak {figures['peak_memory_mb']:,.0f} MiB, last loss {figures['last_loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
