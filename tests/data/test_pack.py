"""Sample packing: best-fit decreasing rows, token accounting, and proof that packed documents are isolated.

The model tests are the point of this file: packing is only correct if a document's logits inside a packed
micro-batch equal its logits when run alone. They also show that the guard matters: with use_cache=True
(the config default) transformers 5.23.0 lets packed documents attend to each other.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import one_thread
from hypothesis import given, settings
from hypothesis import strategies as st
from packed_rows import VOCAB, packed_batch, packed_vs_alone, tiny_model

from finetune.attention import dispatch as attention
from finetune.data.collate import collate_packed
from finetune.data.pack import IGNORE_INDEX, PackStats, pack_samples
from finetune.errors import UserError
from finetune.model.isolation import check_packing_isolation, default_tolerance

# --- helpers --------------------------------------------------------------------------------------------


def make_samples(lengths: list[int], seed: int = 0) -> list[dict]:
    """Samples whose token ids are unique per sample (so each can be found again) with some masked labels."""
    rng = random.Random(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = [i * 100_000 + j for j in range(n)]
        labels = [t if rng.random() < 0.7 else IGNORE_INDEX for t in ids]
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def documents(rows: list[dict]) -> list[dict]:
    """Cut packed rows back into their documents using doc_lengths."""
    docs = []
    for row in rows:
        start = 0
        for n in row["doc_lengths"]:
            docs.append({key: row[key][start : start + n] for key in ("input_ids", "labels", "position_ids")})
            start += n
        assert start == len(row["input_ids"])
    return docs


def expected_documents(samples: list[dict], max_seq_len: int, truncation: str) -> list[dict]:
    kept = []
    for s in samples:
        n = len(s["input_ids"])
        if n == 0 or (n > max_seq_len and truncation == "drop"):
            continue
        kept.append({"input_ids": s["input_ids"][:max_seq_len], "labels": s["labels"][:max_seq_len]})
    return kept


def as_key(doc: dict) -> tuple:
    # The first label is replaced by -100 on packing; everything else must survive untouched.
    return tuple(doc["input_ids"]), tuple(doc["labels"][1:])


# --- pack_samples: properties ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    max_seq_len=st.integers(1, 48),
    lengths=st.lists(st.integers(0, 120), max_size=40),
    truncation=st.sampled_from(["truncate", "drop"]),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
)
def test_pack_invariants(max_seq_len: int, lengths: list[int], truncation: str, seed: int, epoch: int):
    samples = make_samples(lengths, seed=seed % 1000)
    rows, stats = pack_samples(samples, max_seq_len, seed=seed, epoch=epoch, truncation=truncation)

    for row in rows:
        n = len(row["input_ids"])
        assert 0 < n <= max_seq_len
        assert len(row["labels"]) == len(row["position_ids"]) == n == sum(row["doc_lengths"])
        assert all(d >= 1 for d in row["doc_lengths"])

    # Every kept sample appears exactly once, intact, and nothing else does.
    docs = documents(rows)
    expected = expected_documents(samples, max_seq_len, truncation)
    assert Counter(map(as_key, docs)) == Counter(map(as_key, expected))
    for doc in docs:
        assert doc["position_ids"] == list(range(len(doc["input_ids"])))  # restart per document
        assert doc["labels"][0] == IGNORE_INDEX  # no target across a document boundary

    # Token accounting: nothing disappears without being counted.
    too_long = [n for n in lengths if n > max_seq_len]
    assert stats.samples == len(samples)
    assert stats.input_tokens == sum(lengths)
    assert stats.input_tokens == stats.tokens + stats.truncated_tokens + stats.dropped_tokens
    assert (
        stats.tokens == sum(len(r["input_ids"]) for r in rows) == sum(len(d["input_ids"]) for d in expected)
    )
    if truncation == "truncate":
        assert stats.truncated == len(too_long)
        assert stats.truncated_tokens == sum(n - max_seq_len for n in too_long)
        assert stats.dropped == lengths.count(0) and stats.dropped_tokens == 0
    else:
        assert stats.truncated == 0 and stats.truncated_tokens == 0
        assert stats.dropped == lengths.count(0) + len(too_long)
        assert stats.dropped_tokens == sum(too_long)
    assert stats.rows == len(rows)
    assert stats.capacity == len(rows) * max_seq_len
    assert stats.target_tokens == sum(x != IGNORE_INDEX for r in rows for x in r["labels"])
    assert stats.target_tokens == sum(x != IGNORE_INDEX for d in expected for x in d["labels"][1:])
    if rows:
        assert stats.efficiency == pytest.approx(stats.tokens / (len(rows) * max_seq_len))
        assert 0 < stats.efficiency <= 1
    else:
        assert stats.efficiency == 0.0

    # Deterministic for (seed, epoch).
    again, stats_again = pack_samples(samples, max_seq_len, seed=seed, epoch=epoch, truncation=truncation)
    assert again == rows and stats_again == stats


def test_epochs_and_seeds_reshuffle():
    rng = random.Random(3)
    samples = make_samples([rng.randint(1, 300) for _ in range(300)])
    by_epoch = [pack_samples(samples, 512, seed=7, epoch=e)[0] for e in range(4)]
    orders = [tuple(tuple(r["input_ids"][:1]) for r in rows) for rows in by_epoch]
    assert len(set(orders)) == 4  # another epoch, another order
    assert pack_samples(samples, 512, seed=8, epoch=0)[0] != by_epoch[0]  # another seed too
    for rows in by_epoch:  # same documents every epoch
        assert Counter(map(as_key, documents(rows))) == Counter(map(as_key, samples))


def test_equal_length_ties_regroup_per_epoch():
    # All samples of one length: only the seeded tie-break decides which share a row.
    samples = make_samples([10] * 40)
    groupings = {
        frozenset(
            frozenset(d["input_ids"][0] for d in documents([r]))
            for r in pack_samples(samples, 30, seed=1, epoch=e)[0]
        )
        for e in range(3)
    }
    assert len(groupings) == 3


def test_truncate_and_drop_examples():
    samples = make_samples([5, 0, 12, 8])
    rows, stats = pack_samples(samples, 8, seed=0, truncation="truncate")
    assert (stats.truncated, stats.truncated_tokens, stats.dropped, stats.dropped_tokens) == (1, 4, 1, 0)
    assert sorted(len(d["input_ids"]) for d in documents(rows)) == [5, 8, 8]
    truncated = next(d for d in documents(rows) if d["input_ids"][0] == 200_000)
    assert truncated["input_ids"] == samples[2]["input_ids"][:8]  # the first max_seq_len tokens

    rows, stats = pack_samples(samples, 8, seed=0, truncation="drop")
    assert (stats.truncated, stats.truncated_tokens, stats.dropped, stats.dropped_tokens) == (0, 0, 2, 12)
    assert sorted(len(d["input_ids"]) for d in documents(rows)) == [5, 8]


def test_empty_input_and_bad_samples():
    rows, stats = pack_samples([], 16, seed=0)
    assert rows == [] and stats == PackStats(0, 0, 0, 0, 0, 0, 0) and stats.efficiency == 0.0
    with pytest.raises(UserError, match="sample 1: input_ids has 3 tokens but labels has 2"):
        pack_samples(
            [{"input_ids": [1], "labels": [1]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}], 8, seed=0
        )
    with pytest.raises(ValueError):
        pack_samples([], 0, seed=0)
    with pytest.raises(ValueError):
        pack_samples([], 8, seed=0, truncation="wrap")  # type: ignore[arg-type]


def test_best_fit_decreasing_efficiency_on_long_tail():
    # Chat-like lengths: lognormal, median ~245 tokens, a long tail past max_seq_len.
    rng = random.Random(0)
    lengths = [max(1, int(rng.lognormvariate(5.5, 1.0))) for _ in range(4000)]
    samples = [{"input_ids": [1] * n, "labels": [1] * n} for n in lengths]
    rows, stats = pack_samples(samples, 2048, seed=0)  # its speed: benchmarks/packing.py
    lower_bound = math.ceil(stats.tokens / 2048)
    assert stats.efficiency >= 0.98
    assert stats.rows <= lower_bound * 1.01 + 1


# --- collate_packed -------------------------------------------------------------------------------------


def test_collate_packed_pads_as_an_isolated_document():
    rows, _ = pack_samples(make_samples([7, 11, 5, 9, 3]), 23, seed=0)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    assert lengths == [12, 23]  # BFD: [11, 9, 3] and [7, 5]
    batch = collate_packed(rows, pad_token_id=-1)
    assert batch.packed and batch.attention_mask is None  # documents are told apart by position_ids, not a mask
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (2, 23)
    assert all(t.dtype == torch.long for t in (batch.input_ids, batch.labels, batch.position_ids))
    assert batch.seq_tokens == 35 and batch.padded_tokens == 46
    short = min(range(2), key=lambda i: len(rows[i]["input_ids"]))
    assert batch.input_ids[short, 12:].tolist() == [-1] * 11
    assert batch.labels[short, 12:].tolist() == [IGNORE_INDEX] * 11
    assert batch.position_ids[short].tolist() == rows[short]["position_ids"] + list(range(11))
    # The padding's restart at 0 is what ends the last real document.
    assert batch.position_ids[short, 12].item() == 0
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch.input_ids[i, :n].tolist() == row["input_ids"]
        assert batch.labels[i, :n].tolist() == row["labels"]


def test_collate_packed_full_rows_have_no_padding():
    rows = [{"input_ids": [1, 2], "labels": [-100, 2], "position_ids": [0, 1], "doc_lengths": [2]}] * 3
    batch = collate_packed(rows, pad_token_id=0)
    assert batch.input_ids.shape == (3, 2) and batch.seq_tokens == batch.padded_tokens == 6
    with pytest.raises(ValueError):
        collate_packed([], pad_token_id=0)


# --- packed == unpacked on real models ------------------------------------------------------------------

MODELS = [
    pytest.param(transformers.LlamaConfig, "sdpa", id="llama-sdpa"),
    pytest.param(transformers.LlamaConfig, "eager", id="llama-eager"),
    pytest.param(transformers.Qwen2Config, "sdpa", id="qwen2-sdpa"),
    pytest.param(transformers.Qwen2Config, "eager", id="qwen2-eager"),
]
# The implementations that isolate packed documents: transformers' (with use_cache=False) and ours, which takes
# the documents from position_ids (finetune/attention/dispatch.py, what `attn_implementation: auto` picks).
attention.register()
ISOLATING = [
    *MODELS,
    pytest.param(transformers.LlamaConfig, attention.ATTN_NAME, id="llama-varlen"),
    pytest.param(transformers.Qwen2Config, attention.ATTN_NAME, id="qwen2-varlen"),
]


@pytest.mark.parametrize(("config_cls", "impl"), ISOLATING)
def test_packed_logits_equal_unpacked(config_cls: type, impl: str):
    model = tiny_model(config_cls, impl)
    error = packed_vs_alone(model, use_cache=False)
    print(f"{config_cls.__name__} {impl}: packed vs alone max abs logit error {error:.2e} (use_cache=False)")
    assert error <= 1e-5


@pytest.mark.parametrize(("config_cls", "impl"), MODELS)
def test_use_cache_true_leaks_across_documents(config_cls: type, impl: str):
    # Proves the comparison above has power: with a cache (passed, or the config default) transformers
    # 5.23.0 skips packed-sequence detection and documents attend to each other.
    model = tiny_model(config_cls, impl)
    leak = packed_vs_alone(model, use_cache=True)
    leak_default = packed_vs_alone(model)
    print(f"{config_cls.__name__} {impl}: packed vs alone max abs logit error {leak:.3f} (use_cache=True)")
    assert leak > 1e-2
    assert leak_default == pytest.approx(leak)


@pytest.mark.parametrize(("config_cls", "impl"), ISOLATING)
def test_packed_loss_equals_unpacked_loss(config_cls: type, impl: str):
    # End to end with the labels: the shifted loss over packed rows trains exactly the targets of the
    # documents run alone (the first label of a document is never a target, alone or packed).
    model = tiny_model(config_cls, impl)
    _, batch, spans = packed_batch()
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
        ).logits
        labels = batch.labels[:, 1:]
        packed_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum")
        packed_count = int((labels != IGNORE_INDEX).sum())
        alone_sum, alone_count = 0.0, 0
        for _, _, ids, doc_labels in spans:
            doc_logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            target = torch.tensor(doc_labels[1:])
            alone_sum += F.cross_entropy(doc_logits[:-1], target, reduction="sum").item()
            alone_count += int((target != IGNORE_INDEX).sum())
    assert packed_count == alone_count == sum(len(ids) - 1 for _, _, ids, _ in spans)
    assert packed_sum.item() == pytest.approx(alone_sum, rel=1e-5)


# --- check_packing_isolation ----------------------------------------------------------------------------


class CachingWrapper(torch.nn.Module):
    """A wrapper that (wrongly) runs the model with its cache on: packed documents then leak."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, **kwargs):
        kwargs["use_cache"] = True
        return self.model(**kwargs)


@pytest.mark.parametrize(("config_cls", "impl"), ISOLATING)
def test_isolation_check_passes_and_restores_modes(config_cls: type, impl: str):
    model = tiny_model(config_cls, impl).train()
    model.model.layers[0].eval()  # a module deliberately in eval mode must stay so
    with one_thread():
        error = check_packing_isolation(model, VOCAB)
    assert error <= default_tolerance(torch.float32)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training


@pytest.mark.parametrize(("config_cls", "impl"), MODELS)
def test_isolation_check_catches_a_leaking_model(config_cls: type, impl: str):
    model = tiny_model(config_cls, impl)
    with pytest.raises(UserError) as info:
        check_packing_isolation(CachingWrapper(model), VOCAB)
    message = str(info.value)
    print(message)
    for needle in ("leaking attention", "data.packing", "model.attn_implementation", "sdpa",
                   "flash_attention_2", "data.packing_check: false", impl):  # fmt: skip
        assert needle in message
    assert not model.training  # eval before, eval after


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_isolation_check_in_half_precision(dtype: torch.dtype):
    # Same kernels in both runs, so isolation gives exactly 0 even in half precision, and a leak is caught.
    model = tiny_model(transformers.LlamaConfig, "sdpa", dtype=dtype)
    assert check_packing_isolation(model, VOCAB) <= default_tolerance(dtype)
    with pytest.raises(UserError):
        check_packing_isolation(CachingWrapper(model), VOCAB)


def test_isolation_check_with_a_peft_adapter():
    peft = pytest.importorskip("peft")
    base = tiny_model(transformers.LlamaConfig, "sdpa")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert check_packing_isolation(model, VOCAB) <= 1e-4


def test_isolation_check_explicit_tolerance_and_vocab_clamp():
    model = CachingWrapper(tiny_model(transformers.LlamaConfig, "eager"))
    # A huge tolerance lets the leak through and returns its size; a vocab larger than the embedding
    # (len(tokenizer) before a resize) is clamped instead of indexing out of range.
    leak = check_packing_isolation(model, VOCAB * 10, tolerance=1e9)
    assert leak > 1e-2
