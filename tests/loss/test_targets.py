"""finetune/batch.py's Targets: a micro-batch's target positions and id range found on the CPU, so the fused loss
and the per-token log-probabilities need no host sync. With them the results are the same numbers, bit for bit,
as when the loss finds the targets itself; bad ids are still refused; and MicroBatch.to prepares a micro-batch
ahead with the same tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.batch import find_targets
from finetune.errors import UserError
from finetune.loss.fused import IGNORE_INDEX, linear_cross_entropy, shift_labels
from finetune.loss.logprobs import token_logprobs


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 9), p=st.floats(0, 1), seed=st.integers(0, 10_000))
def test_find_targets_is_the_loss_own_rule(b, t, p, seed):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (b, t), generator=gen)
    labels[torch.rand(b, t, generator=gen) < p] = IGNORE_INDEX
    found = find_targets(labels)
    shifted = shift_labels(labels).reshape(-1)
    keep = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
    assert torch.equal(found.index, keep) and found.count == keep.numel()
    ids = shifted[keep]
    assert (found.low, found.high) == ((int(ids.min()), int(ids.max())) if ids.numel() else (0, 0))


def _case(seed: int = 0, vocab: int = 40):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, 16, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 7), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    labels[1, 5] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("impl", ["chunked", "torch"])
@pytest.mark.parametrize("per_token", [False, True])
def test_found_targets_give_the_same_loss_and_gradients(impl, per_token):
    results = []
    for targets in (None, "found"):
        hidden, weight, labels = _case()
        found = find_targets(labels) if targets else None
        fn = token_logprobs if per_token else linear_cross_entropy
        out, _ = fn(hidden, weight, labels, impl=impl, chunk_size=4, targets=found)
        out.sum().backward()
        results.append((out.detach(), hidden.grad, weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_found_targets_still_refuse_ids_outside_the_vocabulary():
    hidden, weight, labels = _case()
    labels[1, 3] = 40  # == vocab
    for fn in (linear_cross_entropy, token_logprobs):
        with pytest.raises(UserError, match="outside the model's vocabulary"):
            fn(hidden, weight, labels, targets=find_targets(labels))
    labels[1, 3] = IGNORE_INDEX
    labels[1, 4] = -7
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        linear_cross_entropy(hidden, weight, labels, targets=find_targets(labels))


def test_no_targets_found_is_a_zero_in_the_graph():
    hidden, weight, labels = _case()
    labels[:] = IGNORE_INDEX
    loss, n = linear_cross_entropy(hidden, weight, labels, targets=find_targets(labels))
    assert loss.item() == 0.0 and n.item() == 0 and loss.requires_grad


def test_a_batch_prepared_ahead_is_the_same_batch():
    from finetune.data.collate import collate_packed

    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "position_ids": [0, 1, 2, 0, 1]},
            {"input_ids": [3, 4], "labels": [-100, 4], "position_ids": [0, 1]}]
    batch = collate_packed(rows, pad_token_id=0)
    assert batch.targets == 4 and batch.device is None
    ready = batch.to("cpu")
    assert ready.to(torch.device("cpu")) is ready  # prepared once
    assert ready.targets == 4 and ready.seq_tokens == batch.seq_tokens  # the host counts stay
    inputs = ready.model_inputs()
    assert set(inputs) == {"input_ids", "labels", "position_ids", "targets", "documents"}
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(inputs[key], getattr(batch, key))
    assert torch.equal(inputs["targets"].index, find_targets(batch.labels).index)
    assert inputs["documents"].cu_seqlens.tolist() == [0, 3, 5, 7, 10]  # the padding is one more document
    with pytest.raises(AssertionError, match="to\\(device\\)"):
        batch.model_inputs()


def test_found_targets_carry_their_ids_and_the_loss_takes_them():
    """find_targets also gathers the target ids on the CPU (the loss then shifts and gathers nothing on the device):
    the shifted labels at the target positions, one tensor with the positions."""
    hidden, weight, labels = _case()
    found = find_targets(labels)
    shifted = shift_labels(labels).reshape(-1)
    assert torch.equal(found.ids, shifted[found.index]) and found.ids.dtype == torch.int64
    without_ids = type(found)(found.index, found.count, found.low, found.high)
    a, _ = linear_cross_entropy(hidden, weight, labels, targets=found)
    b, _ = linear_cross_entropy(hidden, weight, labels, targets=without_ids)
    assert torch.equal(a, b)
