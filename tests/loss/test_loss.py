"""finetune.loss.fused: the chunked fused linear cross-entropy against the naive reference (and Liger on a GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from finetune.errors import UserError
from finetune.loss.fused import (
    IGNORE_INDEX,
    IMPLS,
    describe_impl,
    linear_cross_entropy,
    resolve_impl,
    shift_labels,
)
from finetune.loss.liger import triton_interpreter

REPO = Path(__file__).resolve().parents[2]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "",
                 floor: float = 0.0) -> None:
    """max |actual - expected| <= rel * max(max |expected|, max |actual|, floor): one scale for the whole
    tensor, so tiny entries are not held to a relative tolerance they cannot meet.

    floor is the natural magnitude of the quantity. It matters when the values are much smaller than that
    through cancellation: for a confident prediction d(loss)/d(logit_y) = p_y - 1 is tiny, and in fp32 every
    implementation (the reference included) gets it only to ~1e-7 absolute, not relative."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = actual.detach().double(), expected.detach().double()
    diff = (a - e).abs().max().item() if a.numel() else 0.0
    scale = max(a.abs().max().item(), e.abs().max().item()) if a.numel() else 0.0
    scale = max(scale, floor)
    assert diff <= rel * scale, f"{what}: max abs diff {diff:.3e} > {rel:.0e} * scale {scale:.3e}"


def natural_scales(hidden, weight, bias, labels, grad_scale: float = 1.0) -> dict[str, float]:
    """Magnitudes the loss and gradients are built from, before cancellation: a per-token loss of order 1,
    rows of W (for d/dhidden), target hidden rows (for d/dW), softmax probabilities (for d/dbias)."""
    keep = shift_labels(labels) != IGNORE_INDEX
    n = int(keep.sum())
    rows = hidden.detach()[keep]
    return {
        "loss_sum": float(n),
        "hidden": abs(grad_scale) * weight.detach().abs().max().item(),
        "weight": abs(grad_scale) * (rows.abs().max().item() if n else 0.0),
        "bias": abs(grad_scale) * (1.0 if n else 0.0),
    }


def make_inputs(seed: int, b: int | None, t: int, h: int, v: int, dtype: torch.dtype, bias: bool,
                mask_p: float = 0.3, masked_rows: tuple[int, ...] = ()):
    """Random hidden/weight/bias (requiring grad) and unshifted labels with IGNORE_INDEX holes.

    b=None gives the unbatched [T, H] / [T] form."""
    g = torch.Generator().manual_seed(seed)
    shape = (t,) if b is None else (b, t)
    hidden = torch.randn(*shape, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5 * 3).to(dtype).requires_grad_()
    bias_t = torch.randn(v, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, shape, generator=g)
    labels[torch.rand(shape, generator=g) < mask_p] = IGNORE_INDEX
    for row in masked_rows:
        if b is not None and row < b:
            labels[row] = IGNORE_INDEX
    return hidden, weight, bias_t, labels


def loss_and_grads(impl: str, hidden, weight, bias, labels, chunk_size=1024, z_loss=0.0, softcap=None, scale=1.0):
    loss, n = linear_cross_entropy(hidden, weight, labels, bias, impl=impl, chunk_size=chunk_size, z_loss=z_loss,
                                   softcap=softcap)
    inputs = [x for x in (hidden, weight, bias) if x is not None and x.requires_grad]
    grads = torch.autograd.grad(loss * scale, inputs) if inputs else ()
    return loss, n, grads


# ------------------------------------------------------------------------------------------------------------
# chunked == torch, property based


@settings(max_examples=120, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.one_of(st.none(), st.integers(1, 3)),
    t=st.integers(1, 24),
    h=st.integers(1, 16),
    v=st.integers(2, 50),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    bias=st.booleans(),
    mask_p=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    masked_rows=st.lists(st.integers(0, 2), max_size=2).map(tuple),
    chunk_size=st.one_of(st.sampled_from([1, 2, 3, 7, 16]), st.integers(1, 100), st.just(4096)),
    z_loss=st.sampled_from([0.0, 1e-4, 0.1]),
    softcap=st.sampled_from([None, 1.0, 5.0, 30.0]),
    grad_scale=st.sampled_from([1.0, 0.25, -3.0]),
)
def test_chunked_matches_torch(seed, b, t, h, v, dtype, bias, mask_p, masked_rows, chunk_size, z_loss, softcap,
                               grad_scale):
    hidden, weight, bias_t, labels = make_inputs(seed, b, t, h, v, dtype, bias, mask_p, masked_rows)
    ref_loss, ref_n, ref_grads = loss_and_grads("torch", hidden, weight, bias_t, labels, z_loss=z_loss,
                                                softcap=softcap, scale=grad_scale)
    loss, n, grads = loss_and_grads("chunked", hidden, weight, bias_t, labels, chunk_size=chunk_size,
                                    z_loss=z_loss, softcap=softcap, scale=grad_scale)
    rel = 1e-5 if dtype == torch.float32 else 1e-10
    floors = natural_scales(hidden, weight, bias_t, labels, grad_scale)
    assert n.dtype == torch.int64 and n.item() == ref_n.item() == int((shift_labels(labels) != IGNORE_INDEX).sum())
    assert loss.dtype == ref_loss.dtype == (torch.float32 if dtype == torch.float32 else torch.float64)
    assert_close(loss, ref_loss, rel, "loss_sum", floors["loss_sum"])
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, rg, rel, f"grad {name}", floors[name])


def test_gradcheck_chunked_float64():
    hidden, weight, bias, labels = make_inputs(3, 2, 5, 4, 7, torch.float64, bias=True, mask_p=0.3)

    for z_loss, softcap in ((0.0, None), (0.05, 2.0)):
        def f(hd, w, bs, z_loss=z_loss, softcap=softcap):
            return linear_cross_entropy(hd, w, labels, bs, impl="chunked", chunk_size=3, z_loss=z_loss,
                                        softcap=softcap)[0]

        assert torch.autograd.gradcheck(f, (hidden, weight, bias), eps=1e-6, atol=1e-8, rtol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# semantics


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3, 4], [5, IGNORE_INDEX, 7, 8]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 7, 8, IGNORE_INDEX]]
    assert shift_labels(torch.tensor([9])).tolist() == [IGNORE_INDEX]
    assert shift_labels(torch.tensor([1, 2])).tolist() == [2, IGNORE_INDEX]
    assert shift_labels(torch.zeros(2, 3, 0, dtype=torch.long)).shape == (2, 3, 0)
    original = labels.clone()
    shift_labels(labels)
    assert torch.equal(labels, original)  # does not modify its input


@pytest.mark.parametrize("impl", ["torch", "chunked"])
def test_loss_is_the_shifted_token_sum(impl):
    """Position t's hidden state is scored against labels[t + 1]; ignored targets contribute nothing."""
    hidden, weight, bias, labels = make_inputs(11, 2, 6, 5, 9, torch.float64, bias=True, mask_p=0.3)
    labels[0, 0] = 4  # position 0's label is never a target (nothing predicts it)
    loss, n = linear_cross_entropy(hidden, weight, labels, bias, impl=impl, chunk_size=2)
    expected, count = 0.0, 0
    for bi in range(2):
        for t in range(5):
            target = int(labels[bi, t + 1])
            if target == IGNORE_INDEX:
                continue
            with torch.no_grad():
                logp = F.log_softmax(hidden[bi, t] @ weight.T + bias, dim=-1)
            expected -= logp[target].item()
            count += 1
    assert n.item() == count
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_sum_over_micro_batches_equals_one_batch():
    """The trainer's contract: sums and counts add up across micro-batches."""
    hidden, weight, bias, labels = make_inputs(5, 3, 10, 8, 20, torch.float64, bias=False)
    full, n_full = linear_cross_entropy(hidden, weight, labels, impl="chunked", chunk_size=4)
    parts = [linear_cross_entropy(hidden[i : i + 1], weight, labels[i : i + 1], impl="chunked", chunk_size=4)
             for i in range(3)]
    assert sum(int(n) for _, n in parts) == int(n_full)
    assert sum(loss for loss, _ in parts).item() == pytest.approx(full.item(), rel=1e-12)


@pytest.mark.parametrize("impl", ["torch", "chunked"])
@pytest.mark.parametrize("labels_kind", ["all_ignored", "one_token", "only_first_kept"])
def test_zero_targets(impl, labels_kind):
    hidden, weight, bias, _ = make_inputs(0, 2, 4, 3, 5, torch.float32, bias=True)
    if labels_kind == "all_ignored":
        labels = torch.full((2, 4), IGNORE_INDEX)
    elif labels_kind == "one_token":
        hidden = hidden[:, :1].detach().requires_grad_()
        labels = torch.tensor([[1], [2]])  # T = 1: the only position has nothing to predict
    else:
        labels = torch.full((2, 4), IGNORE_INDEX)
        labels[:, 0] = 3  # the first label is never a target
    with torch.no_grad():
        hidden[0, 0, 0] = float("inf")  # a zero loss must stay zero, not inf * 0 = nan
    loss, n = linear_cross_entropy(hidden, weight, labels, bias, impl=impl)
    assert n.item() == 0 and n.dtype == torch.int64
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    for p in (hidden, weight, bias):
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


@pytest.mark.parametrize("impl", ["torch", "chunked"])
def test_frozen_weight(impl):
    hidden, weight, bias, labels = make_inputs(2, 2, 12, 8, 30, torch.float32, bias=False)
    _, _, (ref_gh, _) = loss_and_grads("torch", hidden, weight, None, labels, z_loss=1e-3, softcap=10.0)
    weight.requires_grad_(False)
    _, _, (gh,) = loss_and_grads(impl, hidden, weight, None, labels, chunk_size=5, z_loss=1e-3, softcap=10.0)
    assert_close(gh, ref_gh, 1e-5, "grad hidden")
    loss, _ = linear_cross_entropy(hidden, weight, labels, impl=impl, chunk_size=5)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None


def test_frozen_hidden_trained_head():
    hidden, weight, bias, labels = make_inputs(4, 2, 12, 8, 30, torch.float32, bias=True)
    hidden.requires_grad_(False)
    _, _, ref = loss_and_grads("torch", hidden, weight, bias, labels)
    _, _, got = loss_and_grads("chunked", hidden, weight, bias, labels, chunk_size=7)
    for g, rg in zip(got, ref):
        assert_close(g, rg, 1e-5)


def test_no_grad_eval_and_nothing_requires_grad():
    hidden, weight, bias, labels = make_inputs(6, 2, 12, 8, 30, torch.float32, bias=True)
    ref, n_ref = linear_cross_entropy(hidden, weight, labels, bias, impl="torch")
    with torch.no_grad():
        loss, n = linear_cross_entropy(hidden, weight, labels, bias, impl="chunked", chunk_size=4)
    assert loss.grad_fn is None and not loss.requires_grad and n.item() == n_ref.item()
    assert_close(loss, ref, 1e-5)
    loss2, _ = linear_cross_entropy(hidden.detach(), weight.detach(), labels, bias.detach(), impl="chunked")
    assert not loss2.requires_grad
    assert_close(loss2, ref, 1e-5)


@pytest.mark.parametrize("impl", ["torch", "chunked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(impl, dtype):
    hidden, weight, bias, labels = make_inputs(7, 2, 16, 16, 40, torch.float32, bias=True)
    ref_loss, _, ref_grads = loss_and_grads("torch", hidden, weight, bias, labels, z_loss=1e-3, softcap=20.0)
    lp = [x.detach().to(dtype).requires_grad_() for x in (hidden, weight, bias)]
    loss, _, grads = loss_and_grads(impl, *lp, labels, chunk_size=5, z_loss=1e-3, softcap=20.0)
    assert loss.dtype == torch.float32
    assert_close(loss, ref_loss, 1e-2, "loss")
    for g, rg in zip(grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, rg, 3e-2, "grad")


def test_autocast_cpu_bf16():
    """Under autocast the projection runs in the autocast dtype (as nn.Linear would) and grads come back fp32."""
    hidden, weight, bias, labels = make_inputs(8, 2, 16, 16, 40, torch.float32, bias=True)
    ref_loss, _, ref_grads = loss_and_grads("torch", hidden, weight, bias, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, grads = loss_and_grads("chunked", hidden, weight, bias, labels, chunk_size=5)
    assert loss.dtype == torch.float32
    assert_close(loss, ref_loss, 1e-2, "loss")
    for g, rg in zip(grads, ref_grads):
        assert g.dtype == torch.float32
        assert_close(g, rg, 3e-2, "grad")


def test_bad_arguments():
    hidden, weight, bias, labels = make_inputs(9, 2, 6, 4, 10, torch.float32, bias=False)
    bad = labels.clone()
    bad[0, 3] = 10  # == V
    with pytest.raises(UserError, match="vocabulary"):
        linear_cross_entropy(hidden, weight, bad, impl="chunked")
    bad[0, 3] = -1
    with pytest.raises(UserError, match="vocabulary"):
        linear_cross_entropy(hidden, weight, bad, impl="chunked")
    with pytest.raises(UserError, match="loss.chunk_size"):
        linear_cross_entropy(hidden, weight, labels, impl="chunked", chunk_size=0)
    with pytest.raises(UserError, match="loss.softcap"):
        linear_cross_entropy(hidden, weight, labels, impl="chunked", softcap=0.0)
    with pytest.raises(ValueError, match="resolve_impl"):
        linear_cross_entropy(hidden, weight, labels, impl="auto")
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight, labels[:, :-1], impl="chunked")
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight[:, :-1], labels, impl="chunked")


# ------------------------------------------------------------------------------------------------------------
# memory: the chunked path never materialises [N, V]


class _TensorMemory(TorchDispatchMode):
    """Counts the bytes of every tensor storage created by an ATen op while active (forward and backward):
    the largest single one, and the peak of those alive at once. Exact and deterministic, unlike RSS.

    Storages that an op's inputs already had (views, in-place results, pre-existing tensors) are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = self.largest = 0

    def _freed(self, key: int, nbytes: int) -> None:
        if self.live.pop(key, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        out = func(*args, **kwargs)
        for x in tree_flatten(out)[0]:
            if not isinstance(x, torch.Tensor):
                continue
            storage = x.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in seen or key in self.live:
                continue
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.largest = max(self.largest, nbytes)
            weakref.finalize(storage, self._freed, key, nbytes)
        return out


def _measure(impl: str, grad: bool, **kw) -> _TensorMemory:
    n, h, v = 512, 32, 1000
    hidden, weight, bias, labels = make_inputs(1, None, n + 1, h, v, torch.float32, bias=True, mask_p=0.0)
    with _TensorMemory() as mem, torch.set_grad_enabled(grad):
        loss, count = linear_cross_entropy(hidden, weight, labels, bias, impl=impl, **kw)
        assert count.item() == n
        if grad:
            loss.backward()
    return mem


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_chunked_never_holds_full_logits(softcap):
    n, h, v, chunk = 512, 32, 1000, 64
    full_logits = n * v * 4
    naive = _measure("torch", True, softcap=softcap, z_loss=1e-3)
    assert naive.largest >= full_logits  # the reference does build [N, V] (so the probe works)
    assert naive.peak >= 2 * full_logits

    mem = _measure("chunked", True, chunk_size=chunk, softcap=softcap, z_loss=1e-3)
    one_chunk = chunk * v * 4
    assert mem.largest <= max(one_chunk, v * h * 4)  # nothing bigger than a chunk of logits or grad_weight
    # live at once: the chunk's logits (+ the tanh buffer with softcap) + grad_weight and its scaled copy,
    # grad_hidden and small change; far below one [N, V]
    chunk_buffers = 2 if softcap else 1
    budget = chunk_buffers * one_chunk + 2 * v * h * 4 + 4 * n * h * 4 + 16 * n * 8 + 4 * v * 4
    assert mem.peak <= budget, (mem.peak, budget)
    assert mem.peak < full_logits / 2


def test_chunked_no_grad_skips_gradient_buffers():
    n, h, v, chunk = 512, 32, 1000, 8
    mem = _measure("chunked", False, chunk_size=chunk)
    # no grad_weight ([V, H]) and no grad_hidden: only the selected hidden rows, a chunk of logits, small change
    assert mem.largest <= max(chunk * v * 4, n * h * 4) < v * h * 4
    assert mem.peak < v * h * 4


# ------------------------------------------------------------------------------------------------------------
# resolve_impl and import hygiene


def test_resolve_impl_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu) == "chunked"
    assert resolve_impl("auto", "cpu") == "chunked"
    assert resolve_impl("chunked", cpu) == "chunked"
    assert resolve_impl("torch", cpu) == "torch"
    with pytest.raises(UserError, match=r"loss\.impl") as err:
        resolve_impl("liger", cpu)
    assert str(err.value) == (
        "loss.impl: liger needs a CUDA device but the model is on 'cpu'; set `loss.impl: chunked` (or `auto`) on "
        "this machine, or set TRITON_INTERPRET=1 in the environment to run Liger's kernels in Triton's interpreter "
        "(a testing mode, ~5x slower)")
    with pytest.raises(UserError, match=r"loss\.impl") as err:
        resolve_impl("fused", cpu)
    assert all(name in str(err.value) for name in IMPLS)


def test_auto_is_chunked_on_cuda_too():
    """Chosen by the H100 figures (chunked 1.11x the naive time, Liger 1.5x) and by Liger's host reads: a step with
    `auto` reads the device once (tests/train/test_step.py). A torch.device is enough: nothing touches CUDA."""
    assert resolve_impl("auto", torch.device("cuda")) == "chunked"
    assert resolve_impl("auto", "cuda:1") == "chunked"


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), (" Yes ", True), ("on", True),
                                           ("0", False), ("", False), ("false", False)])
def test_the_interpreter_is_read_as_triton_reads_it(monkeypatch, value, on):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreter() is on
    assert describe_impl("liger", "cpu") == ("liger (Triton interpreter, CPU testing mode)" if on else "liger")
    assert describe_impl("chunked", "cpu") == "chunked"


def test_liger_impl_on_cpu_is_a_user_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, _, labels = make_inputs(0, 1, 4, 4, 6, torch.float32, bias=False)
    with pytest.raises(UserError, match=r"loss\.impl"):
        linear_cross_entropy(hidden, weight, labels, impl="liger")


def test_import_is_light():
    code = (
        "import sys; import torch; import finetune.loss.fused; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'liger_kernel', 'triton')"
        " or (m.startswith('finetune.') and m not in ('finetune.loss', 'finetune.loss.fused', 'finetune.loss.liger', 'finetune.errors', 'finetune.labels'))]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)


# ------------------------------------------------------------------------------------------------------------
# Liger on a GPU


def _liger_available() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None:
        return False
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture
def no_tf32():
    """fp32 comparisons need true fp32 GEMMs; some other module may have switched TF32 on globally."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.skipif(not _liger_available(), reason="needs CUDA and liger-kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("z_loss", "softcap"), [(0.0, None), (1e-4, None), (0.0, 30.0), (1e-4, 30.0)])
@pytest.mark.parametrize("bias", [False, True])
def test_liger_matches_chunked(dtype, z_loss, softcap, bias, no_tf32):
    # Tolerances: fp32 is the contract (1e-5). bf16: Liger rounds each chunk of logits (and their gradient) to
    # bf16 while chunked keeps fp32 logits, so they differ by bf16 rounding: 1e-2 on the loss, 5e-2 on grads.
    assert resolve_impl("liger", torch.device("cuda")) == "liger"
    loss_rel, grad_rel = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 5e-2)
    hidden, weight, bias_t, labels = make_inputs(21, 2, 96, 64, 1000, torch.float32, bias=bias, mask_p=0.3)
    tensors = [x.detach().cuda().to(dtype).requires_grad_() if x is not None else None
               for x in (hidden, weight, bias_t)]
    labels = labels.cuda()
    floors = natural_scales(*tensors, labels, grad_scale=0.5)
    ref_loss, ref_n, ref_grads = loss_and_grads("chunked", *tensors, labels, chunk_size=64, z_loss=z_loss,
                                                softcap=softcap, scale=0.5)
    loss, n, grads = loss_and_grads("liger", *tensors, labels, z_loss=z_loss, softcap=softcap, scale=0.5)
    assert n.item() == ref_n.item()
    assert loss.dtype == torch.float32
    assert_close(loss, ref_loss, loss_rel, "loss", floors["loss_sum"])
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, rg, grad_rel, f"grad {name}", floors[name])


@pytest.mark.gpu
@pytest.mark.skipif(not _liger_available(), reason="needs CUDA and liger-kernel")
def test_liger_frozen_weight_and_frozen_hidden(no_tf32):
    hidden, weight, bias, labels = make_inputs(22, 2, 32, 64, 500, torch.float32, bias=False)
    hidden, weight, labels = hidden.detach().cuda(), weight.detach().cuda(), labels.cuda()
    # frozen head, trained trunk (LoRA)
    h1 = hidden.clone().requires_grad_()
    _, _, (ref,) = loss_and_grads("chunked", h1, weight, None, labels)
    _, _, (got,) = loss_and_grads("liger", h1, weight, None, labels)
    assert_close(got, ref, 1e-5)
    # frozen trunk, trained head: Liger 0.8.5 by itself would return no weight gradient here
    w1 = weight.clone().requires_grad_()
    _, _, (ref,) = loss_and_grads("chunked", hidden, w1, None, labels)
    _, _, (got,) = loss_and_grads("liger", hidden, w1, None, labels)
    assert_close(got, ref, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_on_cuda_matches_torch(dtype, no_tf32):
    """The CUDA-only branches of chunked (fp32-output GEMMs for bf16) against the reference."""
    hidden, weight, bias, labels = make_inputs(23, 2, 64, 64, 1000, torch.float32, bias=True)
    tensors = [x.detach().cuda().to(dtype).requires_grad_() for x in (hidden, weight, bias)]
    labels = labels.cuda()
    floors = natural_scales(*tensors, labels)
    rel = 1e-5 if dtype == torch.float32 else 3e-2
    ref_loss, _, ref_grads = loss_and_grads("torch", *tensors, labels, z_loss=1e-4, softcap=30.0)
    loss, _, grads = loss_and_grads("chunked", *tensors, labels, chunk_size=32, z_loss=1e-4, softcap=30.0)
    assert_close(loss, ref_loss, rel, "loss", floors["loss_sum"])
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, rg, rel, f"grad {name}", floors[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras", [{}, {"z_loss": 1e-3, "softcap": 5.0}])
def test_rows_that_fit_one_chunk_take_the_short_path_to_the_same_numbers(dtype, extras):
    """Rows that fit one chunk skip the chunk loop's accumulators (host time per micro-batch): the same loss and
    gradients as the loop over smaller chunks (the sums in another order: to float32 rounding)."""
    hidden, weight, bias, labels = make_inputs(3, 2, 24, 16, 40, dtype, bias=True)
    one = loss_and_grads("chunked", hidden, weight, bias, labels, chunk_size=1024, **extras)
    loop = loss_and_grads("chunked", hidden, weight, bias, labels, chunk_size=7, **extras)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert one[1] == loop[1] and one[0].dtype == loop[0].dtype == torch.float32
    assert abs(float(one[0]) - float(loop[0])) <= tol * abs(float(loop[0]))
    for a, b in zip(one[2], loop[2]):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
