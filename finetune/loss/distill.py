"""Fused distillation loss: the student's and the teacher's output layers and the divergence between their token
distributions in one step, one chunk of rows at a time, so that neither model's full [tokens x vocab] logits exist.

The divergence is TRL 1.16's `generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py:238), per row:

* both models' logits are divided by `temperature` (gkd_trainer.py:271-272), with no T^2 factor;
* beta == 0: forward KL(teacher || student) = sum p_t (log p_t - log p_s) (gkd_trainer.py:278-279:
  `F.kl_div(student_log_probs, teacher_log_probs, log_target=True)`; F.kl_div(input, target) is KL(target || input));
* beta == 1: reverse KL(student || teacher) (gkd_trainer.py:280-281);
* otherwise beta * KL(teacher || m) + (1 - beta) * KL(student || m) with the mixture m = beta p_t + (1 - beta) p_s
  formed in log space, logsumexp(log p_s + log1p(-beta), log p_t + log beta) (gkd_trainer.py:282-297).

The two ends are TRL's special cases, not limits of the mixture (which tends to 0 as beta -> 0 or 1). TRL then
averages over the unmasked tokens ("batchmean", gkd_trainer.py:311-316); here the divergence is SUMMED over the
rows, and the caller divides once by the optimizer step's token count (docs/design.md, "The loss contract").

Beyond TRL:

* `top_k`: the divergence over k + 1 buckets per row, the teacher's k most likely ids and one tail bucket holding
  each distribution's remaining mass (exact: no renormalization over the k ids). The tail's log-mass is a
  logsumexp over the complement, which stays finite and precise where log1p(-sum of the k) would round to -inf.
* `vocab`: a teacher with more ids than the student (ids no tokenizer id maps to) is renormalized over the shared
  first `vocab` ids; the mass it put outside them is reported (`outside`).
* soft-caps (`softcap * tanh(logits / softcap)`, as fused.py) per model, before the temperature.
* `distill_stored_loss`: the teacher given as stored top-k log-probabilities per row (offline distillation) rather
  than as hidden rows and a head: its k buckets are the stored values as they are, its tail bucket the rest of the
  mass, 1 - sum (in float64, at least TAIL_FLOOR: stored values are rounded, and a reverse KL needs a teacher tail
  with some mass). The same divergence and gradients as the online top-k, from the stored instead of computed values.

The statistics (`agree`, `tail`, `outside`) describe the distributions as distilled: after each model's
soft-cap and the temperature, the teacher renormalized over the shared ids.

Gradients: the loss is a sum, so its upstream gradient is one scalar and, as in fused.py, the student's gradients
are formed during the forward, chunk by chunk, and only scaled in the backward. Per chunk the student's gradient
with respect to its (tempered) logits z is `p_s * (a - <p_s, a>)`, where `a` is the divergence's derivative with
respect to the student's probability of each id's bucket: `(1 - beta)(log p_s - log m)` inside (0, 1),
`log p_s - log p_t` at beta = 1 (a constant shift drops out), and at beta = 0 the closed form `p_s - r`, r the
teacher's bucket mass spread over the bucket's ids in proportion to the student's (p_t itself without top_k),
which never divides by a vanishing student probability.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from finetune.loss.fused import acc_dtype, compute_dtype, has_mm_out_dtype, mm_f32, promote


@dataclass
class DistillSums:
    """The summed divergence of N rows and its statistics, each summed over the rows (the caller normalizes)."""

    loss: torch.Tensor  # scalar, acc dtype: differentiable w.r.t. the student's hidden rows, weight and bias
    agree: torch.Tensor  # scalar int64, no grad: rows whose student and teacher argmax (top-1) agree
    tail: torch.Tensor  # scalar, no grad: with top_k, the teacher's mass outside its top-k (0 without)
    outside: torch.Tensor  # scalar, no grad: the teacher's mass on ids >= vocab (0 when it has none)


# The least tail mass a stored teacher's top-k leaves (see the module docstring): far below what fp32 values resolve.
TAIL_FLOOR = 1e-12


@dataclass(frozen=True)
class _Setup:
    beta: float
    temperature: float
    chunk_size: int
    student_softcap: float | None
    teacher_softcap: float | None
    top_k: int | None  # None also when top_k covers the whole vocabulary: the same divergence, an empty tail
    vocab: int
    grad_flags: tuple[bool, bool, bool]  # student hidden, weight, bias
    stored: bool = False  # the teacher's tensors are stored top-k (ids, log-probabilities), not (hidden, weight, bias)


def _tempered_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float | None,
                     temperature: float, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits of one chunk, soft-capped then divided by the temperature, in `acc`; the tanh values kept for the
    soft-cap's chain rule, or None)."""
    x = mm_f32(h, w.t(), acc_dtype(h.dtype)).to(acc)
    if b is not None:
        x.add_(b)
    t = None
    if softcap is not None:
        t = x.div_(softcap).tanh_()
        x = t * softcap
    if temperature != 1.0:
        x.div_(temperature)
    return x, t


def _log_softmax_(x: torch.Tensor) -> torch.Tensor:
    return x.sub_(torch.logsumexp(x, dim=1, keepdim=True))


def _buckets(logp: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """[c, V] log-probabilities -> [c, B]: the ids themselves without top_k, else the k ids `idx` [c, k] and the
    tail's log-mass, a logsumexp over the complement (finite and exact however small the tail)."""
    if idx is None:
        return logp
    rest = torch.logsumexp(logp.scatter(1, idx, float("-inf")), dim=1, keepdim=True)
    return torch.cat([logp.gather(1, idx), rest], dim=1)


def _spread(x: torch.Tensor, idx: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[c, B] -> [c, V]: each id gets its bucket's value (the tail's for every id outside the top-k)."""
    if idx is None:
        return x
    return x[:, -1:].expand(-1, vocab).clone().scatter_(1, idx, x[:, :-1])


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, F.kl_div(logq, logp, log_target=True) summed: exp(logp) * (logp - logq)."""
    return (logp.exp() * (logp - logq)).sum(dim=1)


def _divergence(s: torch.Tensor, t: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(TRL's generalized JSD per row [c], d(divergence)/d(student bucket probability) [c, B], None at beta 0) of
    the student's and the teacher's bucket log-probabilities s, t [c, B]."""
    if beta == 0:
        return _kl(t, s), None
    if beta == 1:
        return _kl(s, t), s - t
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    # d/dp_s of beta KL(t||m) + (1-beta) KL(s||m) is (1-beta)(log p_s - log m): the terms through m sum to a constant
    return beta * _kl(t, m) + (1 - beta) * _kl(s, m), (1 - beta) * (s - m)


def _logit_grad(s_ids: torch.Tensor, s: torch.Tensor, t: torch.Tensor, a: torch.Tensor | None,
                idx: torch.Tensor | None) -> torch.Tensor:
    """d(divergence)/d(the student's tempered logits) [c, V], from its log-probabilities of the ids s_ids [c, V] and
    of the buckets s, t [c, B]: p_s * (a - <p_s, a>), or p_s - r at beta 0 (module docstring)."""
    p = s_ids.exp()
    if a is None:
        r = t.exp() if idx is None else s_ids.add(_spread(t - s, idx, p.shape[1])).exp_()
        return p.sub_(r)
    mean = (s.exp() * a).sum(dim=1, keepdim=True)
    return p.mul_(_spread(a, idx, p.shape[1]).sub(mean))


def _teacher_buckets(teacher: tuple[torch.Tensor, ...], setup: _Setup, acc: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The teacher's bucket log-probabilities [c, B] from its hidden rows and head, its top-k ids [c, k] (None
    without top_k), its likeliest id per row, and its mass beyond the shared ids (summed)."""
    zt, _ = _tempered_logits(*teacher, setup.teacher_softcap, setup.temperature, acc)
    vocab = setup.vocab
    outside = torch.zeros((), dtype=acc, device=zt.device)
    if zt.shape[1] > vocab:
        # mass beyond the shared ids: 1 - exp(lse(shared) - lse(all)), via expm1 for small masses
        lse = torch.logsumexp(zt, dim=1)
        zt = zt[:, :vocab]
        outside = -torch.expm1(torch.logsumexp(zt, dim=1) - lse).sum()
    top1 = zt.argmax(dim=1)
    t_ids = _log_softmax_(zt.contiguous())  # the teacher renormalized over the shared ids
    idx = None if setup.top_k is None else t_ids.topk(setup.top_k, dim=1, sorted=False).indices
    return _buckets(t_ids, idx), idx, top1, outside


def _stored_buckets(ids: torch.Tensor, logps: torch.Tensor, acc: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stored teacher's bucket log-probabilities [c, k + 1] (its k values and the tail, 1 - their sum, in float64
    and at least TAIL_FLOOR), its ids [c, k], and its likeliest id per row (the first: stored in descending order)."""
    wide = torch.float64 if logps.device.type != "mps" else acc
    rest = (1 - logps.to(wide).exp().sum(dim=1, keepdim=True)).clamp_min_(TAIL_FLOOR).log_()
    return torch.cat([logps.to(acc), rest.to(acc)], dim=1), ids, ids[:, 0]


def _chunk(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...], setup: _Setup,
           acc: torch.dtype, need_grad: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """([summed divergence, agreeing rows, tail mass, outside mass] of one chunk of rows, d(divergence)/d(student
    logits) [c, V] or None). Holds a few [c, V] buffers per model, never more rows."""
    zs, tanh = _tempered_logits(*student, setup.student_softcap, setup.temperature, acc)
    if setup.stored:
        t, idx, top1, outside = (*_stored_buckets(*teacher, acc), None)
    else:
        t, idx, top1, outside = _teacher_buckets(teacher, setup, acc)
    agree = (zs.argmax(dim=1) == top1).sum()
    s_ids = _log_softmax_(zs)
    s = _buckets(s_ids, idx)
    zero = torch.zeros((), dtype=acc, device=s.device)
    tail = t[:, -1].exp().sum() if idx is not None else zero
    rows, a = _divergence(s, t, setup.beta)
    stats = [rows.sum(), agree, tail, zero if outside is None else outside]
    if not need_grad:
        return stats, None
    g = _logit_grad(s_ids, s, t, a, idx)
    if setup.temperature != 1.0:
        g.div_(setup.temperature)
    if tanh is not None:
        g.mul_(tanh.square_().neg_().add_(1.0))  # through the soft-cap: 1 - tanh^2
    return stats, g


def _add_grads(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, rows: slice,
               grads: list[torch.Tensor | None]) -> None:
    """Adds one chunk's d(loss)/d(logits) g [c, V] into the hidden, weight and bias gradients (fused.py's GEMMs:
    16-bit operands where the inputs are 16-bit, fp32 accumulation)."""
    grad_h, grad_w, grad_b = grads
    g_lp = g if g.dtype == h.dtype else g.to(h.dtype)
    if grad_h is not None:
        torch.mm(g_lp, w, out=grad_h[rows])
    if grad_b is not None:
        grad_b.add_(g.sum(dim=0))
    if grad_w is not None:
        if g.dtype == h.dtype:
            grad_w.addmm_(g.t(), h)
        elif has_mm_out_dtype(h.device):
            torch.addmm(grad_w, g_lp.t(), h, out_dtype=grad_w.dtype, out=grad_w)
        else:  # no 16-bit GEMM with an fp32 output here (CPU): in fp32 from the fp32 chunk
            grad_w.addmm_(g.t(), h.to(g.dtype))


def _forward(hs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None, teacher: tuple[torch.Tensor | None, ...],
             setup: _Setup) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """([loss, agree, tail, outside] over all rows, [grad hidden, grad weight, grad bias] of the student or Nones).
    `teacher`: (hidden, weight, bias), or with setup.stored (ids, log-probabilities)."""
    need_h, need_w, need_b = setup.grad_flags
    acc = acc_dtype(hs.dtype) if setup.stored else promote(acc_dtype(hs.dtype), acc_dtype(teacher[0].dtype))
    dev = hs.device
    grads: list[torch.Tensor | None] = [
        torch.empty_like(hs) if need_h else None,
        torch.zeros(ws.shape, dtype=acc, device=dev) if need_w else None,
        torch.zeros(bs.shape, dtype=acc, device=dev) if need_b and bs is not None else None,
    ]
    # sum the chunks' sums in fp64 (scalars, so free); MPS has no fp64
    total = acc if dev.type == "mps" else torch.float64
    sums = [torch.zeros((), dtype=total, device=dev) for _ in range(4)]
    sums[1] = sums[1].long()
    for start in range(0, hs.shape[0], setup.chunk_size):
        rows = slice(start, start + setup.chunk_size)
        chunk = (teacher[0][rows], teacher[1][rows]) if setup.stored else (teacher[0][rows], *teacher[1:])
        stats, g = _chunk((hs[rows], ws, bs), chunk, setup, acc, any(setup.grad_flags))
        for total_sum, value in zip(sums, stats):
            total_sum += value
        if g is not None:
            _add_grads(g, hs[rows], ws, rows, grads)
            del g  # free this chunk before the next one is built
    sums = [sums[0].to(acc), sums[1], sums[2].to(acc), sums[3].to(acc)]
    grad_w, grad_b = grads[1], grads[2]
    return sums, [grads[0], grad_w.to(ws.dtype) if grad_w is not None else None,
                  grad_b.to(bs.dtype) if grad_b is not None and bs is not None else None]


class _ChunkedDistill(torch.autograd.Function):
    """(summed divergence, agree, tail, outside) of the student's and the teacher's chunked logits.

    The student's gradients are computed during forward (one chunk of logits at a time) and kept on ctx; backward
    scales them in place by the scalar upstream gradient. A repeated backward (retain_graph, gradcheck) recomputes
    them from the saved inputs. The teacher's tensors arrive detached and get no gradient."""

    @staticmethod
    def forward(ctx: Any, hs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None,  # type: ignore[override]
                setup: _Setup, *teacher: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        sums, grads = _forward(hs, ws, bs, teacher, setup)
        ctx.mark_non_differentiable(*sums[1:])
        ctx.grads = grads if any(setup.grad_flags) else None
        ctx.setup, ctx.teachers = setup, len(teacher)
        if any(setup.grad_flags):
            ctx.save_for_backward(hs, ws, bs, *teacher)
        return tuple(sums)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        grads = ctx.grads
        ctx.grads = None  # the tensors now belong to autograd
        if grads is None:  # this graph is being backpropagated through again
            hs, ws, bs, *teacher = ctx.saved_tensors
            _, grads = _forward(hs, ws, bs, tuple(teacher), ctx.setup)
        for g in grads:
            if g is not None:
                g.mul_(grad_loss)
        return grads[0], grads[1], grads[2], None, *(None,) * ctx.teachers


def distill_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
                 teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None, *,
                 beta: float, temperature: float = 1.0, chunk_size: int = 1024,
                 student_softcap: float | None = None, teacher_softcap: float | None = None,
                 top_k: int | None = None, vocab: int | None = None) -> DistillSums:
    """TRL's generalized JSD (module docstring) of the student's rows against the teacher's, summed over the rows.

    student_hidden [N, H] are the hidden rows at the distilled positions after the head's own transforms (a logit
    scale), student_weight [Vs, H], student_bias [Vs] or None; the teacher's [N, Ht], [Vt, Ht], [Vt] or None,
    row-aligned with the student's, never differentiated. `vocab` (default min(Vs, Vt)) is the shared vocabulary:
    the student must have exactly that many ids, the teacher at least as many (renormalized over them). `top_k`:
    the divergence over the teacher's k most likely ids and a tail bucket (k >= vocab: all ids, no tail).
    The loss is in float32 (float64 for float64 inputs), whatever the input dtypes."""
    setup = _check(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                   beta, temperature, chunk_size, student_softcap, teacher_softcap, top_k, vocab)
    td = compute_dtype(teacher_hidden, teacher_weight)
    bt = teacher_bias.detach().to(td) if teacher_bias is not None else None
    return _apply(student_hidden, student_weight, student_bias, setup, teacher_hidden.detach().to(td),
                  teacher_weight.detach().to(td), bt)


def _apply(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
           setup: _Setup, *teacher: torch.Tensor | None) -> DistillSums:
    """The student's tensors cast to what nn.Linear would use, the gradients it needs noted, and the divergence
    computed with autocast off (so that it cannot downcast the fp32 work) against the teacher's tensors."""
    sd = compute_dtype(student_hidden, student_weight)
    hs, ws = student_hidden.to(sd), student_weight.to(sd)
    bs = student_bias.to(sd) if student_bias is not None else None
    grad_on = torch.is_grad_enabled()
    setup = replace(setup, grad_flags=(grad_on and hs.requires_grad, grad_on and ws.requires_grad,
                                       grad_on and bs is not None and bs.requires_grad))
    dev = hs.device.type
    autocast = dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev)
    with torch.autocast(device_type=dev, enabled=False) if autocast else contextlib.nullcontext():
        loss, agree, tail, outside = _ChunkedDistill.apply(hs, ws, bs, setup, *teacher)
    return DistillSums(loss=loss, agree=agree, tail=tail, outside=outside)


def distill_stored_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
                        teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, *, beta: float,
                        temperature: float = 1.0, chunk_size: int = 1024,
                        student_softcap: float | None = None) -> DistillSums:
    """distill_loss with the teacher stored: its top-k ids [N, k] (int64, in descending order of probability, no
    repeats, each below the student's vocabulary) and their log-probabilities [N, k] at each row, as the teacher
    gives them at `temperature` (the student's logits are divided by it; the stored values are used as they are).
    The divergence is over the k ids and one tail bucket (1 - their sum); `tail` sums it; `outside` is 0."""
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.dim() != 2:
        raise ValueError(f"teacher ids {tuple(teacher_ids.shape)} and log-probabilities "
                         f"{tuple(teacher_logprobs.shape)}: want the same [N, k]")
    if teacher_ids.shape[0] != student_hidden.shape[0]:
        raise ValueError(f"the student has {student_hidden.shape[0]} rows and the stored teacher "
                         f"{teacher_ids.shape[0]}: they must align")
    vocab = student_weight.shape[0]
    if teacher_ids.shape[1] >= vocab:  # the student's tail would be empty: log 0
        raise ValueError(f"a stored top-k needs fewer ids than the vocabulary ({vocab}), got {teacher_ids.shape[1]}")
    setup = _check(student_hidden, student_weight, student_bias, student_hidden, student_weight, None, beta,
                   temperature, chunk_size, student_softcap, None, teacher_ids.shape[1], vocab)
    setup = replace(setup, top_k=teacher_ids.shape[1], stored=True)
    return _apply(student_hidden, student_weight, student_bias, setup, teacher_ids.detach(),
                  teacher_logprobs.detach())


def _check(hs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None, ht: torch.Tensor, wt: torch.Tensor,
           bt: torch.Tensor | None, beta: float, temperature: float, chunk_size: int, student_softcap: float | None,
           teacher_softcap: float | None, top_k: int | None, vocab: int | None) -> _Setup:
    """The arguments checked (ValueError, naming the one at fault) and resolved into a _Setup."""
    for name, h, w, b in (("student", hs, ws, bs), ("teacher", ht, wt, bt)):
        if h.dim() != 2 or w.dim() != 2 or w.shape[1] != h.shape[1]:
            raise ValueError(f"{name}: hidden {tuple(h.shape)} and weight {tuple(w.shape)}: want [N, H] and [V, H]")
        if b is not None and b.shape != (w.shape[0],):
            raise ValueError(f"{name}: bias {tuple(b.shape)} does not match its vocabulary size {w.shape[0]}")
    if hs.shape[0] != ht.shape[0]:
        raise ValueError(f"the student has {hs.shape[0]} rows and the teacher {ht.shape[0]}: they must align")
    vs, vt = ws.shape[0], wt.shape[0]
    vocab = min(vs, vt) if vocab is None else vocab
    if vs != vocab or vt < vocab:
        raise ValueError(f"vocab {vocab}: the student must have exactly the shared ids (it has {vs}) and the "
                         f"teacher at least as many (it has {vt}); slice the student's head to the shared ids")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if cap is not None and not cap > 0:
            raise ValueError(f"{name} must be a positive number or None, got {cap!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    return _Setup(float(beta), float(temperature), chunk_size, student_softcap, teacher_softcap,
                  top_k if top_k is not None and top_k < vocab else None, vocab, (False, False, False))
