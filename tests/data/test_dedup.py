"""data.deduplicate: exact (finetune/data/dedup.py): a row whose example equals an earlier one's is dropped, the first
kept, and counted; exactly so across chunks, datasets and worker processes, before val_fraction's split; eval data on
its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_recipe

from finetune.data import build_samples
from finetune.data.cache import cache_inputs
from finetune.data.dedup import example_key
from finetune.data.formats import Example
from finetune.data.shards import CHUNK_EXAMPLES, PARALLEL_MIN_EXAMPLES
from finetune.objectives.rows import data_summary
from finetune.recipe import validate


def row(i: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i} ok"}],
            **extra}


def write(path: Path, rows: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in rows), encoding="utf-8")
    return path


def recipe(tmp_path: Path, data: Path, evals: list[Path] = (), extra: list[Path] = (), **data_keys):
    raw = tiny_recipe(tmp_path / "run", data)
    raw["datasets"] += [{"path": str(p)} for p in extra]
    raw["eval_datasets"] = [{"path": str(p)} for p in evals]
    raw["data"].update(**data_keys)
    return validate(raw)


def rows_with_duplicates(n: int) -> tuple[list[str], list[str], list[int]]:
    """n rows, some repeating an earlier one within its chunk or from an earlier chunk, in other JSON formatting (keys
    reordered, spaced out); also the distinct rows alone, and the 1-based lines of the copies."""
    content: dict[int, int] = {}
    lines, unique, dupes = [], [], []
    for line in range(1, n + 1):
        earlier = line - 5 if line % 7 == 0 else line - CHUNK_EXAMPLES + 3 if line > CHUNK_EXAMPLES and line % 50 == 0 \
            else None
        content[line] = content[earlier] if earlier else line
        if earlier:
            messages = [dict(reversed(list(m.items()))) for m in row(content[line])["messages"]]
            lines.append(json.dumps({"messages": messages}, indent=1).replace("\n", ""))
            dupes.append(line)
        else:
            lines.append(json.dumps(row(line)))
            unique.append(lines[-1])
    return lines, unique, dupes


@pytest.mark.parametrize("num_proc", [1, 2])
def test_duplicates_are_dropped_and_counted_across_chunks_and_workers(tmp_path, tokenizer, num_proc):
    n = 2 * CHUNK_EXAMPLES + 100
    assert n > PARALLEL_MIN_EXAMPLES  # the workers tokenize
    lines, unique, dupes = rows_with_duplicates(n)
    assert any(d > CHUNK_EXAMPLES and d % 50 == 0 for d in dupes)  # a copy of a row of an earlier chunk
    deduped = recipe(tmp_path, write(tmp_path / "all.jsonl", lines), deduplicate="exact", num_proc=num_proc)
    train, _, stats, _ = build_samples(deduped, tokenizer)
    expected, _, want, _ = build_samples(recipe(tmp_path, write(tmp_path / "unique.jsonl", unique), num_proc=1),
                                         tokenizer)
    assert train == expected  # the first of each kept, in input order
    assert stats.duplicates_dropped == len(dupes) == n - len(unique) and stats.rows_read == n
    assert stats.samples == want.samples and stats.tokens == want.tokens
    assert stats.duplicate_examples == [f"{tmp_path / 'all.jsonl'}:{d}" for d in dupes[:5]]
    assert f"; {len(dupes)} duplicate rows dropped (data.deduplicate)" in data_summary(stats, 0)
    # Off by default: every row trains.
    plain, _, off, _ = build_samples(recipe(tmp_path, tmp_path / "all.jsonl", num_proc=num_proc), tokenizer)
    assert len(plain) == n and off.duplicates_dropped == 0


def test_datasets_are_deduplicated_together_and_eval_on_its_own(tmp_path, tokenizer):
    a = write(tmp_path / "a.jsonl", [json.dumps(row(1)), json.dumps(row(2))])
    b = write(tmp_path / "b.jsonl", [json.dumps(row(2)), json.dumps(row(3))])
    ev = write(tmp_path / "eval.jsonl", [json.dumps(row(1)), json.dumps(row(4)), json.dumps(row(4))])
    train, evals, train_stats, eval_stats = build_samples(recipe(tmp_path, a, [ev], [b], deduplicate="exact"),
                                                          tokenizer)
    assert (len(train), train_stats.duplicates_dropped) == (3, 1)  # b's row 2 repeats a's
    assert train_stats.duplicate_examples == [f"{b}:1"]
    assert (len(evals), eval_stats.duplicates_dropped) == (2, 1)  # row 1 stays: it is a training row, not eval's


@pytest.mark.parametrize("num_proc", [1, 2])
def test_the_split_holds_out_from_the_distinct_rows(tmp_path, tokenizer, num_proc):
    lines = [json.dumps(row(i % 300)) for i in range(600)]  # every row twice
    data = write(tmp_path / "rows.jsonl", lines)
    train, evals, stats, _ = build_samples(recipe(tmp_path, data, deduplicate="exact", val_fraction=0.1,
                                                  num_proc=num_proc), tokenizer)
    assert stats.duplicates_dropped == 300 and (len(train), len(evals)) == (270, 30)
    ids = [tuple(s["input_ids"]) for s in train + evals]
    assert len(set(ids)) == 300  # no row both trains and evaluates


def test_an_example_is_its_content_without_its_origin():
    base = Example("a.jsonl:1", messages=({"role": "user", "content": "x"},), trained=(True,))
    assert example_key(base) == example_key(Example("b.jsonl:9", messages=base.messages, trained=(True,)))
    for other in (Example("a:1", messages=base.messages, trained=(False,)),  # another trained turn
                  Example("a:1", messages=base.messages, trained=(True,), tools=({"name": "f"},)),
                  Example("a:1", messages=base.messages, trained=(True,), images=("/x.png",)),
                  Example("a:1", text="x")):
        assert example_key(other) != example_key(base)


def test_the_cache_key_has_it_only_when_on(tmp_path, tokenizer):
    data = write(tmp_path / "a.jsonl", [json.dumps(row(1))])
    assert "deduplicate" not in cache_inputs(recipe(tmp_path, data), tokenizer)["data"]  # older entries stay valid
    assert cache_inputs(recipe(tmp_path, data, deduplicate="exact"), tokenizer)["data"]["deduplicate"] == "exact"
