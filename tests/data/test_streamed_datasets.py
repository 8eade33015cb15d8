"""Streamed datasets (data.streaming, finetune/data/stream.py): the rows are the cached path's own, a window at a
time; each process reads its own share; any cursor a checkpoint records gives back exactly the rows that followed it;
a hub dataset is read through datasets' streaming; only the eval data is cached, and the stream has an identity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import QUICKSTART_YAML, tiny_recipe
from helpers import run_cli

from finetune.data import StepPlan
from finetune.data.batching import epoch_plan
from finetune.data.cache import prepare
from finetune.data.stream import WINDOW_KEY, Cursor, Position, RowStream, StreamPlan
from finetune.errors import UserError
from finetune.recipe import validate

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def text_row(i: int) -> dict:
    """A completion row whose length varies with i (some over max_seq_len 48: truncated)."""
    return {"text": f"row {i}: " + " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1 + (i * 7) % 40))}


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def streamed(tmp_path: Path, *paths: Path, streaming: bool = True, **data: object):
    """A tiny recipe over these completion files: streamed (or cached), 3 rows a step, max_seq_len 48."""
    raw = tiny_recipe(tmp_path / "run", paths[0], "completion")
    raw["datasets"] = [{"path": str(p), "format": "completion"} for p in paths]
    raw["data"].update(max_seq_len=48, streaming=streaming, **data)
    raw["train"].update(micro_batch_size=3, gradient_accumulation_steps=1, epochs=None, max_steps=50)
    return validate(raw)


@pytest.mark.parametrize("packing", [True, False])
def test_with_one_window_the_stream_is_the_cached_epochs_end_to_end(tmp_path, tokenizer, packing):
    """A window that holds the whole dataset makes the cached path's epochs: packed best-fit decreasing and shuffled
    per (seed, epoch), or, unpacked with data.shuffle off, the rows in file order. The stream runs the epochs end to
    end, so a step that the cached path would cut short takes the next epoch's first rows."""
    data = write_rows(tmp_path / "c.jsonl", [text_row(i) for i in range(40)])
    keys = {"packing": packing, **({} if packing else {"shuffle": False})}
    cached = streamed(tmp_path, data, streaming=False, **keys)
    samples = prepare(cached, tokenizer).train
    epochs = StepPlan(samples, cached, 1)
    want = [row for e in range(3) for row in epochs.rows_of_epoch(e)[:]]
    plan = StreamPlan(streamed(tmp_path, data, **keys), tokenizer, 0, 1, 1)
    got = [row for s in range(len(want) // 3) for row in plan.step(s)[1]]
    assert got == want[:len(got)] and len(got) > 2 * len(epochs.rows_of_epoch(0))
    if not packing:
        assert [r["input_ids"] for r in got[:40]] == [s["input_ids"] for s in samples]


def test_a_window_is_planned_as_an_epoch_of_its_own_samples(tmp_path, tokenizer):
    """data.stream_buffer 7: window w of pass p holds the next 7 samples and its rows are the cached path's plan of
    them as epoch p + w x WINDOW_KEY (rows shuffled within a window, never across); the last window is short."""
    data = write_rows(tmp_path / "c.jsonl", [text_row(i) for i in range(30)])
    recipe = streamed(tmp_path, data, stream_buffer=7)
    samples = list(prepare(streamed(tmp_path, data, streaming=False), tokenizer).train)
    want = []
    for p in range(2):
        for w, first in enumerate(range(0, 30, 7)):
            want += epoch_plan(samples[first:first + 7], recipe.data, recipe.seed, p + w * WINDOW_KEY)[:]
    stream = RowStream(recipe, tokenizer)
    assert stream.take(len(want))[1] == want


def test_each_process_reads_its_own_share(tmp_path, tokenizer):
    """Example j of a pass is process j % 2's: the two shares are disjoint and together every sample once."""
    data = write_rows(tmp_path / "c.jsonl", [text_row(i) for i in range(25)])
    recipe = streamed(tmp_path, data, packing=False, shuffle=False)
    samples = [s["input_ids"] for s in prepare(streamed(tmp_path, data, streaming=False), tokenizer).train]
    shares = [[r["input_ids"] for r in RowStream(recipe, tokenizer, share, 2).take(n)[1]]
              for share, n in ((0, 13), (1, 12))]
    assert shares[0] == samples[0::2] and shares[1] == samples[1::2]


def test_any_recorded_cursor_gives_back_the_rows_that_followed_it(tmp_path, tokenizer):
    """Resume from the position recorded before every step (mid-window, at a window's end, across the end of a pass
    and from one dataset to the next), through bad rows skipped and a dataset cut by max_rows: the same rows, and
    the same counts, as the uninterrupted stream."""
    first = write_rows(tmp_path / "a.jsonl", [text_row(i) for i in range(9)] + ["{not json"] + [text_row(50)])
    second = write_rows(tmp_path / "b.jsonl", [text_row(i) for i in range(100, 120)])
    raw = streamed(tmp_path, first, second, stream_buffer=4, on_bad_row="skip").model_dump()
    raw["datasets"][1]["max_rows"] = 8
    recipe = validate(raw)
    plan = StreamPlan(recipe, tokenizer, 0, 1, 1)
    cursors, rows = [], []
    for s in range(24):
        cursors.append(json.loads(json.dumps(plan.resume_state(s))))  # as trainer_state.json keeps it
        rows.append(plan.step(s))
    assert {epoch for epoch, _ in rows} >= {0, 1, 2}  # passes of 19 examples: the stream wrapped twice
    assert len({(c["epoch"], c["window"]) for c in cursors}) < len(cursors)  # some cursors are mid-window
    for s in range(1, 24):
        again = StreamPlan(recipe, tokenizer, 0, 1, 1)
        again.restore([cursors[s]], s, "test")
        assert [again.step(k) for k in range(s, 24)] == rows[s:], s
        assert again.stream.stats.bad_rows_skipped == plan.stream.stats.bad_rows_skipped


def test_a_pass_that_gives_a_process_no_rows_is_an_error(tmp_path, tokenizer):
    """One example for two processes: the second would read the datasets forever; it is told why instead."""
    data = write_rows(tmp_path / "c.jsonl", [text_row(1)])
    stream = RowStream(streamed(tmp_path, data), tokenizer, 1, 2)
    with pytest.raises(UserError, match="a whole pass over the streamed datasets .* gave no training rows for "
                                        "process 1 of 2"):
        stream.take(1)


def test_a_hub_dataset_is_read_through_datasets_streaming(tmp_path, tokenizer, monkeypatch):
    """A hub name goes to datasets.load_dataset(..., streaming=True) (faked here by a local file, offline), and its
    rows are streamed as a local file's are."""
    import datasets

    data = write_rows(tmp_path / "c.jsonl", [text_row(i) for i in range(20)])
    load, calls = datasets.load_dataset, []

    def fake(name, subset=None, **kwargs):
        calls.append((name, subset, kwargs))
        return load("json", data_files=str(data), split="train", streaming=kwargs["streaming"])

    monkeypatch.setattr(datasets, "load_dataset", fake)
    hub = streamed(tmp_path, Path("org/corpus"), stream_buffer=6)
    got = RowStream(hub, tokenizer).take(15)[1]
    assert calls and all(c[0] == "org/corpus" and c[2]["streaming"] is True for c in calls)
    assert got == RowStream(streamed(tmp_path, data, stream_buffer=6), tokenizer).take(15)[1]


def test_only_the_eval_data_is_cached_and_the_stream_has_an_identity(tmp_path, tokenizer):
    """prepare: no training samples, the eval samples cached (a second prepare loads them), and a samples key that
    follows the training file's content (its size, first and last MiB), not its path."""
    data = write_rows(tmp_path / "c.jsonl", [text_row(i) for i in range(20)])
    raw = streamed(tmp_path, data).model_dump()
    raw["eval_datasets"] = [{"path": str(write_rows(tmp_path / "e.jsonl", [text_row(i) for i in range(5)])),
                             "format": "completion"}]
    recipe = validate(raw)
    first = prepare(recipe, tokenizer)
    assert list(first.train) == [] and len(first.evals) == 5 and "streamed (data.streaming)" in first.note
    again = prepare(recipe, tokenizer)
    assert again.hit and list(again.evals) == list(first.evals) and again.samples_key == first.samples_key
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(data.read_bytes())
    raw["datasets"][0]["path"] = str(moved)
    assert prepare(validate(raw), tokenizer).samples_key == first.samples_key
    write_rows(moved, [text_row(i + 1) for i in range(20)])
    assert prepare(validate(raw), tokenizer).samples_key != first.samples_key


def test_a_resume_on_another_number_of_processes_is_refused(tmp_path, tokenizer):
    """Each process's place in its share of the stream is its own: two positions cannot continue on one process."""
    plan = StreamPlan(streamed(tmp_path, write_rows(tmp_path / "c.jsonl", [text_row(1)])), tokenizer, 0, 1, 1)
    with pytest.raises(UserError, match="holds 2 streamed data positions and this run has 1 process: a streamed run "
                                        "resumes on as many processes as it ran on"):
        plan.restore([Cursor().to_json(), Cursor().to_json()], 2, "step-2")


def test_cursor_round_trips_through_json():
    cursor = Cursor(2, 5, Position(1, 40, 38, 77), 3, (("rows_read", 9),))
    assert Cursor.from_json(json.loads(json.dumps(cursor.to_json()))) == cursor


def test_preprocess_says_the_datasets_are_streamed(tmp_path):
    """`finetune preprocess` on a streamed recipe: nothing to cache for the training data, said so, and --show
    tokenizes the stream's first samples."""
    data = write_rows(tmp_path / "c.jsonl", [text_row(i) for i in range(5)])
    r = run_cli("preprocess", str(QUICKSTART_YAML), f"datasets.0.path={data}", "datasets.0.format=completion",
                "data.streaming=true", "train.max_steps=5", "train.epochs=null", "eval_datasets.0.max_rows=3", "--show",
                "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "datasets: streamed (data.streaming)" in r.stdout and "nothing of them is preprocessed" in r.stdout
    assert "streamed sample 0" in r.stdout and "ow 0: alpha" in r.stdout  # the first token is not trained
