"""Peak extra memory and time of one forward+backward of the distillation loss: the fused, chunked generalized JSD
(finetune/loss/distill.py) against the naive full-logits one (CPU, float32).

    .venv/bin/python benchmarks/distill_memory.py                 # N=8192, V=131072, H=256/256, beta 0.5, chunk 1024
    .venv/bin/python benchmarks/distill_memory.py --beta 0 0.5 1 --top-k 0 64 --repeats 3
    .venv/bin/python benchmarks/distill_memory.py --small         # V=8192, N=1024, chunk 128: a smoke check (~10 s)

Naive: the student's logits h_s @ W_s.T and the teacher's h_t @ W_t.T (without gradient) in full, [N x V] fp32 each,
then TRL 1.16's `generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py, copied below: log_softmax of both,
the beta-mixture through logsumexp of a stack, F.kl_div) summed over the rows; with top_k, the same formula over
the teacher's top-k ids and a tail bucket, built from the full log-probabilities. Ours: distill_loss on the same
inputs. Both then backward to the student's hidden rows and weight. Every measurement runs in a fresh subprocess
(as benchmarks/loss_memory.py): peak extra memory is the growth of the process's resident-set high-water mark
(VmHWM) over the resident set once the inputs exist, minus the gradients the step leaves on the student's hidden
rows and weight ([N, H] + [V, H] fp32). Subtracting them can only understate the naive loss's figure (its peak may
come before its weight gradient exists), never ours (distill_loss allocates its gradients before its first chunk).
Times are medians of wall-clock and of CPU seconds (all threads; other load on a shared machine disturbs them less).

The naive loss holds up to ~16 [N x V] fp32 buffers at its peak (8 MiB a row at V = 128k): ~68 GiB at N = 8192,
more than the machine these figures come from has. So it runs at --naive-n rows (default 256, 512, 1024: where it
fits), ours at the same rows and at N; the naive loss's memory and time at N are the least-squares line through
its measurements (its memory is [N x V] buffers, linear in N; the table prints the line's worst residual). Where
--naive-n includes N, the naive loss is measured there and nothing is extrapolated. At every row count where
both run, the two losses (same seeded inputs) must agree to a relative 1e-5, and the norms of the student's hidden
and weight gradients to 1e-4, or the script exits 1: it cannot win by computing something else.

Goal (issue 43): ours <= 1/8 of the naive loss's extra memory at <= 1.2x its time, at V = 128k, N = 8k.

Measured on a 2-core CPU (23 GiB, shared with another session's work), torch 2.13 CPU, 2 threads, V = 131072,
N = 8192, H = 256 for both models, temperature 1, chunk 1024; medians of 3 interleaved repeats (36 minutes):

    .venv/bin/python benchmarks/distill_memory.py --beta 0 0.5 1 --top-k 0 64 --repeats 3

    beta  top_k  naive MiB*  ours MiB  memory ratio  naive s*  ours s  wall ratio  cpu ratio  loss rel diff
    0     -           36757      2590  0.070 (1/14)      59.8    57.3       0.96x      0.87x         4.8e-6
    0     64          28579      2084  0.073 (1/14)      57.5    62.7       1.09x      0.88x         7.6e-8
    0.5   -           69528      3103  0.045 (1/22)     187.7    79.2       0.42x      0.45x         2.1e-6
    0.5   64          28579      2088  0.073 (1/14)      63.3    56.7       0.90x      1.06x         2.0e-7
    1     -           36757      3102  0.084 (1/12)      57.4    52.5       0.92x      1.06x         5.9e-7
    1     64          28577      2085  0.073 (1/14)      63.1    61.0       0.97x      0.97x         6.3e-8

    * the naive loss at N = 8192 extrapolated from its runs at 256, 512 and 1024 rows (the memory line's worst
      residual: 0.0%); measured at 1024 rows, beta 0.5: naive 8603 MiB in 20.8 s, ours 3099 MiB in 10.4 s.
      Loss rel diff: the largest over the row counts where both ran.

The goal is met in every configuration. Ours needs the same memory at 1024 rows as at 8192 (~6 [chunk x V] fp32
buffers, ~5 at beta 0, ~4 with top_k); the naive loss 4 MiB a row at beta 0 or 1, 8 MiB at 0 < beta < 1 (stack,
logsumexp and both kl_div terms over [N x V]), 3.4 MiB with top_k. Wall times on the shared machine scatter by up to
2x between repeats, so the time ratios (medians) are good to ~+-0.15. The loss differences are the naive fp32 loss's
rounding: against the same formula in float64 (64 rows), at beta 0 the naive fp32 sum is off by 4.4e-6, distill_loss
by 4e-8.
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
import torch.nn.functional as F  # noqa: E402
from proc_memory import status_kib  # noqa: E402

from finetune.loss.distill import distill_loss  # noqa: E402

MiB = 1024 * 1024
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
GOAL_MEMORY, GOAL_TIME = 1 / 8, 1.2
NAIVE_BUFFERS = 16  # [n x V] fp32 buffers at the naive loss's peak (measured: 8 MiB a row at V = 131072)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _inputs(n: int, v: int, h: int, teacher_h: int, seed: int = 0):
    """Student hidden [n, h] and weight [v, h] (with gradients), teacher hidden [n, teacher_h] and weight
    [v, teacher_h]: logits of standard deviation ~2 (student) and ~3 (teacher), a sharper teacher."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g).requires_grad_()
    ws = torch.randn(v, h, generator=g).mul_(2 * h**-0.5).requires_grad_()
    ht = torch.randn(n, teacher_h, generator=g)
    wt = torch.randn(v, teacher_h, generator=g).mul_(3 * teacher_h**-0.5)
    return hs, ws, ht, wt


def _trl_generalized_jsd(student_logits, teacher_logits, beta=0.5, temperature=1.0):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (trl/experimental/gkd/gkd_trainer.py:238), reduction="sum" and
    no labels, verbatim otherwise."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]),
            dim=0,
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    return jsd.sum()


def _naive(hs, ws, ht, wt, beta: float, temperature: float, top_k: int | None) -> torch.Tensor:
    """The full logits of both models, then TRL's formula (with top_k: over the teacher's k likeliest ids and the
    tail bucket, each model's tail log-mass a logsumexp over the complement, as distill.py defines it)."""
    student_logits = hs @ ws.t()
    with torch.no_grad():
        teacher_logits = ht @ wt.t()
    if top_k is None:
        return _trl_generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature)
    s = F.log_softmax(student_logits / temperature, dim=-1)
    with torch.no_grad():
        t = F.log_softmax(teacher_logits / temperature, dim=-1)
        idx = t.topk(top_k, dim=-1).indices

    def buckets(lp: torch.Tensor) -> torch.Tensor:
        rest = torch.logsumexp(lp.scatter(1, idx, float("-inf")), dim=1, keepdim=True)
        return torch.cat([lp.gather(1, idx), rest], dim=1)

    # bucket log-probabilities are normalized: TRL's log_softmax leaves them as they are, at temperature 1
    return _trl_generalized_jsd(buckets(s), buckets(t), beta=beta, temperature=1.0)


def worker(impl: str, n: int, v: int, h: int, teacher_h: int, beta: float, temperature: float, top_k: int | None,
           chunk_size: int) -> dict:
    """One measured forward+backward in this (fresh) process."""
    hs, ws, ht, wt = _inputs(n, v, h, teacher_h)
    base_kib = status_kib("VmRSS")
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0); without it HWM >= RSS still holds
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    hwm_before = status_kib("VmHWM")
    t0, c0 = time.perf_counter(), time.process_time()
    if impl == "naive":
        loss = _naive(hs, ws, ht, wt, beta, temperature, top_k)
    else:
        loss = distill_loss(hs, ws, None, ht, wt, None, beta=beta, temperature=temperature, chunk_size=chunk_size,
                            top_k=top_k).loss
    loss.backward()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak_kib = status_kib("VmHWM")
    if not reset and hwm_before > base_kib:
        print(f"warning: could not reset VmHWM; it was already {hwm_before - base_kib} KiB above RSS",
              file=sys.stderr)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in (hs, ws))
    growth_mib = (peak_kib - base_kib) / 1024
    return {"impl": impl, "n": n, "growth_mib": growth_mib, "extra_mib": growth_mib - grad_bytes / MiB,
            "seconds": seconds, "cpu_seconds": cpu_seconds, "loss": loss.item(),
            "grad_h_norm": hs.grad.double().norm().item(), "grad_w_norm": ws.grad.double().norm().item()}


def _run_worker(args: argparse.Namespace, impl: str, n: int, beta: float, top_k: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, "--n", str(n), "--v", str(args.v), "--h", str(args.h),
           "--teacher-h", str(args.teacher_h), "--beta", repr(beta), "--temperature", repr(args.temperature),
           "--top-k", str(top_k), "--chunk-size", str(args.chunk_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode:
        raise SystemExit(f"worker failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (n, value); through the origin for a single n."""
    if len({n for n, _ in points}) < 2:
        n, y = points[0]
        return 0.0, y / n
    mx = statistics.fmean(n for n, _ in points)
    my = statistics.fmean(y for _, y in points)
    slope = sum((n - mx) * (y - my) for n, y in points) / sum((n - mx) ** 2 for n, _ in points)
    return my - slope * mx, slope


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _summary(results: dict[tuple, list[dict]], key: tuple) -> dict:
    rs = results[key]
    return {k: statistics.median(r[k] for r in rs) for k in ("extra_mib", "growth_mib", "seconds", "cpu_seconds")}


def run(args: argparse.Namespace) -> bool:
    """Every configuration's table; False where the two losses disagree. Repeats are interleaved (each repeat runs
    every configuration and row count, naive then ours) so that other load on the machine spreads over both."""
    configs = [(b, k) for b in args.beta for k in args.top_k]
    sizes = sorted(set(args.naive_n) | {args.n})
    need = NAIVE_BUFFERS * max(args.naive_n) * args.v * 4
    avail = _available_bytes()
    if avail is not None and need > 0.9 * avail:
        raise SystemExit(f"the naive loss at {max(args.naive_n)} rows needs ~{need / 2**30:.1f} GiB, "
                         f"{avail / 2**30:.1f} GiB are available: lower --naive-n")
    results: dict[tuple, list[dict]] = {}
    for r in range(args.repeats):
        for beta, top_k in configs:
            for n in sizes:
                for impl in ("naive", "ours") if n in args.naive_n else ("ours",):
                    res = _run_worker(args, impl, n, beta, top_k)
                    results.setdefault((beta, top_k, n, impl), []).append(res)
                    print(f"  repeat {r + 1}/{args.repeats} beta={beta:g} top_k={top_k or '-'} N={n:6d} {impl:5s}: "
                          f"{res['extra_mib']:9.0f} MiB {res['seconds']:7.1f} s wall {res['cpu_seconds']:7.1f} s cpu"
                          f"  loss {res['loss']:.7g}", flush=True)

    ok = True
    for beta, top_k in configs:
        print(f"\nbeta={beta:g} temperature={args.temperature:g} top_k={top_k or 'none'}: V={args.v} "
              f"H={args.h} (teacher {args.teacher_h}), float32 CPU, chunk {args.chunk_size}, medians of "
              f"{args.repeats}")
        print(f"{'N':>6s} {'naive MiB':>10s} {'ours MiB':>9s} {'mem ratio':>9s} {'naive s':>8s} {'ours s':>7s} "
              f"{'wall ratio':>10s} {'naive cpu':>9s} {'ours cpu':>8s} {'cpu ratio':>9s} {'loss rel diff':>13s}")
        naive = {n: _summary(results, (beta, top_k, n, "naive")) for n in args.naive_n}
        for n in sizes:
            ours = _summary(results, (beta, top_k, n, "ours"))
            if n in naive:
                ref, note = naive[n], ""
                a, b = results[(beta, top_k, n, "naive")][0], results[(beta, top_k, n, "ours")][0]
                diffs = [_rel(b["loss"], a["loss"]), _rel(b["grad_h_norm"], a["grad_h_norm"]),
                         _rel(b["grad_w_norm"], a["grad_w_norm"])]
                agree = diffs[0] <= LOSS_RTOL and max(diffs[1:]) <= GRAD_RTOL
                ok &= agree
                check = f"{diffs[0]:13.1e}" + ("" if agree else f"  DISAGREE (grad norms {diffs[1]:.1e}, "
                                                                f"{diffs[2]:.1e})")
            else:
                fits = {k: _line([(m, naive[m][k]) for m in args.naive_n]) for k in ours}
                ref = {k: c + s * n for k, (c, s) in fits.items()}
                worst = max(abs(fits["extra_mib"][0] + fits["extra_mib"][1] * m - naive[m]["extra_mib"])
                            / naive[m]["extra_mib"] for m in args.naive_n)
                note = (f"  naive extrapolated (line through N = {', '.join(map(str, args.naive_n))}; worst memory "
                        f"residual {worst:.1%})")
                check = f"{'-':>13s}"
            print(f"{n:6d} {ref['extra_mib']:10.0f} {ours['extra_mib']:9.0f} "
                  f"{ours['extra_mib'] / ref['extra_mib']:9.3f} {ref['seconds']:8.1f} {ours['seconds']:7.1f} "
                  f"{ours['seconds'] / ref['seconds']:10.2f} {ref['cpu_seconds']:9.1f} {ours['cpu_seconds']:8.1f} "
                  f"{ours['cpu_seconds'] / ref['cpu_seconds']:9.2f} {check}{note}")
            if n == args.n and not args.small:
                mem, wall, cpu = (ours[k] / ref[k] for k in ("extra_mib", "seconds", "cpu_seconds"))
                met = mem <= GOAL_MEMORY and wall <= GOAL_TIME
                print(f"goal at N={n} (<= {GOAL_MEMORY:.3f} of the memory at <= {GOAL_TIME}x the time): memory "
                      f"{mem:.3f} (1/{1 / mem:.1f}), wall {wall:.2f}x, cpu {cpu:.2f}x: {'met' if met else 'MISSED'}")
    if args.small:
        print("\n--small: a smoke check; at these sizes start-up costs and noise swamp the ratios (goal not judged)")
    if not ok:
        print(f"\nFAIL: the losses disagree beyond a relative {LOSS_RTOL:g} (or the gradient norms beyond "
              f"{GRAD_RTOL:g})")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192, help="distilled rows (tokens)")
    p.add_argument("--v", type=int, default=131072, help="vocabulary size (both models)")
    p.add_argument("--h", type=int, default=256, help="the student's hidden size")
    p.add_argument("--teacher-h", type=int, default=256, help="the teacher's hidden size")
    p.add_argument("--beta", type=float, nargs="+", default=[0.5], help="one or more betas")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, nargs="+", default=[0], help="one or more top_k (0: none)")
    p.add_argument("--chunk-size", type=int, default=1024, help="distill_loss's rows per chunk")
    p.add_argument("--naive-n", type=int, nargs="+", default=[256, 512, 1024],
                   help="row counts the naive loss runs at (~8 MiB a row at V = 128k); extrapolated to --n")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="V=8192, N=1024, chunk 128, naive at 512 and 1024 rows, "
                                                        "one repeat: a smoke check in seconds")
    p.add_argument("--worker", choices=["naive", "ours"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.v, args.n, args.chunk_size, args.naive_n, args.repeats = 8192, 1024, 128, [512, 1024], 1

    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.v, args.h, args.teacher_h, args.beta[0], args.temperature,
                                args.top_k[0] or None, args.chunk_size)))
        return

    args.naive_n = sorted(set(args.naive_n))
    if args.naive_n[-1] > args.n:
        p.error(f"--naive-n {args.naive_n[-1]} exceeds --n {args.n}")
    print(f"CPU float32, N={args.n} V={args.v} H={args.h}/{args.teacher_h}, {torch.get_num_threads()} threads, "
          f"{args.repeats} repeats (fresh process each), naive at N = {', '.join(map(str, args.naive_n))}")
    t0 = time.perf_counter()
    ok = run(args)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
