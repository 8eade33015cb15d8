"""Peak activation memory per rank of one training step under context parallelism (distributed.context_parallel: N,
issue 45), for N = 1 (one process), 2 and 4 (torchrun, gloo, DP = 1): does each rank's share shrink ~N-fold?

    .venv/bin/python benchmarks/context_parallel_memory.py                      # a 16384-token row, 4 layers
    .venv/bin/python benchmarks/context_parallel_memory.py --seq-len 8192 --layers 2 --ranks 1 2

Each configuration is the real trainer's step, in fresh processes: every rank builds its `Run` with
finetune.train.setup (examples/yaml/quickstart.yaml with overrides: a random-init Llama of hidden 256, 8 query
heads, 4 kv heads, intermediate 768, --layers layers, float32, the example tokenizer's 1024-token vocabulary,
our packed attention, the default chunked loss, DDP under torchrun), cuts the first optimizer step's micro-batch
with step_micro_batches (one row of --seq-len tokens: one synthetic completion-format document, truncated to
it, micro batch 1, no accumulation; under CP each rank keeps its 1/N of the row's positions) and runs
forward_backward on it, as train_loop does. FINETUNE_DEVICE=cpu and OMP_NUM_THREADS=1 for every N (--device
cuda: one GPU a rank, peak allocated bytes instead of the resident set; not yet run: no GPU machine here).

Per-rank activation memory: the growth of the rank's resident-set high-water mark (VmHWM, reset to the resident
set through /proc/self/clear_refs just before) during forward_backward over the resident set before it (taken
after gc and malloc_trim, so that heap freed by set-up is not reused unseen), minus the parameter gradients the
step leaves (the same on every rank for any N: weights are replicated). So it includes everything the forward
keeps for the backward and the backward's transient buffers: the hidden states of every layer, q/k/v and the
attention's saved tensors, the MLP's, the Ulysses all-to-all buffers and the whole-row q/k/v of this rank's heads
inside the attention, the fused loss's logits chunk (chunk x V fp32) and its gradient, the gloo all-reduce of the
step's sums, and allocator slack. It excludes the weights, the optimizer states (AdamW creates them at the first
optimizer.step, after this), the parameter gradients, the collated batch, and the Python, torch and gloo
baseline of the process (all in `before`: what a rank needs besides its activations).

The workers run with MALLOC_MMAP_THRESHOLD_=131072 (--default-malloc: without): glibc then maps every buffer of
128 KiB or more on its own and unmaps it when freed, so the resident set follows the tensors. With its default
dynamic threshold (up to 32 MiB), freed buffers stay in the heap and the peak holds allocator slack, a larger
share at larger N (a rank's tensors are smaller, more of them fall under the threshold): measured below too.

Measured on a 2-core CPU (23 GiB, shared with another session's work), torch 2.13 CPU, transformers 5.23; medians
of 3 interleaved repeats (fresh processes each; with the fixed threshold all 3 gave the same MiB), 4.5 minutes:

    .venv/bin/python benchmarks/context_parallel_memory.py --repeats 3

     N tokens/rank    per rank (rank 0, 1, ...)   worst  vs N=1   x N  before  grads  step s     loss
     1       16384                         1524    1524   1.000  1.00     457   13.0    25.2   6.9660
     2        8192                     793, 793     793   0.520  1.04     460   13.0    15.8   6.9660
     4        4096           379, 379, 379, 379     379   0.249  0.99     460   13.0    18.2   6.9660

    .venv/bin/python benchmarks/context_parallel_memory.py --repeats 3 --default-malloc

     1       16384                         1711    1711   1.000  1.00     457   13.0    23.0   6.9660
     2        8192                   1137, 1114    1137   0.665  1.33     460   13.0    18.7   6.9660
     4        4096           563, 549, 567, 533     567   0.331  1.32     461   13.0    15.7   6.9660

    .venv/bin/python benchmarks/context_parallel_memory.py --method ring --ranks 2 4     (one run, 2026-11-28)

     2        8192                     836, 835     836       -     -     476   13.0   134.1   6.9660
     4        4096           417, 417, 417, 417     417       -     -     475   13.0   112.8   6.9660

The ring's blocks are plain torch math, a tile of queries at a time (16 MiB of float32 scores): 10% more than
Ulysses at N = 2 and 4 (x N 1.10 against N = 1's 1523 MiB), and with 64 MiB tiles 993 and 656 MiB; its step is
~7x Ulysses' here (scores of whole blocks on one thread, against sdpa's fused kernel).

The activations shrink N-fold (x N 1.04 at N = 2, 0.99 at 4): 1524 MiB is ~24 fp32 vectors of the hidden size a
token a layer, and each rank keeps them for its 1/N of the positions; the attention's whole-row q/k/v (after the
all-to-all) are those of 1/N of the heads, so they shrink N-fold too, and the exchange's buffers are transient.
The loss is the same for every N (the step is one process's).
What does not shrink: the weights, their gradients (13 MiB here) and AdamW's states, replicated on every rank
(DDP; FSDP2 would shard them over the N ranks), the process's baseline (~450 MiB of torch and gloo here), and the
fused loss's logits chunk (loss.chunk_size x V fp32: 4 MiB at V = 1024, 512 MiB at V = 128k, until a rank holds
fewer than chunk_size targets). With kv heads fewer than N, Ulysses repeats them to one per query head before the
exchange: k and v then shrink by less. Times (`step s`): 2 shared cores for up to 4 ranks and gloo's all-to-all
over loopback say nothing about a GPU's; they only show what a run costs here. No GPU measurement yet: --device
cuda needs N GPUs (NCCL puts one rank on each).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout without an editable install
    sys.path.insert(0, str(REPO))

from proc_memory import status_kib  # noqa: E402

MiB = 1024 * 1024
MMAP_THRESHOLD = 128 * 1024
QUICKSTART = REPO / "examples" / "yaml" / "quickstart.yaml"
WORDS = ["face", "bird", "apple", "river", "stone", "green", "seven", "house", "light", "music", "cloud", "paper",
         "table", "water", "dream", "north", "quiet", "orange", "silver", "window", "garden", "yellow", "winter",
         "summer"]  # ~2 tokens a word with the example tokenizer


def _trim() -> None:
    """Return the heap's free memory to the system (glibc), so that the resident set is what is live."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _overrides(args: argparse.Namespace, ranks: int, data: Path, out: Path) -> list[str]:
    return [f"output_dir={out}", f"datasets.0.path={data}", "datasets.0.format=completion", "eval_datasets=[]",
            "model.config.hidden_size=256", "model.config.intermediate_size=768",
            f"model.config.num_hidden_layers={args.layers}", "model.config.num_attention_heads=8",
            "model.config.num_key_value_heads=4", f"model.config.max_position_embeddings={args.seq_len}",
            f"data.max_seq_len={args.seq_len}", "data.packing=true", "data.num_proc=1",
            "train.micro_batch_size=1", "train.gradient_accumulation_steps=1", "train.max_steps=1",
            "train.warmup_steps=0", f"distributed.context_parallel={ranks}",
            f"distributed.context_parallel_method={args.method}"]


def worker(args: argparse.Namespace) -> None:
    """One configuration in this process (rank) of a fresh run: set-up, one step's micro-batch, the measured
    forward_backward. Rank 0 prints every rank's figures as one JSON line."""
    import torch
    import torch.distributed as tdist
    from rich.console import Console

    from finetune import dist
    from finetune.recipe import load_recipe
    from finetune.train.setup import setup
    from finetune.train.step import forward_backward, step_counts, step_micro_batches

    recipe = load_recipe(QUICKSTART, _overrides(args, args.worker, Path(args.data), Path(args.out)))
    world = dist.from_env()
    console = Console(file=sys.stderr, soft_wrap=True, quiet=not world.is_main)
    with dist.process_group(world) as device:
        run = setup(recipe, world, device, console, overwrite=True, allow_unpinned=True)
        run.net.train()
        _, rows = run.plan.step(0)
        micro = step_micro_batches(run.objective, rows, recipe, run.tokenizer.pad_token_id, world.size, world.rank,
                                   device, run.context)
        counts = step_counts(run.objective, micro, world, device).counts
        _trim()
        dist.barrier()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base_kib = torch.cuda.memory_allocated(device) / 1024
        else:
            base_kib = status_kib("VmRSS")
            try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                print("warning: could not reset VmHWM: the figures are upper bounds", file=sys.stderr)
        t0, c0 = time.perf_counter(), time.process_time()
        sums = forward_backward(run.net, run.objective, micro, counts, world, device)
        if cuda:
            torch.cuda.synchronize(device)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        peak_kib = torch.cuda.max_memory_allocated(device) / 1024 if cuda else status_kib("VmHWM")
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in run.lm.parameters() if p.grad is not None)
        weight_bytes = sum(p.numel() * p.element_size() for p in run.lm.parameters())
        mine = {"rank": world.rank, "tokens": int(sum(m.input_ids.numel() for m in micro)),
                "targets": int(sum(m.targets for m in micro)), "base_mib": base_kib / 1024,
                "growth_mib": (peak_kib - base_kib) / 1024, "grad_mib": grad_bytes / MiB,
                "activation_mib": (peak_kib - base_kib) / 1024 - grad_bytes / MiB, "weight_mib": weight_bytes / MiB,
                "seconds": seconds, "cpu_seconds": cpu_seconds, "loss": float(sums[0]) / max(counts["tokens"], 1)}
        everyone = [mine]
        if tdist.is_initialized():
            everyone = [None] * world.size
            tdist.all_gather_object(everyone, mine)
        if world.is_main:
            print(json.dumps({"ranks": args.worker, "device": str(device), "per_rank": everyone}),
                  flush=True)
        del run


def _write_data(path: Path, seq_len: int, rows: int = 2) -> None:
    """Completion rows of ~2 x seq_len tokens each: every row is one document truncated to the row length."""
    gen = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(gen.choice(WORDS) for _ in range(seq_len))}) + "\n")


def _launch(args: argparse.Namespace, ranks: int, data: Path, tmp: Path) -> dict:
    out = tmp / f"run-cp{ranks}"
    shutil.rmtree(out, ignore_errors=True)
    script = [__file__, "--worker", str(ranks), "--data", str(data), "--out", str(out), "--seq-len",
              str(args.seq_len), "--layers", str(args.layers), "--method", args.method]
    cmd = [sys.executable, *script] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *script]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "FINETUNE_DEVICE": args.device,
           "FINETUNE_CACHE_DIR": str(tmp / "cache")}
    if not args.default_malloc:  # every tensor of 128 KiB or more its own mapping, unmapped when freed
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode:
        raise SystemExit(f"N = {ranks} failed ({' '.join(cmd)}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    result["run_seconds"] = time.perf_counter() - t0
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=16384, help="tokens in the row (one document)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                   help="context-parallel sizes (1: one process); each divides the 8 query heads")
    p.add_argument("--method", choices=["ulysses", "ring"], default="ulysses",
                   help="distributed.context_parallel_method (ring: any N, the heads are not split)")
    p.add_argument("--repeats", type=int, default=1, help="fresh runs of every N, interleaved; medians")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's dynamic mmap threshold on: the resident set then holds allocator slack too")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU a rank (NCCL), N GPUs for N; peak allocated bytes instead of the RSS")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.method == "ulysses" and any(8 % n for n in args.ranks):
        p.error("--ranks: each must divide the model's 8 query heads (1, 2, 4 or 8)")

    tmp = Path(tempfile.mkdtemp(prefix="cp-memory-"))
    try:
        data = tmp / "long.jsonl"
        _write_data(data, args.seq_len)
        where = "a GPU a rank, NCCL" if args.device == "cuda" else "CPU gloo, 1 thread a rank"
        print(f"one {args.seq_len}-token row (one document), Llama hidden 256 x {args.layers} layers, 8 heads "
              f"(4 kv), V 1024, float32, {where}, {args.method}; N = {', '.join(map(str, args.ranks))}",
              flush=True)
        runs: dict[int, list[dict]] = {n: [] for n in args.ranks}
        for r in range(args.repeats):
            for n in args.ranks:
                res = _launch(args, n, data, tmp)
                runs[n].append(res)
                acts = ", ".join(f"{x['activation_mib']:.0f}" for x in res["per_rank"])
                print(f"  repeat {r + 1}/{args.repeats} N = {n}: {acts} MiB ({res['run_seconds']:.0f} s in all)",
                      flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _table(args, {n: _median_run(rs) for n, rs in runs.items()})


def _median_run(runs: list[dict]) -> dict:
    """Each rank's figures, each the median over the repeats."""
    ranks = len(runs[0]["per_rank"])
    return {"per_rank": [{k: statistics.median(run["per_rank"][i][k] for run in runs) for k in runs[0]["per_rank"][i]}
                         for i in range(ranks)]}


def _table(args: argparse.Namespace, results: dict[int, dict]) -> None:
    ref = max(r["activation_mib"] for r in results[1]["per_rank"]) if 1 in results else None
    what = "CUDA peak allocated" if args.device == "cuda" else "RSS high-water mark" + (
        ", glibc's default malloc" if args.default_malloc else f", mmap threshold {MMAP_THRESHOLD // 1024} KiB")
    print(f"\nper-rank peak activation memory of one forward+backward, {args.seq_len}-token row, {args.layers} "
          f"layers, medians of {args.repeats} (MiB; {what}: growth minus parameter gradients)")
    print(f"{'N':>2s} {'tokens/rank':>11s} {'per rank (rank 0, 1, ...)':>28s} {'worst':>7s} {'vs N=1':>7s} "
          f"{'x N':>5s} {'before':>7s} {'grads':>6s} {'step s':>7s} {'loss':>8s}")
    for n, res in results.items():
        ranks = res["per_rank"]
        acts = [r["activation_mib"] for r in ranks]
        worst = max(acts)
        ratio = f"{worst / ref:7.3f}" if ref else f"{'-':>7s}"
        times_n = f"{worst / ref * n:5.2f}" if ref else f"{'-':>5s}"
        print(f"{n:2d} {ranks[0]['tokens']:11d} {', '.join(f'{a:.0f}' for a in acts):>28s} {worst:7.0f} {ratio} "
              f"{times_n} {max(r['base_mib'] for r in ranks):7.0f} {ranks[0]['grad_mib']:6.1f} "
              f"{max(r['seconds'] for r in ranks):7.1f} {ranks[0]['loss']:8.4f}")
    print("x N: the worst rank's share times N (1.00: an exact N-fold shrink). before: the rank's memory before the "
          "step (RSS: weights and the process's baseline; CUDA: allocated). grads: the parameter gradients, "
          "subtracted." + (" step s: on a shared CPU, not a GPU's time." if args.device == "cpu" else ""))


if __name__ == "__main__":
    main()
