"""Per-token log-probabilities through the output layer (finetune/loss/logprobs.py): the chunked recompute-in-backward
function equals the naive one built on full logits, in value and in the gradient of any weighting of the tokens."""

from __future__ import annotations

import pytest
import torch

from finetune.labels import IGNORE_INDEX
from finetune.loss.logprobs import token_logprobs


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
    hidden, weight, bias, labels = _inputs()

    def f(h, w, b):
        return token_logprobs(h, w, labels, b, chunk_size=5, softcap=2.0)[0]

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
