"""The fused distillation loss (finetune/loss/distill.py): the chunked divergence equals a naive one written here from
the full float64 logits by definition (value, the student's gradients, agree / tail / outside), equals TRL's own
generalized_jsd_loss where TRL is installed, never differentiates the teacher, and never holds more than a chunk of
logits."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.loss.distill import DistillSums, distill_loss

BETAS = [0.0, 0.5, 1.0]


def _model(g: torch.Generator, n: int, hidden: int, vocab: int, bias: bool, dtype=torch.float64):
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.5).requires_grad_(True)
    b = (torch.randn(vocab, generator=g, dtype=dtype) * 0.3).requires_grad_(True) if bias else None
    return h, w, b


def _cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from probabilities, by definition."""
    return (p * (p.log() - q.log())).sum(dim=1)


def _naive(hs, ws, bs, ht, wt, bt, *, beta, temperature=1.0, student_softcap=None, teacher_softcap=None,
           top_k=None, vocab=None, **_) -> DistillSums:
    """The definitions on full logits: probabilities, the k + 1 buckets as 1 - sum, the mixture in probability
    space (independent of the module's log-space forms)."""
    xs = _cap(F.linear(hs.double(), ws.double(), None if bs is None else bs.double()), student_softcap) / temperature
    xt = _cap(F.linear(ht.double(), wt.double(), None if bt is None else bt.double()), teacher_softcap) / temperature
    vocab = vocab or ws.shape[0]
    outside = torch.softmax(xt, dim=1)[:, vocab:].sum()
    ps, pt = torch.softmax(xs, dim=1), torch.softmax(xt[:, :vocab], dim=1)
    agree = (xs.argmax(dim=1) == xt[:, :vocab].argmax(dim=1)).sum()
    tail = torch.zeros((), dtype=torch.float64)
    if top_k is not None:
        idx = pt.topk(top_k, dim=1).indices
        ps_k, pt_k = ps.gather(1, idx), pt.gather(1, idx)
        ps = torch.cat([ps_k, 1 - ps_k.sum(1, keepdim=True)], dim=1)
        pt = torch.cat([pt_k, 1 - pt_k.sum(1, keepdim=True)], dim=1)
        tail = pt[:, -1].sum()
    if beta == 0:
        rows = _kl(pt, ps)
    elif beta == 1:
        rows = _kl(ps, pt)
    else:
        m = beta * pt + (1 - beta) * ps
        rows = beta * _kl(pt, m) + (1 - beta) * _kl(ps, m)
    return DistillSums(rows.sum(), agree, tail.detach(), outside.detach())


CASES = {  # each with and without a bias somewhere
    "plain": {},
    "plain_no_bias": {"bias": False},
    "chunks": {"chunk_size": 3, "bias": False},  # 3 does not divide the 11 rows
    "student_softcap": {"student_softcap": 2.0, "chunk_size": 4},
    "teacher_softcap": {"teacher_softcap": 1.5, "chunk_size": 4, "bias": False},
    # the teacher: another hidden size and 10 ids no tokenizer id maps to
    "larger_teacher": {"teacher_shape": (12, 50), "chunk_size": 5},
    "larger_teacher_vocab": {"teacher_shape": (12, 50), "vocab": 40, "bias": False},
    "top_k": {"top_k": 5, "chunk_size": 4},
    "top_k_no_bias": {"top_k": 1, "chunk_size": 4, "bias": False},
    "everything": {"top_k": 3, "teacher_shape": (6, 47), "student_softcap": 2.5, "teacher_softcap": 3.0,
                   "chunk_size": 2},
}


def _case(name: str, dtype=torch.float64, seed=0, n=11, teacher_dtype=None):
    """(student (hidden, weight, bias), teacher (the same), distill_loss's keywords) of CASES[name]."""
    case = dict(CASES[name])
    g = torch.Generator().manual_seed(seed)
    ht_size, vt = case.pop("teacher_shape", (8, 40))
    bias = case.pop("bias", True)
    student = _model(g, n, 8, 40, bias, dtype)
    teacher = _model(g, n, ht_size, vt, bias, teacher_dtype or dtype)
    return student, teacher, case


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _run(fn, student, teacher, **kw):
    for t in (*student, *teacher):
        if t is not None:
            t.grad = None
    out = fn(*student, *teacher, **kw)
    out.loss.backward()
    grads = [t.grad.clone() if t is not None else None for t in student]
    return out, grads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_equals_the_naive_definition(case, temperature, beta):
    """In float64 (errors of about 2e-15 seen): the loss and the gradients within 1e-10, relative."""
    student, teacher, kw = _case(case)
    kw.update(beta=beta, temperature=temperature)
    got, got_grads = _run(distill_loss, student, teacher, **kw)
    want, want_grads = _run(_naive, student, teacher, **kw)
    assert got.loss.dtype == torch.float64 and got.loss.dim() == 0
    assert abs(got.loss.item() - want.loss.item()) <= 1e-10 * abs(want.loss.item())
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert _rel(a, b) <= 1e-10
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    assert int(got.agree) == int(want.agree) and got.agree.dtype == torch.int64
    torch.testing.assert_close(got.tail, want.tail, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(got.outside, want.outside, rtol=1e-10, atol=1e-14)
    assert not any(t.requires_grad for t in (got.agree, got.tail, got.outside))


def test_statistics_are_nonzero_where_they_should_be():
    """The cases above would pass with zeros everywhere if the naive side were zero too: make sure it is not."""
    student, teacher, kw = _case("everything")
    out = distill_loss(*student, *teacher, beta=0.5, **kw)
    assert float(out.tail) > 0.1 and float(out.outside) > 0.01 and out.loss.item() > 0
    same = distill_loss(student[0], student[1], student[2], student[0], student[1], student[2], beta=0.5)
    assert int(same.agree) == student[0].shape[0] and abs(same.loss.item()) < 1e-12


@pytest.mark.parametrize("beta", BETAS)
def test_gradcheck(beta):
    g = torch.Generator().manual_seed(3)
    student, teacher = _model(g, 5, 4, 9, True), _model(g, 5, 3, 11, True)

    def loss(*s):
        return distill_loss(*s, *teacher, beta=beta, temperature=1.5, chunk_size=2, top_k=3, student_softcap=2.0,
                            vocab=9).loss

    assert torch.autograd.gradcheck(loss, student)


def test_the_teacher_gets_no_gradient():
    student, teacher, kw = _case("everything")
    out = distill_loss(*student, *teacher, beta=0.5, **kw)
    out.loss.backward()
    assert all(t.grad is None for t in teacher)
    assert all(t.grad is not None for t in student)


def test_repeated_backward_recomputes_the_same_gradients():
    student, teacher, kw = _case("top_k")
    out = distill_loss(*student, *teacher, beta=0.5, **kw)
    first = torch.autograd.grad(out.loss * 2.0, student, retain_graph=True)
    second = torch.autograd.grad(out.loss * 2.0, student)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case, teacher_dtype", [("everything", torch.float32), ("larger_teacher", None)])
@pytest.mark.parametrize("beta", BETAS)
def test_low_precision_inputs(dtype, tol, case, teacher_dtype, beta):
    """float32 and bfloat16 inputs against the naive float64 loss of the same (rounded) values: bf16 logits come from a
    bf16 GEMM here (the CPU), hence the looser tolerance (errors of about 0.5% seen); the sums are float32 either way.
    With top_k the teacher stays float32: a bf16 teacher's rounded logits can pick another top-k set than the float64
    reference (one row of 32 here), a different but equally right loss."""
    student, teacher, kw = _case(case, dtype=dtype, n=32, teacher_dtype=teacher_dtype)
    kw.update(beta=beta, temperature=2.0, student_softcap=2.5)
    got, got_grads = _run(distill_loss, student, teacher, **kw)
    want, want_grads = _run(_naive, student, teacher, **kw)
    assert got.loss.dtype == torch.float32
    assert abs(got.loss.item() - want.loss.item()) <= tol * abs(want.loss.item())
    assert int(got.agree) == int(want.agree)
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == dtype and _rel(a, b) <= tol


def test_no_rows_still_reach_the_student():
    student, teacher, _ = _case("plain", n=0)
    out = distill_loss(*student, *teacher, beta=0.5)
    out.loss.backward()
    assert out.loss.item() == 0 and int(out.agree) == 0
    assert student[1].grad is not None and not student[1].grad.any()


def test_refuses_a_student_with_more_ids_than_the_shared_vocabulary():
    g = torch.Generator().manual_seed(0)
    student, teacher = _model(g, 3, 4, 12, False), _model(g, 3, 4, 10, False)
    with pytest.raises(ValueError, match="student must have exactly the shared ids"):
        distill_loss(*student, *teacher, beta=0.5)
    student, teacher = _model(g, 3, 4, 10, False), _model(g, 3, 4, 12, False)
    with pytest.raises(ValueError, match="vocab 8"):
        distill_loss(*student, *teacher, beta=0.5, vocab=8)
    with pytest.raises(ValueError, match="beta"):
        distill_loss(*student, *teacher, beta=1.5)


# --------------------------------------------------------------------------------------------------------------
# TRL's own function


def _trl_generalized_jsd():
    """TRL 1.16's GKDTrainer.generalized_jsd_loss, from the installed source (CI has no TRL: the test skips).

    Its function is compiled from trl/experimental/gkd/gkd_trainer.py rather than imported: importing that module
    pulls in transformers' Trainer and accelerate (~10 s on a small machine), and the function uses only torch and F.
    """
    # an installed TRL, else the reference copy in /tmp/trl_pkgs (found without adding it to sys.path for the session)
    spec = importlib.util.find_spec("trl") or importlib.machinery.PathFinder.find_spec("trl", ["/tmp/trl_pkgs"])
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("TRL is not installed (CI has no TRL)")
    source = Path(next(iter(spec.submodule_search_locations))) / "experimental" / "gkd" / "gkd_trainer.py"
    if not source.is_file():
        pytest.skip(f"this TRL has no {source.name}")
    tree = ast.parse(source.read_text())
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "generalized_jsd_loss"), None)
    if fn is None:
        pytest.skip("this TRL has no generalized_jsd_loss")
    fn.decorator_list = []  # a @staticmethod of GKDTrainer
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(source), "exec"), namespace)
    return namespace["generalized_jsd_loss"]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_equals_trl_generalized_jsd_loss(beta, temperature):
    trl_loss = _trl_generalized_jsd()
    g = torch.Generator().manual_seed(7)
    b, t, v = 2, 6, 30
    student_logits = (torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    teacher_logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :2] = -100  # a prompt: TRL masks it
    eye = torch.eye(v, dtype=torch.float64)  # logits = hidden @ I: the loss sees exactly these logits
    ours = distill_loss(student_logits.reshape(-1, v), eye, None, teacher_logits.reshape(-1, v), eye, None,
                        beta=beta, temperature=temperature, chunk_size=5)
    theirs = trl_loss(student_logits, teacher_logits, beta=beta, temperature=temperature, reduction="sum")
    torch.testing.assert_close(ours.loss, theirs, rtol=1e-10, atol=0)
    ours_grad = torch.autograd.grad(ours.loss, student_logits)[0]
    theirs_grad = torch.autograd.grad(theirs, student_logits)[0]
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-8, atol=1e-12)
    # TRL's default: "batchmean" over the unmasked tokens = our sum over those rows / their count
    keep = (labels != -100).reshape(-1)
    masked = distill_loss(student_logits.reshape(-1, v)[keep], eye, None, teacher_logits.reshape(-1, v)[keep], eye,
                          None, beta=beta, temperature=temperature)
    mean = trl_loss(student_logits, teacher_logits, labels=labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(masked.loss / int(keep.sum()), mean, rtol=1e-10, atol=0)


# --------------------------------------------------------------------------------------------------------------
# memory


class _Largest(TorchDispatchMode):
    """The largest tensor any op produces (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_holds_more_than_a_chunk_of_logits():
    n, hidden, vocab, teacher_vocab, chunk = 64, 8, 32_000, 32_100, 8
    g = torch.Generator().manual_seed(0)
    student = _model(g, n, hidden, vocab, True, torch.float32)
    teacher = _model(g, n, hidden, teacher_vocab, True, torch.float32)
    inputs = {t.data_ptr() for t in (*student, *teacher)}
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.data_ptr() in inputs, t.numel()))
        return t

    largest = _Largest()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), largest:
        out = distill_loss(*student, *teacher, beta=0.5, temperature=2.0, chunk_size=chunk, top_k=20,
                           student_softcap=30.0)
        out.loss.backward()
    assert saved and all(is_input or numel <= chunk * teacher_vocab for is_input, numel in saved)
    # the biggest buffers: the chunks' logits [8, Vt] and the teacher's weight [Vt, 8] (an eighth of [N, V])
    assert largest.largest <= max(chunk * teacher_vocab, teacher_vocab * hidden) < n * vocab // 4  # no [N, V] or [N, Vt], not even a quarter of one
    assert math.isfinite(out.loss.item())


def _stored(teacher, k: int, temperature: float, softcap: float | None = None, vocab: int | None = None):
    """The teacher's top-k ids and log-probabilities at `temperature`, as an offline file would store them: in
    descending order, renormalized over the shared ids (the online top-k's teacher)."""
    ht, wt, bt = teacher
    with torch.no_grad():
        z = _cap(F.linear(ht, wt, bt), softcap) / temperature
        logp = torch.log_softmax(z[:, :vocab or z.shape[1]], dim=1)
        values, ids = logp.topk(k, dim=1)
    return ids, values


@pytest.mark.parametrize("case", ["top_k", "top_k_no_bias", "everything"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_stored_top_k_equals_the_online_top_k(case, temperature, beta):
    """The stored teacher (its top-k values and a tail of 1 - their sum) gives the online top-k's divergence, student
    gradients and statistics from the same teacher, within 1e-10 in float64."""
    from finetune.loss.distill import distill_stored_loss

    student, teacher, kw = _case(case)
    ids, values = _stored(teacher, kw["top_k"], temperature, kw.get("teacher_softcap"), student[1].shape[0])
    online, online_grads = _run(distill_loss, student, teacher, beta=beta, temperature=temperature, **kw)
    stored, stored_grads = _run(distill_stored_loss, student, (ids, values), beta=beta, temperature=temperature,
                                chunk_size=kw.get("chunk_size", 1024), student_softcap=kw.get("student_softcap"))
    assert abs(stored.loss.item() - online.loss.item()) <= 1e-10 * abs(online.loss.item())
    for a, b in zip(stored_grads, online_grads):
        if a is not None:
            assert _rel(a, b) <= 1e-10
    assert int(stored.agree) == int(online.agree)
    torch.testing.assert_close(stored.tail, online.tail, rtol=1e-10, atol=1e-14)
    assert float(stored.outside) == 0.0


def test_stored_top_k_gradcheck_and_a_tail_of_nothing():
    """gradcheck through the stored path; a stored top-k whose values sum to 1 (rounded) keeps a finite loss at every
    beta: its tail bucket is TAIL_FLOOR, not 0."""
    from finetune.loss.distill import distill_stored_loss

    g = torch.Generator().manual_seed(5)
    student = _model(g, 5, 4, 9, True)
    ids, values = _stored(_model(g, 5, 3, 9, True), 3, 1.5)
    assert torch.autograd.gradcheck(lambda *s: distill_stored_loss(*s, ids, values, beta=0.5, temperature=1.5,
                                                                   chunk_size=2).loss, student)
    ids, values = _stored(_model(g, 5, 3, 9, True), 8, 1.0)
    whole = values - values.logsumexp(dim=1, keepdim=True)  # 8 of 9 ids holding all the mass
    for beta in BETAS:
        out = distill_stored_loss(*student, ids, whole, beta=beta)
        assert math.isfinite(out.loss.item()) and float(out.tail) <= 5 * 1.001e-12


def test_stored_top_k_refuses_what_does_not_fit():
    from finetune.loss.distill import distill_stored_loss

    g = torch.Generator().manual_seed(6)
    student = _model(g, 4, 4, 9, False)
    ids, values = _stored(_model(g, 4, 3, 9, False), 3, 1.0)
    with pytest.raises(ValueError, match="want the same"):
        distill_stored_loss(*student, ids, values[:, :2], beta=0.5)
    with pytest.raises(ValueError, match="must align"):
        distill_stored_loss(*student, ids[:3], values[:3], beta=0.5)
    every, all_values = _stored(_model(g, 4, 3, 9, False), 9, 1.0)
    with pytest.raises(ValueError, match="fewer ids than the vocabulary"):
        distill_stored_loss(*student, every, all_values, beta=0.5)
