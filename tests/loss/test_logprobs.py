"""Per-token log-probabilities through the output layer (finetune/loss/logprobs.py): the chunked recompute-in-backward
function equals the naive one built on full logits, in value and in the gradient of any weighting of the tokens; the
entropy summed in the same pass (entropy_sum) equals the naive one too."""

from __future__ import annotations

import pytest
import torch

from finetune.labels import IGNORE_INDEX
from finetune.loss.logprobs import chunked_entropy_sum, entropy_sum, token_logprobs


def _inputs(dtype=torch.float64, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 9, 16, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(40, 16, generator=g, dtype=dtype) * 0.3).requires_grad_(True)
    b = (torch.randn(40, generator=g, dtype=dtype) * 0.1).requires_grad_(True) if bias else None
    labels = torch.randint(0, 40, (2, 9), generator=g)
    labels[0, :3] = IGNORE_INDEX  # a prompt
    labels[1, 5] = IGNORE_INDEX
    return hidden, weight, b, labels


def _grads(impl, chunk, softcap, dtype=torch.float64):
    hidden, weight, bias, labels = _inputs(dtype)
    logp, keep = token_logprobs(hidden, weight, labels, bias, impl=impl, chunk_size=chunk, softcap=softcap)
    upstream = torch.linspace(-1.5, 2.0, logp.numel(), dtype=logp.dtype)  # a different weight per token
    (logp * upstream).sum().backward()
    return logp.detach(), keep, hidden.grad, weight.grad, bias.grad


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_equals_naive_values_and_gradients(chunk, softcap):
    naive = _grads("torch", 1024, softcap)
    chunked = _grads("chunked", chunk, softcap)
    assert torch.equal(naive[1], chunked[1])
    for a, b in zip(naive[:1] + naive[2:], chunked[:1] + chunked[2:]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_logprobs_are_the_negative_cross_entropy_of_the_shifted_targets():
    hidden, weight, bias, labels = _inputs()
    logp, keep = token_logprobs(hidden, weight, labels, bias)
    logits = hidden @ weight.t() + bias
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    flat = targets.reshape(-1)
    assert torch.equal(keep, (flat != IGNORE_INDEX).nonzero().squeeze(1))
    expected = torch.log_softmax(logits.reshape(-1, 40), dim=-1)[keep, flat[keep]]
    assert torch.allclose(logp, expected, rtol=1e-12, atol=1e-12)
    assert (logp < 0).all()


def test_gradcheck():
    # Smaller than _inputs (two rows of 6 tokens, vocab 12): gradcheck perturbs every input element one at a time,
    # and chunks of 5 still split the 8 kept tokens across the row boundary.
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(12, 8, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    bias = (torch.randn(12, generator=g, dtype=torch.float64) * 0.1).requires_grad_(True)
    labels = torch.randint(0, 12, (2, 6), generator=g)
    labels[0, :2] = IGNORE_INDEX
    labels[1, 3] = IGNORE_INDEX

    def f(h, w, b):
        return token_logprobs(h, w, labels, b, chunk_size=5, softcap=2.0)[0]

    assert f(hidden, weight, bias).numel() == 8  # 10 shifted targets, 2 of them ignored
    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_bf16_close_to_float32():
    hidden, weight, bias, labels = _inputs(torch.float32)
    ref, _ = token_logprobs(hidden, weight, labels, bias, chunk_size=4)
    low, _ = token_logprobs(hidden.bfloat16(), weight.bfloat16(), labels, bias.bfloat16(), chunk_size=4)
    assert low.dtype == torch.float32  # accumulated in float32
    assert (low - ref).abs().max() < 0.1


def test_no_targets_still_reach_every_input():
    hidden, weight, bias, labels = _inputs(bias=True)
    logp, keep = token_logprobs(hidden, weight, torch.full_like(labels, IGNORE_INDEX), bias)
    assert logp.numel() == 0 and keep.numel() == 0
    logp.sum().backward()  # a filler micro-batch: zero, but in the graph (distributed hooks fire)
    assert hidden.grad is not None and weight.grad is not None and float(weight.grad.abs().sum()) == 0.0


@torch.no_grad()
def _naive_entropy(hidden, weight, bias, keep, softcap):
    logits = (hidden @ weight.t() + bias).reshape(-1, weight.shape[0])[keep]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits, dim=-1)
    return float(-(logp.exp() * logp).sum())


@pytest.mark.parametrize(("impl", "chunk"), [("chunked", 1), ("chunked", 4), ("chunked", 1000), ("torch", 1024)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_entropy_sum_equals_naive_and_leaves_the_logprobs_alone(impl, chunk, softcap):
    hidden, weight, bias, labels = _inputs()
    plain, _ = token_logprobs(hidden, weight, labels, bias, impl=impl, chunk_size=chunk, softcap=softcap)
    with entropy_sum() as entropy:
        logp, keep = token_logprobs(hidden, weight, labels, bias, impl=impl, chunk_size=chunk, softcap=softcap)
        token_logprobs(hidden, weight, labels, bias, impl=impl, chunk_size=chunk, softcap=softcap)  # summed twice
    expected = _naive_entropy(hidden, weight, bias, keep, softcap)
    assert float(entropy.total) == pytest.approx(2 * expected, rel=1e-12) and expected > 0
    assert not entropy.total.requires_grad and entropy.total.dtype == torch.float64
    assert torch.equal(logp, plain)
    logp.sum().backward()  # the gradient path is untouched by the extra figure
    with entropy_sum() as outside:
        pass
    assert outside.total is None


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_entropy_sum_for_kernels_that_keep_no_logits(chunk):
    """What the Liger path sums (its kernel keeps no logits): the same figure in a separate chunked pass."""
    hidden, weight, bias, labels = _inputs()
    _, keep = token_logprobs(hidden, weight, labels, bias)
    rows = hidden.reshape(-1, 16)[keep]
    got = chunked_entropy_sum(rows, weight, bias, chunk, 2.0)
    assert float(got) == pytest.approx(_naive_entropy(hidden, weight, bias, keep, 2.0), rel=1e-12)
