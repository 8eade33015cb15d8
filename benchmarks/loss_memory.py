"""Peak extra memory and time of one forward+backward of the output-layer cross-entropy: chunked vs torch (CPU,
float32), and liger vs torch vs chunked (CUDA, bf16) when a GPU is present.

    .venv/bin/python benchmarks/loss_memory.py                       # N=8192, H=2048, V=128256, chunk 1024
    .venv/bin/python benchmarks/loss_memory.py --chunk-size 1024 2048 4096 --repeats 3

CPU memory is the growth of the process's resident-set high-water mark (VmHWM in /proc/self/status) over the
resident set once the inputs exist; every repeat runs in a fresh subprocess because the high-water mark never
goes down. It therefore includes everything the step allocates: the logits (or their chunks), the gradient of
the selected hidden rows, weight.grad (V x H fp32, the same for every implementation) and allocator slack.
CUDA memory is torch.cuda.max_memory_allocated() over memory_allocated() before the step.
Times are medians of wall-clock seconds; on CPU also of the process's CPU seconds (all threads), which other
load on the machine disturbs much less than wall time.

Targets (CPU): chunked needs <= 1/4 of torch's extra peak memory at <= 1.3x its time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout without an editable install
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from proc_memory import status_kib  # noqa: E402

from finetune.loss.fused import linear_cross_entropy  # noqa: E402

MiB = 1024 * 1024


def _make_inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str, seed: int = 0):
    """hidden [1, n+1, H] and labels [1, n+1] with no IGNORE_INDEX: after the shift exactly n targets."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(1, n + 1, h, generator=g, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, device=device, dtype=dtype) * h**-0.5).requires_grad_()
    labels = torch.randint(0, v, (1, n + 1), generator=g, device=device)
    return hidden, weight, labels


def _step(impl: str, hidden, weight, labels, chunk_size: int) -> None:
    loss, count = linear_cross_entropy(hidden, weight, labels, impl=impl, chunk_size=chunk_size)
    loss.backward()


def worker_cpu(impl: str, n: int, h: int, v: int, chunk_size: int) -> dict:
    """One measured forward+backward in this (fresh) process."""
    hidden, weight, labels = _make_inputs(n, h, v, torch.float32, "cpu")
    base_kib = status_kib("VmRSS")
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0); without it HWM >= RSS still holds
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    hwm_before = status_kib("VmHWM")
    t0, c0 = time.perf_counter(), time.process_time()
    _step(impl, hidden, weight, labels, chunk_size)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak_kib = status_kib("VmHWM")
    if not reset and hwm_before > base_kib:
        print(f"warning: could not reset VmHWM; it was already {hwm_before - base_kib} KiB above RSS",
              file=sys.stderr)
    return {"impl": impl, "chunk_size": chunk_size, "extra_mib": (peak_kib - base_kib) / 1024,
            "seconds": seconds, "cpu_seconds": cpu_seconds}


def run_cpu(args: argparse.Namespace) -> list[dict]:
    """Repeats are interleaved (torch, chunked..., torch, chunked...) so that load from other processes on the
    machine spreads over all implementations instead of hitting one of them."""
    configs = [("torch", 0)] + [("chunked", c) for c in args.chunk_size]
    runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):
        for impl, chunk in configs:
            cmd = [sys.executable, __file__, "--worker", impl, "--n", str(args.n), "--h", str(args.h), "--v",
                   str(args.v), "--chunk-size", str(max(chunk, 1))]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[(impl, chunk)].append(res)
            print(f"  repeat {r + 1}/{args.repeats} {impl:8s} chunk={chunk or '-':>5}: {res['extra_mib']:9.0f} MiB "
                  f"{res['seconds']:8.1f} s wall {res['cpu_seconds']:8.1f} s cpu", flush=True)
    return [{"impl": impl, "chunk_size": chunk, "runs": rs,
             "extra_mib": statistics.median(x["extra_mib"] for x in rs),
             "seconds": statistics.median(x["seconds"] for x in rs),
             "cpu_seconds": statistics.median(x["cpu_seconds"] for x in rs)}
            for (impl, chunk), rs in runs.items()]


def run_cuda(args: argparse.Namespace) -> list[dict]:
    """All implementations in one process: peak allocated bytes are exact on CUDA, so no subprocesses."""
    from finetune.loss.fused import resolve_impl

    impls = [("torch", 0)] + [("chunked", c) for c in args.chunk_size]
    try:
        resolve_impl("liger", torch.device("cuda"))
        impls.insert(1, ("liger", 0))
    except Exception as exc:  # UserError: not installed
        print(f"liger skipped: {exc}")
    hidden, weight, labels = _make_inputs(args.n, args.h, args.v, torch.bfloat16, "cuda")
    rows = []
    for impl, chunk in impls:
        runs = []
        for r in range(args.repeats + 1):  # the first run warms up kernels (Triton compiles) and is dropped
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            _step(impl, hidden, weight, labels, max(chunk, 1))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if r:
                runs.append({"extra_mib": (torch.cuda.max_memory_allocated() - base) / MiB, "seconds": seconds})
        rows.append({"impl": impl, "chunk_size": chunk, "runs": runs,
                     "extra_mib": statistics.median(x["extra_mib"] for x in runs),
                     "seconds": statistics.median(x["seconds"] for x in runs)})
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    ref = next(r for r in rows if r["impl"] == "torch")
    cpu = all("cpu_seconds" in r for r in rows)
    print(f"\n{title}")
    head = f"{'impl':8s} {'chunk':>6s} {'peak extra MiB':>15s} {'wall s':>8s} {'mem/torch':>10s} {'wall/torch':>11s}"
    print(head + (f" {'cpu s':>8s} {'cpu/torch':>10s}" if cpu else ""))
    for r in rows:
        line = (f"{r['impl']:8s} {r['chunk_size'] or '-':>6} {r['extra_mib']:15.0f} {r['seconds']:8.2f} "
                f"{r['extra_mib'] / ref['extra_mib']:10.3f} {r['seconds'] / ref['seconds']:11.3f}")
        if cpu:
            line += f" {r['cpu_seconds']:8.1f} {r['cpu_seconds'] / ref['cpu_seconds']:10.3f}"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192, help="target tokens")
    p.add_argument("--h", type=int, default=2048, help="hidden size")
    p.add_argument("--v", type=int, default=128256, help="vocabulary size")
    p.add_argument("--chunk-size", type=int, nargs="+", default=[1024], help="one or more chunk sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA table even when a GPU is present")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU table (slow at the default sizes)")
    p.add_argument("--worker", choices=["torch", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        print(json.dumps(worker_cpu(args.worker, args.n, args.h, args.v, args.chunk_size[0])))
        return

    shape = f"N={args.n} H={args.h} V={args.v}"
    if not args.no_cpu:
        print(f"CPU float32, {shape}, {torch.get_num_threads()} threads, {args.repeats} repeats (fresh process each)")
        print_table(f"CPU float32 forward+backward, {shape} (medians)", run_cpu(args))
    if torch.cuda.is_available() and not args.no_cuda:
        print_table(f"CUDA bf16 forward+backward, {shape}, {torch.cuda.get_device_name()} (medians)",
                    run_cuda(args))


if __name__ == "__main__":
    main()
