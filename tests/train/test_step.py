"""finetune/train/step.py and the step's host syncs: a training step reads the device once (its loss, gradient norm and
metrics, with the previous step's update ratio), and nothing else in it waits for the device but transformers'
own packed-sequence check (once per forward, in create_causal_mask).

On a CPU nothing synchronizes, so the CPU test counts what would: the dispatched ops that read a tensor on the host
(`.item()`, `float()`, `int()`, `bool()` all reach `_local_scalar_dense`) or have an output shape that depends on
the values (`nonzero`, `bincount`, `masked_select`, `unique`), during the device part of the step (micro-batches
are prepared on the CPU before: collated, target positions and document boundaries found, copied). `.tolist()`
and `.cpu()` of a CPU tensor dispatch nothing, so the step's one read (step.read_step) is not seen there; the
CUDA test (`gpu`) counts every synchronization with torch.cuda.set_sync_debug_mode, that read included.
"""

from __future__ import annotations

import contextlib
import math
import traceback
import warnings

import pytest
import torch
from conftest import REPO_ROOT, TINY_MODEL_CONFIG
from torch.utils._python_dispatch import TorchDispatchMode

from finetune import dist
from finetune.batch import to_device
from finetune.data import eval_rows
from finetune.data.collate import collate
from finetune.data.pack import pack_samples
from finetune.loss.fused import resolve_impl
from finetune.metrics import WeightSamples, update_ratio, update_sums, weight_sample
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.objectives.sft import SFT
from finetune.recipe import AdapterConfig, DataConfig, LossConfig, ModelConfig, TokenizerConfig, TrainConfig
from finetune.train.optim import build_optimizer
from finetune.train.step import clip_gradients, forward_backward, read_step, step_counts

# Ops that make the host wait for a GPU (a read, or an output whose shape depends on the values).
SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.bincount.default",
           "aten.masked_select.default", "aten._unique2.default", "aten.unique_consecutive.default",
           "aten.equal.default"}


class _CountSyncs(TorchDispatchMode):
    """Records each syncing op with the innermost Python frame outside torch that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNCING:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            self.calls.append((str(func), f"{frames[-1].filename}:{frames[-1].lineno}:{frames[-1].name}"))
        return func(*args, **(kwargs or {}))


def _setup(device: torch.device, dtype: str = "float32", impl: str = "auto"):
    tokenizer = load_tokenizer(TokenizerConfig(path=str(REPO_ROOT / "examples" / "tokenizer")), ModelConfig())
    cfg = ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), dtype=dtype)
    lm = load_model(cfg, AdapterConfig(), tokenizer, seed=0).to(device)
    net = CausalLMWithLoss.for_recipe(lm, LossConfig(), resolve_impl(impl, device))
    optimizer = build_optimizer(lm.named_parameters(), TrainConfig(lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in torch.randint(8, 60, (40,), generator=gen).tolist():
        ids = torch.randint(3, 200, (n,), generator=gen).tolist()
        samples.append({"input_ids": ids, "labels": [-100, *ids[1:]]})
    rows, _ = pack_samples(samples, 128, seed=0)
    data = DataConfig(max_seq_len=128)
    return lm, net, optimizer, [collate(rows[i:i + 2], data, tokenizer.pad_token_id) for i in range(0, 12, 2)]


def _steps(device: torch.device, n_steps: int, accumulation: int, around_step,
           around_update=lambda i: contextlib.nullcontext(), impl: str = "auto") -> list[float]:
    """n_steps training steps as the trainer takes them (step.py, then the update, its ratio read one step late);
    `around_step(i)` is a context manager around step i's forward, backward, clipping and read, `around_update(i)`
    around its optimizer step and update ratio; `impl` the loss.impl. Returns the losses."""
    lm, net, optimizer, micro_batches = _setup(device, "bfloat16" if device.type == "cuda" else "float32", impl)
    params = [p for p in net.parameters() if p.requires_grad]
    samples = WeightSamples(params)
    world, objective, late, losses = dist.World(), SFT(), [], []
    for i in range(n_steps):
        micro = [b.to(device) for b in micro_batches[i * accumulation:(i + 1) * accumulation]]
        counts = step_counts(objective, micro, world, device)[0]
        with around_step(i):
            sums = forward_backward(net, objective, micro, counts, world, device)
            norm = clip_gradients(params, 1.0)
            figures = read_step(objective, sums, norm, counts, late)
            before = samples.take()
        with around_update(i):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            late = [samples.ratio(before)]
        assert figures.healthy(counts) and math.isfinite(figures.grad_norm)
        losses.append(figures.loss)
    return losses


def test_nothing_in_a_step_would_wait_for_the_device_but_transformers_packed_check():
    counters = []

    def count(_):
        counters.append(_CountSyncs())
        return counters[-1]

    # Not counted here: the optimizer step (torch's AdamW keeps its step counts on the host unless fused, as it is
    # on CUDA) and the update ratio (test_update_sums_stay_on_the_device...); the CUDA test counts both.
    _steps(torch.device("cpu"), n_steps=3, accumulation=2, around_step=count)
    for counter in counters:
        # create_causal_mask looks for packed sequences in position_ids with one read per forward (transformers'
        # find_packed_sequence_indices); nothing of ours reads the device.
        assert len(counter.calls) == 2, counter.calls
        assert all(where.split(":")[0].endswith("transformers/masking_utils.py") and where.endswith(
            ":find_packed_sequence_indices") for _, where in counter.calls), \
            counter.calls


def _liger_step_syncs() -> tuple[list[float], list[list[tuple[str, str]]]]:
    """In the interpreter's child process (conftest.interpreted): a step of 2 micro-batches with loss.impl liger,
    its syncing ops counted as above; with its loss."""
    counters = []

    def count(_):
        counters.append(_CountSyncs())
        return counters[-1]

    losses = _steps(torch.device("cpu"), n_steps=1, accumulation=2, around_step=count, impl="liger")
    return losses, [c.calls for c in counters]


def test_liger_reads_the_device_twice_per_micro_batch(interpreted):
    """Liger's fused loss (under Triton's interpreter on the CPU: its own Python code runs as on CUDA) reads the
    device twice per micro-batch: `.item()` of its target count in the forward, `torch.equal(grad_output, 1.0)` in
    the backward (on CUDA the scalar 1.0 it compares with is also copied to the device each time). So loss.impl
    auto is chunked on CUDA too, where a step with it reads the device once (above). The same losses as chunked."""
    losses, steps = interpreted(_liger_step_syncs)
    assert len(steps) == 1
    for calls in steps:
        liger = [(op, where) for op, where in calls if "/liger_kernel/" in where]
        rest = [where for _, where in calls if "/liger_kernel/" not in where]
        assert [op for op, _ in liger] == ["aten._local_scalar_dense.default", "aten.equal.default"] * 2, calls
        assert liger[0][1].endswith(":fused_linear_cross_entropy_forward"), liger
        assert liger[1][1].endswith(":fused_linear_cross_entropy_backward"), liger
        assert len(rest) == 2 and all(w.endswith(":find_packed_sequence_indices") for w in rest), calls
    chunked = _steps(torch.device("cpu"), n_steps=1, accumulation=2, around_step=lambda i: contextlib.nullcontext())
    assert losses == pytest.approx(chunked, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_step_synchronizes_once_plus_transformers_packed_check():
    """Under torch.cuda.set_sync_debug_mode("warn") every synchronizing call warns: a step of 2 micro-batches makes
    at most 3 (its one read, and transformers' packed-sequence check once per forward), after a first step that
    may initialize state."""
    device = torch.device("cuda")
    counts: list[int] = []

    class _Warned:
        def __init__(self, i: int) -> None:
            self.catch = warnings.catch_warnings(record=True)

        def __enter__(self):
            self.seen = self.catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

        def __exit__(self, *exc):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in self.seen))
            return self.catch.__exit__(*exc)

    _steps(device, n_steps=3, accumulation=2, around_step=_Warned, around_update=_Warned)
    per_step = [a + b for a, b in zip(counts[0::2], counts[1::2])]
    assert all(n <= 3 for n in per_step[1:]), counts


def test_weight_samples_cost_a_few_ops_whatever_the_number_of_tensors():
    """The update ratio of WeightSamples (what the trainer takes): the per-tensor figure's meaning (rel 1e-6), no
    host read, its views made once and following in-place updates, and ~15 ops a step for 3 or 30 tensors (the
    per-tensor samples took ~7 per tensor)."""
    gen = torch.Generator().manual_seed(0)
    ops = {}
    for n in (3, 30):
        params = [torch.randn(100, generator=gen), torch.randn(300, 100, generator=gen),
                  *(torch.randn(50, 40, generator=gen) for _ in range(n - 2))]
        samples = WeightSamples(params)
        with _CountOps() as counter:
            before = samples.take()
            with torch.no_grad():
                for p in params:
                    p.mul_(1.01)
            ratio = samples.ratio(before)
        ops[n] = counter.count - n  # the test's own in-place updates left out
        assert counter.syncs == [] and ratio.dtype == torch.float64
        assert float(ratio) == pytest.approx(0.01, rel=1e-5)
        per_tensor = [weight_sample(p) for p in params]
        assert samples._views is not None and all(v.data_ptr() == w.data_ptr() for v, w in zip(samples._views,
                                                                                                   per_tensor))
    assert ops[3] == ops[30] <= 16, ops
    # A weight whose flattening is a copy (not contiguous) is sampled afresh each time, never frozen.
    odd = torch.randn(40, 30).t()
    samples = WeightSamples([odd])
    before = samples.take()
    odd.mul_(2.0)
    assert samples._views is None and float(samples.ratio(before)) == pytest.approx(1.0, rel=1e-6)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count, self.syncs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if str(func) in SYNCING:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def test_update_sums_stay_on_the_device_and_keep_their_meaning():
    small, big = torch.randn(100), torch.randn(3000, 1000)
    before = [weight_sample(p).to(torch.float32, copy=True) for p in (small, big)]
    with torch.no_grad():
        small.mul_(1.01)
        big.mul_(1.01)
    with _CountSyncs() as counter:
        sums = update_sums(before, [small, big])
        ratio = update_ratio(before, [small, big])
    assert counter.calls == [] and isinstance(ratio, torch.Tensor) and ratio.dtype == torch.float64
    # The former per-tensor float() sums: the same figures up to the summation order (float32 sums, last bits).
    delta = sum(float((weight_sample(p).float() - b).pow(2).sum()) for p, b in zip((small, big), before))
    norm = sum(float(b.pow(2).sum()) for b in before)
    assert sums.tolist() == pytest.approx([delta, norm], rel=1e-6)
    assert float(ratio) == pytest.approx(0.01, rel=1e-5)


# --- eval: micro-batches copied without blocking, the device read once ----------------------------------------------

class _HostTensor:
    """A CPU tensor as to_device sees it, recording what is done to it."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list = []

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, target, non_blocking=False):
        self.calls.append((torch.device(target), non_blocking))
        return self


def test_copies_to_cuda_come_from_pinned_memory_without_blocking():
    tensor = _HostTensor()
    assert to_device(tensor, "cuda") is tensor
    assert tensor.calls == ["pin_memory", (torch.device("cuda"), True)]
    tensor = _HostTensor()
    to_device(tensor, "cpu")
    assert tensor.calls == [(torch.device("cpu"), False)]  # a CPU run copies nothing it need not pin


class _CountHostValues(TorchDispatchMode):
    """Tensors made from host values (torch.tensor: aten.lift_fresh) by evaluate.py's own lines: on CUDA each is a
    blocking copy to the device, a sync."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) == "aten.lift_fresh.default":
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            if frames[-1].filename.endswith("finetune/train/evaluate.py"):
                self.calls.append(f"{frames[-1].lineno}:{frames[-1].line}")
        return func(*args, **(kwargs or {}))


def test_eval_moves_each_micro_batch_once_without_blocking_and_puts_counts_on_the_device_once(tmp_path, monkeypatch):
    """evaluate_loss moves every micro-batch through MicroBatch.to (to_device: pinned, non_blocking on CUDA) and
    makes one tensor of host values for the whole eval, not one per micro-batch (before: a blocking copy of each
    count, per micro-batch); the loss is the sum of token losses over the target tokens, as before."""
    from conftest import tiny_recipe

    from finetune import batch as batch_module
    from finetune.recipe import validate
    from finetune.train.evaluate import evaluate_loss

    lm, net, _, micro_batches = _setup(torch.device("cpu"))
    recipe = validate({**tiny_recipe(tmp_path / "run", REPO_ROOT / "examples" / "data" / "quickstart_eval.jsonl"),
                       "data": {"max_seq_len": 128, "packing": True}})
    gen = torch.Generator().manual_seed(1)
    samples = []
    for n in torch.randint(8, 60, (24,), generator=gen).tolist():
        ids = torch.randint(3, 200, (n,), generator=gen).tolist()
        samples.append({"input_ids": ids, "labels": [-100, *ids[1:]]})
    moved = []
    real = batch_module.to_device
    monkeypatch.setattr(batch_module, "to_device", lambda t, d: moved.append(t.shape) or real(t, d))
    results = {}
    for micro in (2, 4):
        moved.clear()
        with _CountHostValues() as counter:
            results[micro] = evaluate_loss(SFT(), net, samples, recipe, micro, 0, dist.World(), torch.device("cpu"))
        assert len(counter.calls) == 1, counter.calls  # the counts, once, after the last micro-batch
        rows = len(eval_rows(samples, recipe.data))
        assert sum(1 for shape in moved if len(shape) == 2 and shape[0] <= micro) >= 2 * -(-rows // micro)
    assert results[2].counts == results[4].counts and results[2].counts["tokens"] > 0
    assert results[2].loss == pytest.approx(results[4].loss, rel=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 1e9, math.inf])
@pytest.mark.parametrize("mixed", [False, True])
def test_clip_gradients_is_torch_clip_grad_norm_bit_for_bit(max_norm, mixed):
    """clip_gradients' own path (one device and dtype: fewer host steps) gives torch's clip_grad_norm_ numbers
    exactly: the pre-clip norm and the clipped gradients; mixed dtypes take clip_grad_norm_ itself."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (300,), (2, 3, 4), (1,)]

    def params():
        gen.manual_seed(0)
        dtypes = [torch.float32, torch.float64 if mixed else torch.float32, torch.float32, torch.float32]
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=d)) for s, d in zip(shapes, dtypes)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 3
        return ps + [torch.nn.Parameter(torch.zeros(3))]  # one without a gradient

    ours, theirs = params(), params()
    norm = clip_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(norm, expected) and norm.dtype == expected.dtype
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs) if a.grad is not None)
