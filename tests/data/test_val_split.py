"""data.val_fraction without holding the examples (finetune/data/samples.py): the held-out indices are those a
shuffled list gave, the samples and stats are those of splitting a list of every example, and the streams hold
one example at a time."""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
from pathlib import Path

import pytest
from conftest import tiny_recipe

from finetune.data import DataStats, build_samples, load_examples, tokenize_examples
from finetune.data.samples import _split, held_out
from finetune.errors import UserError
from finetune.recipe import validate


def chat_row(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i} ok"}]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def listed_split(n: int, fraction: float, seed: int) -> set[int]:
    """The split as it was made on a list of every example."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return set(order[:max(1, round(n * fraction))])


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_held_out_indices_are_the_shuffled_lists(seed):
    for n in (*range(2, 40), 1000, 4099):
        for fraction in (0.01, 0.1, 0.25, 0.5, 0.9):
            if max(1, round(n * fraction)) >= n:
                continue
            held = held_out(n, fraction, seed)
            assert {i for i, h in enumerate(held) if h} == listed_split(n, fraction, seed), (n, fraction)
    with pytest.raises(UserError, match="data.val_fraction: 0.5 of 1 training rows leaves none to train on"):
        held_out(1, 0.5, seed)
    assert held_out(0, 0.5, seed) == bytearray()  # no rows: the "no training samples" error comes later


def test_split_samples_and_stats_equal_splitting_a_list(tmp_path, tokenizer):
    rows = [chat_row(i) for i in range(60)]
    rows[7] = {"messages": []}  # bad rows are not examples: they shift the indices after them
    rows[30] = {"x": 1}
    raw = tiny_recipe(tmp_path / "out", write_jsonl(tmp_path / "train.jsonl", rows))
    raw["data"].update(val_fraction=0.2, on_bad_row="skip", num_proc=1)
    raw["seed"] = 3
    recipe = validate(raw)
    train, evals, train_stats, eval_stats = build_samples(recipe, tokenizer)
    # The reference: every example in a list, split as before, each part tokenized.
    stats = DataStats()
    examples = load_examples(recipe.datasets, "skip", stats, "datasets", recipe.data)
    held = listed_split(len(examples), 0.2, 3)
    ref_eval_stats = DataStats()
    ref_train = tokenize_examples([e for i, e in enumerate(examples) if i not in held], tokenizer, recipe.data, stats)
    ref_evals = tokenize_examples([e for i, e in enumerate(examples) if i in held], tokenizer, recipe.data,
                                  ref_eval_stats)
    assert (train, evals) == (ref_train, ref_evals) and len(evals) == 12
    assert (train_stats, eval_stats) == (stats, ref_eval_stats)
    assert train_stats.rows_read == 60 and train_stats.bad_rows_skipped == 2


def test_the_split_streams_hold_one_example_at_a_time(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question {i} " + "word " * 60},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(1500)]
    raw = tiny_recipe(tmp_path / "out", write_jsonl(tmp_path / "train.jsonl", rows))
    raw["data"]["val_fraction"] = 0.1
    recipe = validate(raw)
    gc.collect()
    tracemalloc.start()
    try:
        counts = [sum(1 for _ in part) for part in _split(recipe, DataStats())]
        peak = tracemalloc.get_traced_memory()[1]
        every = load_examples(recipe.datasets, "error", DataStats(), "datasets", recipe.data)
        held_whole = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert counts == [1350, 150] and len(every) == 1500
    assert peak < held_whole / 5  # the examples held in a list take more than 5x what the streams ever held


def test_a_data_file_that_changes_between_the_passes_is_named(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(10)])
    raw = tiny_recipe(tmp_path / "out", path)
    raw["data"]["val_fraction"] = 0.2
    train, _ = _split(validate(raw), DataStats())
    write_jsonl(path, [chat_row(i) for i in range(12)])  # rows appended after they were counted
    with pytest.raises(UserError, match="10 training examples were read, then 12: a data file changed"):
        list(train)


def split_recipe(tmp_path: Path, paths: list[Path], num_proc: int, **data_keys):
    raw = tiny_recipe(tmp_path / f"out{num_proc}", paths[0])
    raw["datasets"] += [{"path": str(p), "format": "chat"} for p in paths[1:]]
    raw["data"].update(val_fraction=0.1, num_proc=num_proc, **data_keys)
    raw["seed"] = 5
    return validate(raw)


def test_a_split_read_by_workers_equals_one_process(tmp_path, tokenizer):
    # With workers, a split of JSONL and parquet datasets is read in them (samples._split_in_workers): a first pass
    # counts each chunk's examples, then each part keeps its own. Samples, stats and bad rows as one process.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [chat_row(i) for i in range(1300)]
    for i in (3, 700, 1299):
        rows[i] = {"messages": []}
    first = write_jsonl(tmp_path / "a.jsonl", rows)
    second = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([chat_row(i) for i in range(300)] + [{"messages": []}]), second)
    one, two = (build_samples(split_recipe(tmp_path, [first, second], n, on_bad_row="skip"), tokenizer)
                for n in (1, 2))
    assert one == two and len(one[1]) == 160 and one[2].bad_rows_skipped == 4
    # A bad row under on_bad_row: error stops the first pass, in input order, before anything is tokenized.
    rows[900] = "not an object"
    write_jsonl(tmp_path / "a.jsonl", rows)
    for n in (1, 2):
        with pytest.raises(UserError, match=r"a.jsonl:4: empty conversation"):
            build_samples(split_recipe(tmp_path, [first, second], n), tokenizer)


@pytest.mark.parametrize("change", ["rows appended", "cut at a chunk's end"])
def test_a_data_file_that_changes_between_the_workers_passes_is_named(tmp_path, tokenizer, monkeypatch, change):
    # The file is rewritten between the split's first read and the parts' (when the held-out indices are drawn):
    # a chunk with another number of examples (read by a worker), or another number of chunks, is refused.
    from finetune.data import samples

    path = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(600)])
    real = samples.held_out

    def held_out(*args):
        write_jsonl(path, [chat_row(i) for i in range(700 if change == "rows appended" else 512)])
        return real(*args)

    monkeypatch.setattr(samples, "held_out", held_out)
    expected = r"train.jsonl:513: 188 examples where the first read found 88" if change == "rows appended" else \
        "the training files read as 1 chunks, where the first read found 2"
    with pytest.raises(UserError, match=rf"{expected}: a data file changed while it was read"):
        build_samples(split_recipe(tmp_path, [path], 2), tokenizer)
