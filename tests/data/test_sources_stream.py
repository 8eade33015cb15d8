""".json arrays and .parquet files read as streams (finetune/data/sources.py, json_array.py): the same rows, origins
and errors as reading the file whole, for any chunk boundary, in memory that does not grow with the file.
"""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
from pathlib import Path

import pytest
from conftest import tiny_recipe

from finetune.data import build_samples, json_array, sources
from finetune.data.sources import read_rows
from finetune.errors import UserError
from finetune.recipe import validate


def rows_or_error(rows) -> tuple[list | None, str | None]:
    try:
        return [(r.data, r.origin, r.error) for r in rows], None
    except UserError as e:
        return None, str(e)


def mixed_items(n: int) -> list:
    """Objects with every kind of JSON value (non-ASCII, escapes, big and float numbers), and some non-objects."""
    rnd = random.Random(n)
    items: list = [{"messages": [{"role": "user", "content": "héllo \u2028 \U0001F600 \"q\" \\ " * rnd.randint(0, 4)},
                                 {"n": rnd.random() * 1e6, "i": rnd.randint(-10**20, 10**20), "t": True, "z": None}]}
                   for _ in range(n)]
    items[3], items[7], items[9] = 12345678901, [1, 2], "text"
    return items


ARRAYS = [json.dumps(mixed_items(20)), json.dumps(mixed_items(20), indent=2),
          json.dumps(mixed_items(20), ensure_ascii=False, indent=1), "\ufeff" + json.dumps(mixed_items(12)),
          "[]", "  [\n ]  \n", '[1.5e3, 2.25, {"a": 1}, -0.125]',  # numbers a chunk may cut ("1" of "1.5")
          # what json.loads refuses: each named by the same line, column and message
          "[1,]", "[1 2]", "[1] x", "[", '[{"a": 1', '[\n{"a": 1},\n{"a": }\n]', '[{"a":1},\n {"b": tru}]',
          '[{"a":"x\\q"}]', '[{"a":"\x01"}]', '[{"a":1}] ]', '[{"a":1},]', '[,{"a":1}]']
NOT_UTF8 = [b'[{"a": "ok"},\n{"a": "\xff"}]', b'\xef\xbb\xbf[{"a": "ok"},\n{"a": "\xc3"}]',
            b'[{"a":"' + b"x" * 100 + b'\xe9\x80"}]']


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_a_streamed_json_array_reads_as_the_whole_file_does(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(json_array, "CHUNK_BYTES", chunk)  # every boundary: in a number, an escape, a BOM, a char
    for i, content in enumerate(ARRAYS + NOT_UTF8):
        path = tmp_path / f"{i}.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        streamed = rows_or_error(read_rows(str(path)))
        assert streamed == rows_or_error(sources._read_json_whole(path)), content  # the reader before streaming
        assert (streamed[0] is None) == (i >= 7), content  # the cases that should fail do


def test_json_origins_and_errors_name_the_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"a": 1},\n  5, {"a":\n 2},\n{"a": 3} {"a": 4}]')
    rows = read_rows(str(path))
    assert [(r.origin, r.data, r.error) for r in (next(rows), next(rows), next(rows), next(rows))] == [
        (f"{path}:1", {"a": 1}, None), (f"{path}:2", {}, "expected a JSON object"), (f"{path}:2", {"a": 2}, None),
        (f"{path}:4", {"a": 3}, None)]  # the rows before an error are read
    with pytest.raises(UserError, match=f"^{path}:4: malformed JSON: Expecting ',' delimiter at column 10$"):
        next(rows)


def test_other_json_files_are_still_read_whole(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(" " * 5000 + json.dumps({"data": [{"a": 1}]}))  # the first character after 4 kB of spaces
    assert [(r.data, r.origin) for r in read_rows(str(path))] == [({"a": 1}, f"{path}[data][0]")]
    path.write_text("5")
    with pytest.raises(UserError, match="expected a JSON list of objects"):
        list(read_rows(str(path)))


OBJECTS = [json.dumps({"data": mixed_items(20)}), json.dumps({"version": [1, {"x": "]}"}], "data": mixed_items(10),
                                                               "n": 1.5e300}, indent=2),
           "\ufeff" + json.dumps({"data": mixed_items(10)}, ensure_ascii=False), '{"data": []}', ' {"a": 1, "data": [] }',
           '{"data": 5, "data": [{"a": 1}]}',  # json.loads keeps the last key: a list
           # what the whole-file reader refuses, with the same message, line and column
           "{}", '{"data": 5}', '{"other": [{"a": 1}]}', "{", '{"data": [1,]}',
           '{"data": [1] x}', '{"data": [{"a": 1}]', '{"data": [{"a": 1}]}}', '{"a":1,}', "{,}", '{"a" 1}',
           '{"a":}', '{"a":1 "b":2}', '{1:2}', '{"a":1} x', '{"data": [{"a": 1}],\n "b": tru}', '{"a\x01": 1}']


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_a_streamed_data_object_reads_as_the_whole_file_does(tmp_path, monkeypatch, chunk):
    """The {"data": [...]} form streamed: the same rows and origins, and the same errors, as json.loads read."""
    monkeypatch.setattr(json_array, "CHUNK_BYTES", chunk)
    for i, content in enumerate(OBJECTS):
        path = tmp_path / f"{i}.json"
        path.write_bytes(content.encode("utf-8"))
        streamed = rows_or_error(read_rows(str(path)))
        assert streamed == rows_or_error(sources._read_json_whole(path)), content
        assert (streamed[0] is None) == (i >= 6), content


def test_a_second_data_key_after_the_list_is_refused(tmp_path):
    """json.loads keeps the last `data` key; the streamed list's rows are read by then, so a second one is refused
    rather than read differently."""
    path = tmp_path / "d.json"
    path.write_text('{"data": [{"a": 1}],\n "data": [{"a": 2}]}')
    rows = read_rows(str(path))
    assert next(rows).data == {"a": 1}
    with pytest.raises(UserError, match=f"^{path}:2: malformed JSON: a second 'data' key after the first one's list "
                                        "was read at column 2$"):
        next(rows)


def test_a_json_item_too_large_to_parse_stops_the_read_by_its_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"a": 1},\n{"n": [' + "1," * 5000 + '1]}, {"a": 2}]')
    with pytest.raises(UserError, match=rf"^{path}:2: an item of over 8,000 characters of JSON, over 8 x "
                                        r"data.max_row_bytes \(8,000\): the reader cannot find the next item"):
        list(read_rows(str(path), max_row_bytes=1000))
    assert len(list(read_rows(str(path), max_row_bytes=2000))) == 3  # under 8 x the limit: read and measured


def traced_peak(function) -> int:
    """The most memory Python objects held above what they held before, while `function` ran."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        function()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def consume(path: Path) -> None:
    for _ in read_rows(str(path)):
        pass


def test_json_and_parquet_are_read_in_bounded_memory(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(json_array, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 256)
    rows = [{"messages": [{"role": "user", "content": f"question {i} " + "word " * 40},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(6000)]
    (tmp_path / "d.json").write_text(json.dumps(rows))  # 1.9 MB on one line
    (tmp_path / "w.json").write_text(json.dumps({"meta": "x", "data": rows}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=1500)
    whole = traced_peak(lambda: list(read_rows(str(tmp_path / "d.json"))))  # every row held: what a bound is not
    assert whole > 8 << 20
    assert traced_peak(lambda: consume(tmp_path / "d.json")) < 1 << 20
    assert traced_peak(lambda: consume(tmp_path / "w.json")) < 1 << 20
    assert traced_peak(lambda: consume(tmp_path / "d.parquet")) < 1 << 20


def test_parquet_rows_in_batches_are_the_table_rows(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 7)
    items = [{"messages": [{"role": "user", "content": f"héllo {i} 😀"}, {"role": "assistant", "content": None}],
              "n": i / 7, "i": -(2**62) + i, "tags": ["a"] * (i % 3), "t": i % 2 == 0} for i in range(40)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(items), path, row_group_size=10)
    expected = [(row, f"{path}[row {i}]", None) for i, row in enumerate(pq.read_table(path).to_pylist())]
    assert rows_or_error(read_rows(str(path))) == (expected, None)


def test_a_parquet_file_broken_after_its_first_rows_names_the_row(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 4)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" * 50 for i in range(40)]}), path, row_group_size=20,
                   compression="none", use_dictionary=False)
    start = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[start:start + 30] = b"\xff" * 30  # the second row group's page header: the first group still reads
    path.write_bytes(bytes(data))
    rows = read_rows(str(path))
    assert [next(rows).origin for _ in range(20)][-1] == f"{path}[row 19]"
    with pytest.raises(UserError, match=rf"^{path}: cannot read parquet at row 20 \(Couldn't deserialize thrift"):
        list(rows)


def test_samples_and_stats_from_json_and_parquet_equal_jsonl(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"Say {i} " + "x " * (i % 7)},
                          {"role": "assistant", "content": f"{i} " + "ok " * (i % 5)}]} for i in range(300)]
    rows[17] = {"messages": []}  # a bad row, skipped and counted
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=64)
    results = {}
    for name in ("d.jsonl", "d.json", "d.parquet"):
        raw = tiny_recipe(tmp_path / name.replace(".", "_"), tmp_path / name)
        raw["data"].update(on_bad_row="skip", num_proc=1)
        train, _, stats, _ = build_samples(validate(raw), tokenizer)
        results[name] = (train, stats.samples, stats.tokens, stats.target_tokens, stats.bad_rows_skipped)
        assert stats.bad_row_examples[0].startswith(str(tmp_path / name))
    assert results["d.json"] == results["d.jsonl"] == results["d.parquet"]
    assert results["d.jsonl"][4] == 1 and len(results["d.jsonl"][0]) == 299


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_the_second_data_key_is_named_by_its_line_whatever_was_read_before(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(json_array, "CHUNK_BYTES", chunk)  # 1, 5: the text before the key is dropped while it is read
    path = tmp_path / "d.json"
    path.write_text('{"data": [{"a": 1},\n{"a": 2}],\n\n   "data": []}')
    with pytest.raises(UserError, match=f"^{path}:4: malformed JSON: a second 'data' key .* at column 4$"):
        list(read_rows(str(path)))


@pytest.mark.parametrize("seed", range(4))
def test_jsonl_line_spans_read_as_the_whole_file_does(tmp_path, seed):
    # Tokenizing workers read a JSONL file's lines themselves, in spans cut by the parent (sources.line_spans, found
    # a block at a time): together the spans give the rows, origins and errors of one read of the file, for any
    # span length and block size, with blank lines, a BOM, CRLF, no final newline, and lines over max_row_bytes.
    rng = random.Random(seed)
    for trial in range(60):
        lines = ["" if rng.random() < 0.1 else "{bad" if rng.random() < 0.05 else
                 json.dumps({"a": "x" * rng.randint(0, 50), "é": trial}) for _ in range(rng.randint(0, 40))]
        text = ("\ufeff" if rng.random() < 0.2 else "") + "\n".join(lines)
        text += rng.choice(["", "\n", "\r\n"]) if lines else ""
        path = tmp_path / f"rows{trial}.jsonl"
        path.write_text(text, encoding="utf-8")
        whole = [(r.origin, r.data, r.error) for r in read_rows(str(path), max_row_bytes=40)]
        spans = list(sources.line_spans(str(path), rng.randint(1, 7), block=rng.randint(1, 64)))
        parts = [(r.origin, r.data, r.error) for s in spans for r in read_rows(str(path), max_row_bytes=40, span=s)]
        assert parts == whole, (text, spans)
        assert [s.start for s in spans[1:]] == [s.end for s in spans[:-1]]
        assert (spans[0].start, spans[-1].end) == (0, path.stat().st_size) if spans else path.stat().st_size == 0
        assert sum(s.lines for s in spans) == len(text.splitlines())
