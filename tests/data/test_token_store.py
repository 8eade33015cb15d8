"""The token store (finetune/data/store.py): samples streamed to flat .npy arrays and read back through memory maps,
packing from the length array alone, and the step plan as indices.

Whatever reads the store must see exactly the samples that went in, whichever path they took (buffer flushes,
labels that stop being a mask halfway, memory-mapped or read whole), and everything computed from lengths alone
(packing, the padded-epoch figures, the packed targets) must equal what the rows themselves give.
"""

from __future__ import annotations

import bisect
import random

import numpy as np
import pytest
from conftest import tiny_recipe
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.data import StepPlan, epoch_rows
from finetune.data import store as store_module
from finetune.data.pack import _rng, pack_samples, plan_packing, plan_stats
from finetune.data.report import pack_epoch0, padded_tokens_of_epoch
from finetune.data.store import Samples, SplitWriter, pair_flags, sample_lengths, target_counts
from finetune.labels import IGNORE_INDEX
from finetune.recipe import validate


def make_samples(lengths: list[int], seed: int = 0, pairs: bool = False) -> list[dict]:
    """Samples of the given lengths, tokens distinct per sample, about half of the labels masked (the first
    always); with `pairs`, each a preference pair split at a seeded point."""
    rng = random.Random(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = [1000 * i + t for t in range(n)]
        labels = [IGNORE_INDEX if t == 0 or rng.random() < 0.5 else x for t, x in enumerate(ids)]
        sample = {"input_ids": ids, "labels": labels}
        if pairs:
            chosen = rng.randint(1, n - 1)
            sample["docs"] = [chosen, n - chosen]
        samples.append(sample)
    return samples


def stored(tmp_path, samples: list[dict], split: str = "train") -> Samples:
    writer = SplitWriter(tmp_path, split)
    for sample in samples:
        writer.append(sample)
    info = writer.close()
    assert (info["samples"], info["tokens"]) == (len(samples), sum(len(s["input_ids"]) for s in samples))
    return Samples.open(tmp_path, split, info["labels"])


# --- writing and reading -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("flush", [1, 7, 1 << 20])
def test_samples_round_trip_across_flushes_and_memory_maps(tmp_path, monkeypatch, flush, mapped):
    monkeypatch.setattr(store_module, "FLUSH_TOKENS", flush)
    monkeypatch.setattr(store_module, "MMAP_MIN_BYTES", 0 if mapped else 1 << 40)
    samples = make_samples([3, 1, 9, 4, 17, 2], seed=1)
    back = stored(tmp_path, samples)
    assert isinstance(back.ids, np.memmap) == mapped
    assert back == samples and list(back) == samples and back[2:4] == samples[2:4] and back[-1] == samples[-1]
    assert np.load(tmp_path / "train.labels.npy").dtype == np.uint8  # a mask: every label is its token or -100
    assert sample_lengths(back).tolist() == [3, 1, 9, 4, 17, 2]
    with pytest.raises(IndexError):
        back[6]


@pytest.mark.parametrize("flush", [1, 5, 1 << 20])
def test_labels_that_stop_being_a_mask_halfway_are_stored_whole(tmp_path, monkeypatch, flush):
    monkeypatch.setattr(store_module, "FLUSH_TOKENS", flush)
    samples = make_samples([4, 6, 5], seed=2)
    samples.append({"input_ids": [7, 8, 9], "labels": [IGNORE_INDEX, 3, 9]})  # 3 is not its token
    samples += make_samples([2, 8], seed=3)
    back = stored(tmp_path, samples)
    assert np.load(tmp_path / "train.labels.npy").dtype == np.int32
    assert not (tmp_path / "train.labels-full.npy").exists()
    assert back == samples


def test_pairs_keep_their_documents_and_mixed_splits_are_refused(tmp_path):
    samples = make_samples([5, 9, 3], seed=4, pairs=True)
    back = stored(tmp_path, samples)
    assert back == samples and back.docs.tolist() == [s["docs"] for s in samples]
    assert pair_flags(back).tolist() == [True] * 3
    writer = SplitWriter(tmp_path, "mixed")
    writer.append(samples[0])
    with pytest.raises(ValueError, match="preference pairs and single samples"):
        writer.append({"input_ids": [1, 2], "labels": [IGNORE_INDEX, 2]})


def test_arrays_from_a_worker_and_single_samples_interleave(tmp_path):
    samples = make_samples([3, 4, 5, 6], seed=5)
    writer = SplitWriter(tmp_path, "train")
    writer.append(samples[0])
    part = samples[1:3]
    writer.extend(np.array([t for s in part for t in s["input_ids"]]), np.array([x for s in part for x in s["labels"]]),
                  np.array([len(s["input_ids"]) for s in part]), None)
    writer.append(samples[3])
    info = writer.close()
    assert Samples.open(tmp_path, "train", info["labels"]) == samples


def test_a_key_set_on_a_read_sample_is_kept_by_the_store(tmp_path):
    back = stored(tmp_path, make_samples([5, 9, 3], seed=6, pairs=True))
    for sample, ref in zip(back, [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]):
        sample["ref_logps"] = ref  # as the DPO reference pass attaches them
    assert [s["ref_logps"] for s in back] == [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]
    rows, _ = pack_samples(back, 64, seed=0)
    assert sorted(p["ref_logps"] for r in rows for p in r["pairs"]) == [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]


def test_a_header_for_any_shape_fits_its_placeholder(tmp_path):
    for shape in [(0,), (1,), (10**15,), (10**15, 2)]:
        header = store_module._header(np.dtype(np.int64), shape)
        assert len(header) == store_module.HEADER_BYTES
        path = tmp_path / "h.npy"
        path.write_bytes(header)
        with path.open("rb") as handle:
            assert np.lib.format.read_magic(handle) == (1, 0)
            assert np.lib.format.read_array_header_1_0(handle)[0] == shape


# --- packing from lengths --------------------------------------------------------------------------------------

def _old_best_fit(lengths: list[int], max_seq_len: int, rng: random.Random) -> list[list[int]]:
    """The best fit this module had before the store (a sorted list of (free, row)): the plan must not move."""
    tie = list(range(len(lengths)))
    rng.shuffle(tie)
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], tie[k]))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []
    for k in order:
        n = lengths[k]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            cap, row = free.pop(pos)
            bins[row].append(k)
        else:
            row, cap = len(bins), max_seq_len
            bins.append([k])
        cap -= n
        if cap > 0:
            bisect.insort(free, (cap, row))
    return bins


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 90), max_size=60), max_seq_len=st.integers(1, 64),
       truncation=st.sampled_from(["truncate", "drop"]), seed=st.integers(0, 1000), epoch=st.integers(0, 3))
def test_plan_equals_the_previous_best_fit(lengths, max_seq_len, truncation, seed, epoch):
    plan = plan_packing(np.array(lengths, dtype=np.int64), np.zeros(len(lengths), bool), max_seq_len, seed=seed,
                        epoch=epoch, truncation=truncation)
    kept = [i for i, n in enumerate(lengths) if n and (n <= max_seq_len or truncation == "truncate")]
    rng = _rng(seed, epoch)
    bins = _old_best_fit([min(lengths[i], max_seq_len) for i in kept], max_seq_len, rng)
    rng.shuffle(bins)
    assert [plan.row(r).tolist() for r in range(len(plan))] == [[kept[k] for k in b] for b in bins]


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(2, 40), min_size=1, max_size=30), max_seq_len=st.integers(8, 64),
       pairs=st.booleans(), seed=st.integers(0, 100))
def test_rows_targets_and_padding_from_the_store_equal_those_of_lists(tmp_path_factory, lengths, max_seq_len,
                                                                      pairs, seed):
    samples = make_samples(lengths, seed=seed, pairs=pairs)
    if pairs:
        samples = [s for s in samples if len(s["input_ids"]) <= max_seq_len] or samples[:0]
        if not samples:
            return
    back = stored(tmp_path_factory.mktemp("store"), samples)
    rows, stats = pack_samples(samples, max_seq_len, seed=seed)
    assert pack_samples(back, max_seq_len, seed=seed) == (rows, stats)
    plan = plan_packing(sample_lengths(back), pair_flags(back), max_seq_len, seed=seed)
    assert plan_stats(back, plan) == plan_stats(samples, plan) == stats  # target tokens counted without rows
    assert target_counts(back, max_seq_len).tolist() == target_counts(samples, max_seq_len).tolist()


@pytest.mark.parametrize("options", [{}, {"group_by_length": True}, {"pad_to_multiple_of": 8},
                                     {"shuffle": False}])
def test_padded_epoch_figures_from_lengths_equal_the_rows(tmp_path, options):
    raw = tiny_recipe(tmp_path / "run")
    raw["data"].update(packing=False, **options)
    raw["train"].update(micro_batch_size=3, gradient_accumulation_steps=2)
    recipe = validate(raw)
    samples = make_samples([random.Random(i).randint(1, 60) for i in range(47)])
    rows = epoch_rows(samples, recipe.data, recipe.seed, 1)
    computed = 0
    for start in range(0, len(rows), 6):
        step = rows[start:start + 6]
        if recipe.data.group_by_length:
            step = sorted(step, key=lambda r: len(r["input_ids"]), reverse=True)
        for first in range(0, len(step), 3):
            micro = step[first:first + 3]
            width = max(len(r["input_ids"]) for r in micro)
            multiple = recipe.data.pad_to_multiple_of or 1
            computed += -(-width // multiple) * multiple * len(micro)
    assert padded_tokens_of_epoch(samples, recipe, 1) == (47, computed)
    assert padded_tokens_of_epoch(stored(tmp_path, samples), recipe, 1) == (47, computed)


@pytest.mark.parametrize("packing", [True, False])
def test_the_step_plan_over_the_store_equals_the_plan_over_lists(tmp_path, packing):
    raw = tiny_recipe(tmp_path / "run")
    raw["data"].update(packing=packing, max_seq_len=48)
    raw["train"].update(micro_batch_size=2, gradient_accumulation_steps=2, epochs=2, max_steps=None)
    recipe = validate(raw)
    samples = make_samples([random.Random(i).randint(1, 60) for i in range(40)])
    back = stored(tmp_path, samples)
    listed, mapped = StepPlan(samples, recipe, 1), StepPlan(back, recipe, 1)
    assert mapped.total == listed.total > 0
    assert [mapped.step(s) for s in range(mapped.total)] == [listed.step(s) for s in range(listed.total)]
    assert pack_epoch0(back, recipe) == pack_epoch0(samples, recipe)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_in_blocks_equals_the_previous_best_fit(monkeypatch, seed):
    """Placed a block of samples at a time (a small block here: many blocks), the plan is still the one before."""
    from finetune.data import pack

    monkeypatch.setattr(pack, "_BLOCK", 7)
    lengths = np.random.default_rng(seed).integers(0, 300, size=3000)
    lengths[::50] = 700  # over max_seq_len: cut
    plan = plan_packing(lengths, np.zeros(len(lengths), bool), 512, seed=seed, epoch=1)
    kept = [i for i, n in enumerate(lengths.tolist()) if n]
    rng = _rng(seed, 1)
    bins = _old_best_fit([min(int(lengths[i]), 512) for i in kept], 512, rng)
    rng.shuffle(bins)
    assert [plan.row(r).tolist() for r in range(len(plan))] == [[kept[k] for k in b] for b in bins]


def test_read_range_reads_what_the_memory_map_holds(tmp_path):
    """The statistics read a memory-mapped split from its file (store.read_range), so that a pass over it does not
    leave it all mapped: the same values as the map's slice, for any range."""
    from finetune.data.store import read_range

    for dtype in (np.int32, np.uint8, np.int64):
        values = np.random.default_rng(0).integers(-100, 100, size=1000).astype(dtype)
        np.save(tmp_path / "a.npy", values)
        mapped = np.load(tmp_path / "a.npy", mmap_mode="r")
        for start, end in ((0, 1000), (0, 0), (17, 18), (333, 999), (999, 1000)):
            got = read_range(mapped, start, end)
            assert not isinstance(got, np.memmap) and got.dtype == dtype
            assert np.array_equal(got, mapped[start:end]) and np.array_equal(read_range(values, start, end), got)
