"""Tokenization as a stream through worker processes (finetune/data/shards.py): the samples, the stats, the bad
rows and the errors are exactly those of reading every row first and tokenizing them in one process, for any
number of workers; the rows are consumed as they are tokenized, never all at once.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
from conftest import tiny_recipe

from finetune.data import DataStats, build_samples, load_examples, tokenize_examples
from finetune.data.cache import prepare
from finetune.data.shards import Job, Progress, tokenize_stream, workers_for
from finetune.data.sources import BadRow
from finetune.errors import UserError
from finetune.recipe import DataConfig, validate

LONE_SURROGATE = '{"messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", "content": "ok"}]}'


def chat_line(i: int) -> str:
    turns = [{"role": "user", "content": f"Say {i}: " + "word " * (i % 9)},
             {"role": "assistant", "content": f"{i} " + "ok " * (i % 13)}]
    return json.dumps({"messages": turns})


def write_rows(path: Path, n: int, bad: dict[int, str]) -> Path:
    """n rows (1-based lines), the lines in `bad` replaced by the given text."""
    path.write_text("".join(bad.get(i, chat_line(i)) + "\n" for i in range(1, n + 1)), encoding="utf-8")
    return path


# Unreadable rows (caught while reading) and rows the tokenizer refuses (caught while tokenizing), spread out.
MIXED_BAD = {5: "{not json", 40: LONE_SURROGATE, 300: '{"messages": [{"role": "wizard", "content": "x"}]}',
             333: LONE_SURROGATE, 610: "[1, 2]", 640: LONE_SURROGATE, 650: "{oops", 700: LONE_SURROGATE}


def recipe_for(tmp_path: Path, data: Path, **data_keys):
    raw = tiny_recipe(tmp_path / "run", data)
    raw["data"].update(max_seq_len=24, **data_keys)  # some samples truncated: their counts must merge too
    return validate(raw)


def reference(recipe, tokenizer):
    """How samples were made before streaming: every row read and converted first, then tokenized in one process."""
    stats = DataStats()
    examples = load_examples(recipe.datasets, recipe.data.on_bad_row, stats, "datasets", recipe.data)
    one = recipe.data.model_copy(update={"num_proc": 1})
    return tokenize_examples(examples, tokenizer, one, stats, recipe.data.on_bad_row), stats


@pytest.mark.parametrize("num_proc", [1, 2])
def test_streamed_samples_and_stats_equal_reading_everything_first(tmp_path, tokenizer, num_proc):
    data = write_rows(tmp_path / "rows.jsonl", 900, MIXED_BAD)
    recipe = recipe_for(tmp_path, data, on_bad_row="skip", num_proc=num_proc)
    train, evals, stats, _ = build_samples(recipe, tokenizer)
    expected, expected_stats = reference(recipe, tokenizer)
    assert stats.truncated > 0 and stats.bad_rows_skipped == len(MIXED_BAD)
    assert train == expected and evals == [] and stats == expected_stats
    # The rows unreadable on their own are named before those the tokenizer refused, as when all were read first.
    named = [e.split(": ")[0].rsplit(":", 1)[1] for e in stats.bad_row_examples]
    assert named == ["5", "300", "610", "650", "40"], stats.bad_row_examples


@pytest.mark.parametrize("num_proc", [1, 2])
def test_an_unreadable_row_is_the_error_even_after_a_row_the_tokenizer_refused(tmp_path, tokenizer, num_proc):
    data = write_rows(tmp_path / "rows.jsonl", 900, {40: LONE_SURROGATE, 820: "{not json"})
    recipe = recipe_for(tmp_path, data, num_proc=num_proc)
    with pytest.raises(BadRow, match=rf"{data}:820: malformed JSON"):
        build_samples(recipe, tokenizer)
    clean = recipe_for(tmp_path, write_rows(tmp_path / "clean.jsonl", 900, {40: LONE_SURROGATE}), num_proc=num_proc)
    with pytest.raises(BadRow, match=r"clean.jsonl:40: the tokenizer cannot encode this row"):
        build_samples(clean, tokenizer)


def test_max_rows_and_the_store_agree_with_one_process(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path / "cache"))
    data = write_rows(tmp_path / "rows.jsonl", 900, MIXED_BAD)
    raw = tiny_recipe(tmp_path / "run", data)
    raw["datasets"][0]["max_rows"] = 620
    raw["data"].update(on_bad_row="skip", num_proc=2)
    parallel = prepare(validate(raw), tokenizer)
    raw["data"]["num_proc"] = 1
    serial, serial_stats = reference(validate(raw), tokenizer)
    assert parallel.train == serial and parallel.train_stats == serial_stats
    assert serial_stats.rows_read == 620 + 3  # the 3 unreadable rows among them are read, not taken


class Watched(list):
    """A sink that notes how many chunks its source had given when the first sample arrived."""

    def __init__(self, chunks: list) -> None:
        super().__init__()
        self.chunks, self.consumed, self.at_first = chunks, 0, None

    def source(self):
        for chunk in self.chunks:
            self.consumed += 1
            yield chunk

    def append(self, sample: dict) -> None:
        if self.at_first is None:
            self.at_first = self.consumed
        super().append(sample)


@pytest.mark.parametrize("workers", [1, 2])
def test_chunks_are_consumed_as_they_are_tokenized(tmp_path, tokenizer, workers):
    data = write_rows(tmp_path / "rows.jsonl", 3000, {})
    examples = load_examples(recipe_for(tmp_path, data).datasets, "error", DataStats())
    out = Watched([examples[i:i + 100] for i in range(0, len(examples), 100)])
    job = Job(tokenizer, DataConfig(max_seq_len=24), "error", {})
    assert tokenize_stream(out.source(), job, DataStats(), out, workers) is None
    assert len(out) == 3000 and out.consumed == 30
    # No more than the head that decides on a pool (256 examples: 3 chunks) and the chunks in flight.
    assert out.at_first <= 3 + 2 * 3 + 1, out.at_first


def test_progress_line_says_rows_samples_tokens_and_rates(capsys):
    progress = Progress(rows=lambda: 1234, every=0.0)
    progress.add(1000, 56789)
    err = capsys.readouterr().err
    assert "1,234 rows read, 1,000 samples, 56,789 tokens" in err and "rows/s" in err and "tokens/s" in err


def test_every_core_tokenizes_by_default():
    assert DataConfig().num_proc is None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert workers_for(DataConfig()) == cores and workers_for(DataConfig(num_proc=3)) == 3


class FreezeWatched(list):
    """A sink that notes how many objects the collector skipped (gc.freeze) when the first and the last sample
    arrived (counting walks the frozen objects: once per sample would cost seconds in a test process's heap)."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total, self.frozen = total, []

    def append(self, sample: dict) -> None:
        super().append(sample)
        if len(self) in (1, self.total):
            self.frozen.append(gc.get_freeze_count())


@pytest.mark.parametrize("workers", [1, 2])
def test_the_collector_skips_the_old_heap_while_tokenizing_and_gets_it_back(tmp_path, tokenizer, workers):
    data = write_rows(tmp_path / "rows.jsonl", 600, {40: LONE_SURROGATE})
    examples = load_examples(recipe_for(tmp_path, data).datasets, "error", DataStats())
    assert gc.get_freeze_count() == 0
    out = FreezeWatched(599)
    job = Job(tokenizer, DataConfig(max_seq_len=24), "skip", {})
    assert tokenize_stream([examples[i:i + 100] for i in range(0, 600, 100)], job, DataStats(), out, workers) is None
    # The tokenizer and the imports alone are tens of thousands of objects.
    assert len(out) == 599 and len(out.frozen) == 2 and min(out.frozen) > 10_000
    assert gc.get_freeze_count() == 0
    failing = Job(tokenizer, DataConfig(max_seq_len=24), "error", {})
    failure = tokenize_stream([examples[i:i + 100] for i in range(0, 600, 100)], failing, DataStats(), [], workers)
    assert isinstance(failure, BadRow) and gc.get_freeze_count() == 0


def test_worker_processes_read_the_rows_of_a_jsonl_dataset(tmp_path, tokenizer, monkeypatch):
    # With workers, a JSONL dataset's rows are parsed and converted in them (samples.FileChunk): none in this
    # process, where each row cost ~20 us of a CPU that the workers share. A JSON dataset is still read here.
    from finetune.data import samples

    calls = []
    real = samples.row_example
    monkeypatch.setattr(samples, "row_example", lambda *a, **k: calls.append(1) or real(*a, **k))
    recipe = recipe_for(tmp_path, write_rows(tmp_path / "rows.jsonl", 900, MIXED_BAD), on_bad_row="skip",
                        num_proc=2)
    train, _, stats, _ = build_samples(recipe, tokenizer)
    assert calls == [] and stats.rows_read == 900 and len(train) == 900 - len(MIXED_BAD)
    rows = [json.loads(chat_line(i)) for i in range(1, 301)]
    (tmp_path / "rows.json").write_text(json.dumps(rows), encoding="utf-8")
    build_samples(recipe_for(tmp_path, tmp_path / "rows.json", num_proc=2), tokenizer)
    assert len(calls) == 300


def test_a_bad_row_read_by_a_worker_comes_before_a_later_dataset_s_error(tmp_path, tokenizer):
    # The first dataset's rows are read by the workers, the second's here: the bad row at line 820 of the first is
    # still the error, not the second file's, which this process reads after handing the first one out.
    first = write_rows(tmp_path / "rows.jsonl", 900, {40: LONE_SURROGATE, 820: "{not json"})
    second = tmp_path / "broken.json"
    second.write_text(f"[{chat_line(1)}, {{oops", encoding="utf-8")
    raw = tiny_recipe(tmp_path / "run", first)
    raw["datasets"].append({"path": str(second), "format": "chat"})
    raw["data"].update(max_seq_len=24, num_proc=2)
    with pytest.raises(BadRow, match=rf"{first}:820: malformed JSON"):
        build_samples(validate(raw), tokenizer)
    raw["datasets"][0]["path"] = str(write_rows(tmp_path / "clean.jsonl", 900, {40: LONE_SURROGATE}))
    with pytest.raises(UserError, match=r"datasets.1.path: .*broken.json"):
        build_samples(validate(raw), tokenizer)


def build_or_error(tmp_path: Path, tokenizer, paths: list[Path], num_proc: int, **data_keys):
    raw = tiny_recipe(tmp_path / "run", paths[0])
    raw["datasets"] += [{"path": str(p), "format": "chat"} for p in paths[1:]]
    raw["data"].update(max_seq_len=24, num_proc=num_proc, **data_keys)
    try:
        train, _, stats, _ = build_samples(validate(raw), tokenizer)
    except UserError as e:
        return str(e)
    return train, stats


@pytest.mark.parametrize("case", ["two bad rows", "jsonl, then a broken json", "jsonl, then a broken json, small",
                                  "bad rows of both kinds"])
def test_workers_reading_rows_keep_errors_and_bad_rows_in_input_order(tmp_path, tokenizer, case):
    # JSONL rows are read by the workers (FileChunk), .json rows here (ReadRows). Whichever process finds an
    # unreadable row first, the first one in input order is the error, and the bad rows skipped are named in input
    # order: all as with one process.
    rows = [json.loads(chat_line(i)) for i in range(1, 700)]
    rows[3] = rows[4] = {"messages": [{"role": "wizard", "content": "x"}]}
    (tmp_path / "mixed.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "broken.json").write_text("[" + ",".join(chat_line(i) for i in range(1, 400)) + ", {oops")
    if case == "two bad rows":  # the second is found while the first's chunk is still being handed out
        paths, keys = [write_rows(tmp_path / "a.jsonl", 5000, {100: "{not json", 600: "{bad two"})], {}
    elif case.startswith("jsonl, then"):  # read here while the first file's lines wait for a worker
        lines = 100 if case.endswith("small") else 600  # one process, or workers
        paths, keys = [write_rows(tmp_path / "first.jsonl", lines, {50: "{not json"}), tmp_path / "broken.json"], {}
    else:
        bad = {1400: "{x", 1401: "{y", 1402: "{z"}
        paths, keys = [write_rows(tmp_path / "c.jsonl", 1500, bad), tmp_path / "mixed.json"], {"on_bad_row": "skip"}
    one, two = (build_or_error(tmp_path, tokenizer, paths, n, **keys) for n in (1, 2))
    assert one == two
    if isinstance(one, str):
        assert (":100:" in one) if case == "two bad rows" else ("first.jsonl:50:" in one), one
    else:
        assert [e.split(": ")[0].rsplit("/", 1)[1] for e in one[1].bad_row_examples] == [
            "c.jsonl:1400", "c.jsonl:1401", "c.jsonl:1402", "mixed.json:1", "mixed.json:1"]


def test_parquet_batches_read_by_workers_give_the_samples_stats_and_errors_of_one_process(tmp_path, tokenizer,
                                                                                          monkeypatch):
    # A parquet dataset goes to the workers as decoded batches (sources.ParquetBatch), turned into rows there: the
    # same samples, stats and bad rows as one process, no row converted here, and a file broken after its first
    # row groups stops at the same row with the same error.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from finetune.data import samples, sources

    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 100)
    rows = [json.loads(chat_line(i)) for i in range(1, 901)]
    for i in (5, 300, 650):
        rows[i] = {"messages": [{"role": "wizard", "content": "x"}]}
    rows[400]["messages"][0]["content"] = "y" * 5000  # over max_row_bytes
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=300)
    calls = []
    real = samples.row_example
    monkeypatch.setattr(samples, "row_example", lambda *a, **k: calls.append(1) or real(*a, **k))
    one, two = (build_or_error(tmp_path, tokenizer, [tmp_path / "rows.parquet"], n, on_bad_row="skip",
                               max_row_bytes=4000) for n in (1, 2))
    assert one == two and one[1].bad_rows_skipped == 4 and len(calls) == 900  # all 900 in the one-process build
    monkeypatch.setattr(samples, "PARQUET_WORKER_BYTES", 0)  # every batch too large to send: read here
    assert build_or_error(tmp_path, tokenizer, [tmp_path / "rows.parquet"], 2, on_bad_row="skip",
                          max_row_bytes=4000) == one and len(calls) == 1800
    table = pq.read_table(tmp_path / "rows.parquet")
    broken = tmp_path / "broken.parquet"
    pq.write_table(table, broken, row_group_size=300, compression="none", use_dictionary=False)
    start = pq.ParquetFile(broken).metadata.row_group(2).column(0).data_page_offset
    data = bytearray(broken.read_bytes())
    data[start:start + 30] = b"\xff" * 30  # the third row group's page header: the first two still read
    broken.write_bytes(bytes(data))
    one, two = (build_or_error(tmp_path, tokenizer, [broken], n, on_bad_row="skip") for n in (1, 2))
    assert one == two and "cannot read parquet at row 600" in one, one


def test_a_jsonl_line_nested_too_deeply_is_a_bad_row(tmp_path, tokenizer):
    # json.loads raises RecursionError, not a JSONDecodeError, for valid JSON nested past Python's recursion limit:
    # a row well under max_row_bytes that used to stop preprocessing with a traceback.
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    data = write_rows(tmp_path / "rows.jsonl", 600, {7: deep})
    one, two = (build_or_error(tmp_path, tokenizer, [data], n, on_bad_row="skip") for n in (1, 2))
    assert one == two and one[1].bad_rows_skipped == 1
    assert "rows.jsonl:7: JSON nested too deeply to read" in one[1].bad_row_examples[0]
    assert "rows.jsonl:7: JSON nested too deeply" in build_or_error(tmp_path, tokenizer, [data], 2)
