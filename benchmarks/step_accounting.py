"""Where one training step's time goes: the trainer's own loop (finetune/train/loop.py) part by part, against a plain
loop on the same model, micro-batches and attention. Issue 48's accounting.

    .venv/bin/python benchmarks/step_accounting.py                   # packed rows (~2 minutes on a 2-core CPU)
    .venv/bin/python benchmarks/step_accounting.py --padded          # packing off (padding-free where it applies)
    .venv/bin/python benchmarks/step_accounting.py --tree /tmp/old   # an older checkout (git worktree add)

The run is benchmarks/sft_vs_trl.py's: the 5.3M Llama (2 layers x 448), 4,000 lognormal chat rows, max_seq_len
1024, micro-batch 4, float32, one thread. `setup` builds the real Run and `train_loop` takes --steps real steps;
each part the loop calls is timed by a wrapper installed here for the measurement (the product code is unchanged):
  rows         the next step's rows read (plan.step: from the token store; outside the step's timed lap)
  prefetch     those rows collated onto the device (the rest of _micro_batches)
  counts       step_counts: the step's target tokens, summed on the host
  forward      the model's trunk (its decoder stack), from forward hooks on it
  loss         the rest of the objective's forward: the fused linear cross-entropy
  backward     forward_backward minus the forward and loss (autograd, and the per-micro-batch scaling and sums)
  clip         clip_gradients: the gradient norm and the clipping
  read         read_step: the step's one read of the device
  optimizer    optimizer.step + zero_grad, the scheduler, the weight samples and the update ratio
  metrics      the metrics line (the MFU, peak memory, the record and its write; the write outside the lap)
  loop         everything else of the loop body: a step's wall time, lap end to lap end, minus the parts above
The plain loop takes the same collated micro-batches through the same model (our attention, the same documents), with
transformers' own loss from `labels`, backward, and torch's AdamW (foreach) + zero_grad: the floor for this model.
Reported: the median over steps (the first --warmup left out) of each part, in ms, and its share of the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import packing  # noqa: E402
import sft_vs_trl  # noqa: E402

PARTS = ("rows", "prefetch", "counts", "forward", "loss", "backward", "clip", "read", "optimizer", "metrics", "loop")


class Clock:
    """Per-step sums of the time spent in each part."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - began
        return wrapper


def ours(recipe_path: Path, steps: int) -> list[dict[str, float]]:
    """The trainer's loop for `steps` steps, each part timed (ms per step)."""
    import torch
    from rich.console import Console

    from finetune import dist
    from finetune.recipe import load_recipe
    from finetune.train import loop
    from finetune.train.setup import setup

    torch.set_num_threads(1)
    recipe = load_recipe(recipe_path)
    world = dist.from_env()
    clock = Clock()
    with dist.process_group(world) as device:
        run = setup(recipe, world, device, Console(quiet=True), overwrite=True, allow_unpinned=False)
        for name, part in (("_micro_batches", "prefetch"), ("step_counts", "counts"), ("clip_gradients", "clip"),
                           ("read_step", "read"), ("_update_ratio", "optimizer"), ("_write_line", "metrics"),
                           ("mfu", "metrics"), ("peak_memory_mb", "metrics")):
            setattr(loop, name, clock.timed(part, getattr(loop, name)))
        run.optimizer.step = clock.timed("optimizer", run.optimizer.step)
        run.optimizer.zero_grad = clock.timed("optimizer", run.optimizer.zero_grad)
        run.scheduler.step = clock.timed("optimizer", run.scheduler.step)
        run.weight_samples.take = clock.timed("optimizer", run.weight_samples.take)
        forward_backward = loop.forward_backward
        objective_forward = run.objective.forward
        run.objective.forward = clock.timed("loss", objective_forward)  # the trunk's share moved out below
        trunk = run.lm.get_decoder()
        began: list[float] = []
        trunk.register_forward_pre_hook(lambda *_: began.append(time.perf_counter()))

        def trunk_done(*_: Any) -> None:
            spent = time.perf_counter() - began.pop()
            clock.current["forward"] += spent
            clock.current["loss"] -= spent

        trunk.register_forward_hook(trunk_done)

        def timed_fb(*args: Any, **kwargs: Any) -> Any:
            start, before = time.perf_counter(), clock.current["forward"] + clock.current["loss"]
            try:
                return forward_backward(*args, **kwargs)
            finally:
                inside = clock.current["forward"] + clock.current["loss"] - before
                clock.current["backward"] += time.perf_counter() - start - inside

        loop.forward_backward = timed_fb
        run.plan.step = clock.timed("rows", run.plan.step)  # inside prefetch; left out of the step's lap
        lap = loop.Stopwatch.lap
        last = [time.perf_counter()]

        def timed_lap(watch: Any) -> float:
            seconds, now = lap(watch), time.perf_counter()
            # A step, lap to lap in wall time: everything the loop did in between is in one of the parts.
            step = dict(clock.current)
            step["prefetch"] = step.get("prefetch", 0.0) - step.get("rows", 0.0)
            step["loop"] = now - last[0] - sum(step.values())
            step["lap"] = seconds  # what tokens_per_s divides by: without reading the rows or writing the line
            last[0] = now
            clock.steps.append(step)
            clock.current = defaultdict(float)
            return seconds

        loop.Stopwatch.lap = timed_lap
        run.plan.total = min(run.plan.total, steps)
        loop.train_loop(run)
        loop.Stopwatch.lap = lap
    return [{k: v * 1e3 for k, v in s.items()} for s in clock.steps]


def plain(recipe_path: Path, steps: int) -> list[dict[str, float]]:
    """The same model and micro-batches through a plain loop: forward with transformers' loss, backward, AdamW."""
    import torch
    from rich.console import Console

    from finetune import dist
    from finetune.batch import Documents
    from finetune.metrics import Stopwatch
    from finetune.recipe import load_recipe
    from finetune.train import loop
    from finetune.train.setup import setup

    torch.set_num_threads(1)
    recipe = load_recipe(recipe_path)
    world = dist.from_env()
    out = []
    with dist.process_group(world) as device:
        run = setup(recipe, world, device, Console(quiet=True), overwrite=True, allow_unpinned=False)
        lm = run.lm.train()
        optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3, foreach=True)
        for step in range(steps):
            micro = loop._micro_batches(run, step, Stopwatch())[2]
            parts: dict[str, float] = defaultdict(float)
            for batch in micro:
                extra = Documents.of(batch.position_ids).model_kwargs() if batch.position_ids is not None else {}
                t0 = time.perf_counter()
                loss = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, labels=batch.labels, use_cache=False, **extra).loss
                t1 = time.perf_counter()
                (loss / len(micro)).backward()
                t2 = time.perf_counter()
                parts["forward"] += (t1 - t0) * 1e3
                parts["backward"] += (t2 - t1) * 1e3
            t0 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            parts["optimizer"] = (time.perf_counter() - t0) * 1e3
            out.append(dict(parts))
    return out


def report(rows: dict[str, list[dict[str, float]]], warmup: int) -> None:
    medians = {name: {p: statistics.median(s.get(p, 0.0) for s in steps[warmup:]) for p in PARTS}
               for name, steps in rows.items()}
    totals = {name: sum(m.values()) for name, m in medians.items()}
    names = list(rows)
    print("\n| part | " + " | ".join(f"{n} ms (share)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for part in PARTS:
        cells = [f"{medians[n][part]:,.1f} ({medians[n][part] / totals[n]:.1%})" if medians[n][part] else "-"
                 for n in names]
        print(f"| {part} | " + " | ".join(cells) + " |")
    print("| step (sum of medians) | " + " | ".join(f"{totals[n]:,.1f}" for n in names) + " |")
    if "lap" in rows[names[0]][0]:
        laps = statistics.median(s["lap"] for s in rows[names[0]][warmup:])
        print(f"{names[0]}'s timed lap (what tokens_per_s divides by): median {laps:,.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--padded", action="store_true", help="packing off")
    parser.add_argument("--work", default=None)
    parser.add_argument("--tree", default=None, help="measure the finetune of this checkout (a git worktree)")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)  # before packing.py's ROOT: finetune is imported below, from here
    sft_vs_trl.configure(2, 448)
    work = Path(args.work or tempfile.mkdtemp(prefix="step-accounting-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["FINETUNE_CACHE_DIR"] = str(work / "cache")
    data = packing.synthesize_lognormal(work / "rows.jsonl", sft_vs_trl.ROWS, cap=sft_vs_trl.MAX_LEN)
    recipe = packing.write_recipe(work, "sft", data, not args.padded, args.steps)
    import torch

    import finetune

    print(f"finetune from {Path(finetune.__file__).parent}; torch {torch.__version__}; {args.steps} steps, "
          f"medians of steps {args.warmup + 1}..{args.steps}; {'padded' if args.padded else 'packed'}", flush=True)
    rows = {"ours": ours(recipe, args.steps), "plain": plain(recipe, args.steps)}
    report(rows, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
