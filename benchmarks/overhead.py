"""Host overhead of our training step against a plain torch loop, measured on a CPU stand-in for CUDA.

    .venv/bin/python benchmarks/overhead.py            # ~1 minute on a loaded 2-core CPU
    .venv/bin/python benchmarks/overhead.py --ops      # and the aten ops where ours and the plain loop differ

On a GPU the host only queues work: whatever the host spends per micro-batch and per step beyond what the device
needs is time the device may wait, most of all with small models and short rows. This measures that host time
where compute is negligible (a 2-layer Llama of width 32, rows of 64 tokens, float32, one thread), for:
  * ours: the trainer's step as finetune/train/loop.py takes it (micro-batches moved with MicroBatch.to, the step's
    counts, forward_backward, clipping, the one read, the weight samples, the optimizer, the scheduler and the
    update ratio; tests/train/test_step.py mirrors the same body), with the packed rows' documents and our attention;
  * plain: a minimal loop on the same model and micro-batches (transformers' sdpa, its own loss: forward, loss,
    backward, AdamW).
Each takes the optimizer it would run on CUDA: ours build_optimizer's fused AdamW, the plain loop torch's default
there, foreach (`--plain-fused`: fused too, the strictest comparison). Our attention takes its CUDA path (kernel
choice, varlen wrapper, one kernel call per layer) with torch's varlen_attn replaced by a stand-in of its torch 2.13
signature: causal attention over each row in one op, as many attention ops as the plain loop's sdpa (it does not
isolate documents: this measures overhead only; tests/attention/test_packed_kernels.py checks isolation with stand-ins that
do). Like torch's varlen_attn (torch_attn::_varlen_attn) the stand-in is a torch.library custom op with its
backward registered, so each call pays that Python path's host time as on CUDA; `--standin function` measures
without it (a plain function, as in the issue's first measurement).

The micro-batches are packed rows of exactly 64 tokens, 1-4 documents each. A sweep over micro-batch size m (1, 2,
4) and accumulation A (1, 2, 4, 8) fits step time T = a + b A + c A m by least squares on the medians (relative
errors): b is the fixed cost per micro-batch, a the fixed cost per step (c: per row). The aten ops of one step
(counted with a TorchDispatchMode) are fitted the same way. Timings depend on the machine and its load: compare
the columns of one run. Steps are timed by this thread's CPU time by default (`--clock wall`: elapsed time), which
other processes on a shared machine barely disturb; the rounds alternate which trainer goes first; the 90% intervals
of the ratios come from resampling the rounds (a bootstrap).

Why the per-step part is also timed directly: the fit puts into a whatever a step costs once, wherever in the step
it falls, and at this scale much of that is the caches. A step that follows the other trainer's step finds its own
code cold, and ours (more Python per step: the moves, the attention's dispatch, the fused loss) paid 0.3-0.5 ms
more for it than the plain loop, all of it landing in a (issue 23's ~2.1x, against equal work after the backward).
A training run repeats its own step, so each timed step now follows `--warmup` (default 1) untimed steps of the
same trainer and configuration (`--warmup 0`: the old measurement). What still lands in a is not work after the
backward: ours' first micro-batch of a step runs slower than the later ones (its first move, MicroBatch.to, finds
numpy cold after the optimizer: ~0.3 ms here; in the trainer the collate just before it warms that code), and the
plain loop's cost per micro-batch grows a little with A, so that its fitted a comes out below its own per-step part
timed directly. Either way a's ratio (1.8-2.0x at --warmup 1) says little about the work done once per step. So
the report adds the per-step part timed inside each step (Ours.step, Plain.step): ours the step's counts and
everything after the backward (clipping, the read, the weight samples, the optimizer, the scheduler, the update
ratio), the plain loop its optimizer step and zero_grad; only forward_backward's final sum of the loss terms
(three ops) is left in the micro-batch part. Targets (issue 23): ours <= 1.2x the plain loop's fixed cost per micro-batch and per
step, and <= 1.2x its aten ops per step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without an editable install
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from finetune import dist  # noqa: E402
from finetune.attention import dispatch  # noqa: E402
from finetune.attention import kernels as packed_kernels  # noqa: E402
from finetune.data.collate import collate_packed  # noqa: E402
from finetune.loss.fused import resolve_impl  # noqa: E402
from finetune.metrics import WeightSamples  # noqa: E402
from finetune.model.with_loss import CausalLMWithLoss  # noqa: E402
from finetune.objectives.sft import SFT  # noqa: E402
from finetune.recipe import LossConfig, TrainConfig  # noqa: E402
from finetune.train.optim import build_scheduler, parameter_groups  # noqa: E402
from finetune.train.step import clip_gradients, forward_backward, read_step, step_counts  # noqa: E402

CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
SEQ = 64
MICRO = (1, 2, 4)
ACCUM = (1, 2, 4, 8)
DEVICE = torch.device("cpu")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[T, h, d] -> [T / SEQ rows, h, SEQ, d], a view (the CPU flash kernel takes fewer key/value heads itself)."""
    return t.view(t.shape[0] // SEQ, SEQ, t.shape[1], t.shape[2]).transpose(1, 2)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[rows, h, SEQ, d] -> [T, h, d]."""
    return t.transpose(1, 2).reshape(t.shape[0] * SEQ, t.shape[1], t.shape[3])


# One op forward and one backward, as torch's varlen_attn (a custom op, torch_attn::_varlen_attn, with its backward
# registered) shows to the dispatcher: the stand-in's own reshaping must not count as our overhead. Inside, the
# CPU's flash attention kernels over each row, as the plain loop's sdpa runs them.
@torch.library.custom_op("finetune_bench::varlen", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_rows(q), _rows(k), _rows(v), 0.0, True,
                                                                          scale=scale)
    return _flat(out), lse


@_varlen_op.register_fake
def _(q, k, v, scale):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[0] // SEQ, q.shape[1], SEQ)


@torch.library.custom_op("finetune_bench::varlen_backward", mutates_args=())
def _varlen_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _rows(grad), _rows(q), _rows(k), _rows(v), _rows(out), lse, 0.0, True, scale=scale)
    return tuple(_flat(t) for t in grads)


@_varlen_backward_op.register_fake
def _(grad, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.scale = inputs[3]


def _backward(ctx, grad, _grad_lse):
    return (*_varlen_backward_op(grad, *ctx.saved_tensors, ctx.scale), None)


_varlen_op.register_autograd(_backward, setup_context=_save)


def varlen_standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn signature; causal attention over each row (not each document) in one op."""
    return _varlen_op(query, key, value, scale if scale is not None else query.shape[-1] ** -0.5)[0]


def varlen_function(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """The same as a plain function (sdpa over each row, its ops visible): without torch.library's Python custom-op
    path, which torch's varlen_attn takes on each call (forward and backward), as varlen_standin does."""
    heads = query.shape[1]
    q, k, v = (t.view(t.shape[0] // SEQ, SEQ, t.shape[1], t.shape[2]).transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != heads)
    return out.transpose(1, 2).reshape(query.shape[0], heads, value.shape[-1])


def use_varlen_standin(custom_op: bool = True) -> None:
    """Our attention takes its CUDA path on the CPU: varlen_attn applies (kernel choice, wrapper), the stand-in runs.
    A benchmark's own patch of our code, never done by the product."""
    standin = varlen_standin if custom_op else varlen_function
    packed_kernels._varlen_attn = lambda: standin
    packed_kernels.varlen_problem = lambda *args, **kwargs: None
    if hasattr(packed_kernels, "choose"):
        packed_kernels.choose.cache_clear()


def micro_batches(count: int, size: int) -> list:
    """`count` packed micro-batches of `size` rows of SEQ tokens, each row 1-4 documents, collated on the CPU."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count * size):
        cuts = sorted((torch.randperm(SEQ - 1, generator=gen)[:int(torch.randint(0, 4, (1,), generator=gen))] + 1)
                      .tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, SEQ])]
        ids = torch.randint(3, CONFIG["vocab_size"], (SEQ,), generator=gen).tolist()
        starts = {sum(lengths[:i]) for i in range(len(lengths))}
        rows.append({"input_ids": ids, "labels": [-100 if i in starts else t for i, t in enumerate(ids)],
                     "position_ids": [p for n in lengths for p in range(n)]})
    return [collate_packed(rows[i * size:(i + 1) * size], pad_token_id=0) for i in range(count)]


def model(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG), attn_implementation=attn)
    return lm.train()


class Ours:
    """The trainer's step (finetune/train/loop.py train_loop), its metrics line aside."""

    def __init__(self) -> None:
        self.lm = model(dispatch.ATTN_NAME)
        self.net = CausalLMWithLoss.for_recipe(self.lm, LossConfig(), resolve_impl("auto", DEVICE)).train()
        cfg = TrainConfig(lr=1e-4, max_steps=10**6)
        self.optimizer = torch.optim.AdamW(parameter_groups(self.lm.named_parameters(), cfg.weight_decay),
                                           lr=cfg.lr, fused=True)  # what build_optimizer takes on CUDA
        self.scheduler = build_scheduler(self.optimizer, 10**6, cfg)
        self.objective, self.world, self.pending = SFT(), dist.World(), []
        self.params = [p for p in self.net.parameters() if p.requires_grad]  # Run.params: listed once
        self.samples = WeightSamples(self.params)

    def step(self, micro: list, now: Callable[[], float] = time.thread_time) -> float:
        """One step; returns the seconds (by `now`) of its per-step part: the counts, and all after the backward."""
        micro = [b.to(DEVICE) for b in micro]
        began = now()
        counts = step_counts(self.objective, micro, self.world, DEVICE)[0]
        counted = now() - began
        sums = forward_backward(self.net, self.objective, micro, counts, self.world, DEVICE)
        began = now()
        norm = clip_gradients(self.params, 1.0)
        figures = read_step(self.objective, sums, norm, counts, self.pending)
        healthy = figures.healthy(counts)
        before = self.samples.take() if healthy else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.get_last_lr()
        self.scheduler.step()
        self.pending = [self.samples.ratio(before)] if before is not None else []
        return counted + now() - began


class Plain:
    """A minimal loop: forward with transformers' sdpa and its own loss, backward, AdamW as torch makes it on CUDA
    by default (foreach; `fused`: the fused kernel, as ours)."""

    def __init__(self, fused: bool = False) -> None:
        self.lm = model("sdpa")
        self.optimizer = torch.optim.AdamW(self.lm.parameters(), lr=1e-4, **({"fused": True} if fused else
                                                                              {"foreach": True}))

    def step(self, micro: list, now: Callable[[], float] = time.thread_time) -> float:
        """One step; returns the seconds (by `now`) of its per-step part: all after the backward."""
        for batch in micro:
            ids, labels = batch.input_ids.to(DEVICE), batch.labels.to(DEVICE)
            loss = self.lm(input_ids=ids, labels=labels, use_cache=False).loss
            (loss / len(micro)).backward()
        began = now()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return now() - began


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def fit(points: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """(a, b, c) of y = a + b A + c A m, least squares over the (m, A) points in relative terms (each weighed by
    1 / y: a step's noise grows with its length, and the long steps would otherwise decide the intercept)."""
    keys = sorted(points)
    w = torch.tensor([[1.0 / points[k]] for k in keys], dtype=torch.float64)
    x = torch.tensor([[1.0, a, a * m] for m, a in keys], dtype=torch.float64)
    y = torch.tensor([[points[k]] for k in keys], dtype=torch.float64)
    return tuple(torch.linalg.lstsq(x * w, y * w).solution.flatten().tolist())


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def measure(rounds: int, plain_fused: bool, clock: str = "cpu", warmup: int = 1) -> dict[str, Any]:
    """Every configuration's step times, and the per-step part of each (Ours.step, Plain.step), `rounds` times
    per trainer; each timed step after `warmup` untimed steps of the same trainer and configuration."""
    trainers = {"ours": Ours(), "plain": Plain(plain_fused)}
    batches = {(m, a): micro_batches(a, m) for m in MICRO for a in ACCUM}
    times: dict[str, dict[tuple[int, int], list[float]]] = {name: {k: [] for k in batches} for name in trainers}
    parts: dict[str, dict[tuple[int, int], list[float]]] = {name: {k: [] for k in batches} for name in trainers}
    ops: dict[str, dict[tuple[int, int], Counter[str]]] = {name: {} for name in trainers}
    for name, trainer in trainers.items():  # warm up, then count one step's ops per configuration
        for key, micro in batches.items():
            trainer.step(micro)
            with CountOps() as counter:
                trainer.step(micro)
            ops[name][key] = counter.ops
    order, now = list(trainers.items()), CLOCKS[clock]
    for _ in range(rounds):  # interleaved, so that load on the machine falls on both alike
        for key, micro in batches.items():
            order.reverse()  # each goes first as often as the other
            for name, trainer in order:
                for _ in range(warmup):  # a training run repeats its step: the timed one finds its code warm
                    trainer.step(micro, now)
                began = now()
                parts[name][key].append(trainer.step(micro, now))
                times[name][key].append(now() - began)
    return {"times": times, "parts": parts, "ops": ops, "clock": clock, "warmup": warmup}


def medians(times: dict[str, dict[tuple[int, int], list[float]]],
            rounds: list[int] | None = None) -> dict[str, dict[tuple[int, int], float]]:
    """Each trainer's median step time per configuration, over `rounds` (indices, repeats allowed; default all)."""
    pick = (lambda v: v) if rounds is None else (lambda v: [v[i] for i in rounds])
    return {name: {k: statistics.median(pick(v)) for k, v in by_key.items()} for name, by_key in times.items()}


def direct(parts: dict[str, dict[tuple[int, int], list[float]]],
           rounds: list[int] | None = None) -> dict[str, float]:
    """Each trainer's per-step part timed directly: the median over the configurations of its medians."""
    return {name: statistics.median(by_key.values()) for name, by_key in medians(parts, rounds).items()}


def ratio_intervals(times: dict[str, dict[tuple[int, int], list[float]]],
                    parts: dict[str, dict[tuple[int, int], list[float]]], resamples: int = 400,
                    seed: int = 0) -> list[tuple[float, float]]:
    """90% intervals of ours / plain for the fitted fixed costs (per micro-batch b, per step a) and the per-step part
    timed directly: the rounds resampled with replacement (a bootstrap; a round holds every configuration of both
    trainers, measured side by side), the fit of the medians redone on each resample."""
    n = len(next(iter(times["ours"].values())))
    gen = torch.Generator().manual_seed(seed)
    samples: list[list[float]] = [[], [], []]
    for _ in range(resamples):
        rounds = torch.randint(0, n, (n,), generator=gen).tolist()
        fits = {name: fit(v) for name, v in medians(times, rounds).items()}
        for j, i in enumerate((1, 0)):
            samples[j].append(fits["ours"][i] / fits["plain"][i] if fits["plain"][i] > 0 else math.inf)
        timed = direct(parts, rounds)
        samples[2].append(timed["ours"] / timed["plain"])
    return [(q(s, 0.05), q(s, 0.95)) for s in samples]


def q(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def report(result: dict[str, Any], show_ops: bool) -> None:
    times, ops = result["times"], result["ops"]
    middle = medians(times)
    rounds = len(next(iter(times["ours"].values())))
    print(f"step time medians ({result['clock']} clock, ms) of {rounds} rounds, each after {result['warmup']} untimed; "
          f"rows of {SEQ} tokens; m = micro-batch rows, A = accumulation")
    print("   m   A     ours    plain   ratio")
    for key in sorted(middle["ours"]):
        ours, plain = middle["ours"][key] * 1e3, middle["plain"][key] * 1e3
        print(f"{key[0]:4d}{key[1]:4d} {ours:8.2f} {plain:8.2f} {ours / plain:7.2f}x")
    t = {name: fit(v) for name, v in middle.items()}
    o = {name: fit({k: float(sum(c.values())) for k, c in by_key.items()}) for name, by_key in ops.items()}
    intervals = ratio_intervals(times, result["parts"])
    print("\nfitted (T = a + b A + c A m)            ours      plain    ratio  (90% interval)  target")
    rows = [("fixed per micro-batch (ms), b", 1, t, 1e3), ("fixed per step (ms), a", 0, t, 1e3),
            ("per row (ms), c", 2, t, 1e3), ("aten ops per micro-batch, b", 1, o, 1),
            ("aten ops fixed per step, a", 0, o, 1), ("aten ops per row, c", 2, o, 1)]
    for label, i, fits, scale in rows:
        ours, plain = fits["ours"][i] * scale, fits["plain"][i] * scale
        ratio = ours / plain if plain > 0 else math.nan
        timed = fits is t and i < 2
        interval = f"({intervals[1 - i][0]:5.2f}-{intervals[1 - i][1]:5.2f}x)" if timed else " " * 14
        print(f"{label:38s}{ours:9.2f}{plain:11.2f}{ratio:8.2f}x  {interval}  {'<= 1.2x' if timed else ''}")
    timed = direct(result["parts"])
    low, high = intervals[2]
    print(f"{'per-step part timed directly (ms)':38s}{timed['ours'] * 1e3:9.2f}{timed['plain'] * 1e3:11.2f}"
          f"{timed['ours'] / timed['plain']:8.2f}x  ({low:5.2f}-{high:5.2f}x)  <= 1.2x")
    per_step = {name: {k: sum(c.values()) for k, c in by_key.items()} for name, by_key in ops.items()}
    worst = max(per_step["ours"][k] / per_step["plain"][k] for k in per_step["ours"])
    print(f"aten ops per step, ours / plain: {worst:.2f}x at worst over the sweep (target <= 1.2x)")
    if show_ops:
        key = (2, 4)
        diff = Counter(ops["ours"][key])
        diff.subtract(ops["plain"][key])
        print(f"\naten ops of one step (m={key[0]}, A={key[1]}), ours - plain, largest differences:")
        for op, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:30]:
            print(f"{n:+6d}  {op}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed steps per configuration and trainer")
    parser.add_argument("--ops", action="store_true", help="list the aten ops where ours and the plain loop differ")
    parser.add_argument("--standin", choices=("custom-op", "function"), default="custom-op",
                        help="varlen_attn's stand-in: through torch.library's custom-op path as torch's own (default), "
                             "or a plain function")
    parser.add_argument("--plain-fused", action="store_true",
                        help="the plain loop with fused AdamW (as ours) instead of torch's default on CUDA (foreach)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                        help="cpu: this thread's CPU time (the host's work, as good as unaffected by other processes "
                             "on a shared machine; torch runs on this one thread here); wall: elapsed time")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps of the same trainer and configuration before each timed one (0: none, "
                             "each timed step then follows the other trainer's and pays for the switch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dispatch.register()
    use_varlen_standin(args.standin == "custom-op")
    report(measure(args.rounds, args.plain_fused, args.clock, args.warmup), args.ops)


if __name__ == "__main__":
    main()
