"""Read raw rows from local files (.jsonl, .json, .parquet, .csv) or a hub dataset, each tagged with its origin.

The origin (`file:line`) travels with the row so that any later problem (bad JSON, missing field, unknown
role) can name exactly where it is.

Every local format is read as a stream, never whole: a JSONL file line by line, a .json file holding one top-level
array item by item, and one in the {"data": [...]} form the same way (json_array.py), a .parquet file a batch of
rows at a time, a CSV file row by row. A .json item is named by the line it starts on ({"data": [...]}: by its
index, `file[data][3]`), a parquet row by its index.

A row larger than `max_row_bytes` (data.max_row_bytes) is a bad row, found before it is parsed where the format
allows: a JSONL line is measured while it is read, in pieces, and never held whole or parsed when it is too long.
Other formats are measured by the UTF-8 bytes of their strings (keys and values): a .json item is parsed while its
JSON text is under JSON_ITEM_FACTOR times the limit (a longer one stops the read: its end, and so the next item, is
only found by reading it), CSV fields are bounded by the limit (a longer field stops the read: the CSV reader
cannot find the next row after it), parquet and hub rows come one at a time.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from finetune.data.json_array import (
    FieldNotAList,
    ItemTooLarge,
    JSONStreamError,
    array_items,
    field_items,
    first_character,
)
from finetune.errors import UserError
from finetune.recipe import LOCAL_SUFFIXES, data_file_not_found, local_data_path


# Not frozen: a frozen dataclass's __init__ costs ~0.6 us more, paid for every row of a corpus. Never changed.
@dataclass(slots=True)
class RawRow:
    """One row as read from its source, with `origin` like `data/train.jsonl:17`."""

    data: dict[str, Any]
    origin: str
    error: str | None = None
    """Why the row cannot be used (malformed JSON, bad bytes): the caller raises or skips it."""


class BadRow(UserError):
    """A row that cannot be used; `data.on_bad_row: skip` counts these instead of stopping."""


# data.max_row_bytes's default (the schema's too): far above any real chat row, far below what takes gigabytes.
DEFAULT_MAX_ROW_BYTES = 8 * 1024 * 1024
# An item of a streamed .json array is parsed while its JSON text is under this many times max_row_bytes (then
# measured like the other formats): escapes make JSON text up to 6 characters per byte of string (`\u0001`).
JSON_ITEM_FACTOR = 8
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time (into columns, then into Python rows)


@dataclass(frozen=True)
class LineSpan:
    """Lines [first, first + lines) of a JSONL file, bytes [start, end): a piece a worker process reads itself."""

    start: int
    end: int
    first: int
    lines: int

    def __len__(self) -> int:
        return self.lines


@dataclass(frozen=True)
class ParquetBatch:
    """Rows [first, first + len) of a parquet file, decoded into columns (a pyarrow RecordBatch): a piece a worker
    process turns into rows itself."""

    first: int
    batch: Any

    def __len__(self) -> int:
        return int(self.batch.num_rows)


def read_rows(path: str, *, split: str = "train", name: str | None = None, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
              span: LineSpan | ParquetBatch | None = None, data_files: list[str] | None = None,
              streaming: bool = False) -> Iterator[RawRow]:
    """Yield the rows of a local data file or a hub dataset (`span`: of that piece of a JSONL or parquet file only,
    file_spans'; `data_files`: of those files of the hub dataset only; `streaming`: a hub dataset's rows fetched as
    they are read, never downloaded whole, data.streaming). Malformed rows, and rows over `max_row_bytes`, come with
    `error` set."""
    local = local_data_path(path)
    if local is not None:
        if not isinstance(span, ParquetBatch):  # a batch was decoded already: its file is not opened again
            _check_file(path, local)
        with _readable(path):
            if isinstance(span, ParquetBatch):
                yield from _bounded(_batch_rows(local, span.first, span.batch), max_row_bytes)
            else:
                yield from _read_jsonl(local, max_row_bytes, span) if span else _read_local(local, max_row_bytes)
    else:
        yield from _bounded(_read_hub(path, split=split, subset=name, data_files=data_files, streaming=streaming),
                            max_row_bytes)


def file_spans(path: str, lines: int) -> Iterator[LineSpan | ParquetBatch]:
    """A local JSONL file in spans of `lines` lines (line_spans), or a parquet file in batches of PARQUET_BATCH_ROWS
    rows, decoded but not turned into Python rows: the pieces worker processes read."""
    local = local_data_path(path)
    if local is None or local.suffix.lower() != ".parquet":
        yield from line_spans(path, lines)
        return
    _check_file(path, local)
    first = 0
    for batch in _parquet_batches(local):  # what pyarrow cannot read is a UserError there
        yield ParquetBatch(first, batch)
        first += batch.num_rows


def line_spans(path: str, lines: int, block: int = 1 << 20) -> Iterator[LineSpan]:
    """A local JSONL file cut into spans of `lines` lines (the last one shorter), found by scanning it for newlines
    a block at a time: nothing is parsed, and a line of any length is never held whole."""
    local = local_data_path(path)
    assert local is not None and local.suffix.lower() == ".jsonl", path
    _check_file(path, local)
    with _readable(path), local.open("rb") as handle:
        start = pos = count = last = 0  # count: newlines since `start`; last: just after the last newline
        first = 1
        while data := handle.read(block):
            ends = np.flatnonzero(np.frombuffer(data, np.uint8) == 10) + (pos + 1)  # just after each newline
            cuts = ends[lines - count - 1::lines]
            for end in cuts.tolist():
                yield LineSpan(start, end, first, lines)
                start, first = end, first + lines
            count += len(ends) - lines * len(cuts)
            last = int(ends[-1]) if len(ends) else last
            pos += len(data)
        if pos > start:  # the last lines, the very last one perhaps without a newline
            yield LineSpan(start, pos, first, count + (pos > last))


@contextlib.contextmanager
def _readable(path: str) -> Iterator[None]:
    """A data file that cannot be read (permissions) or vanished while read is the user's error, naming it."""
    try:
        yield
    except OSError as e:
        raise UserError(f"{path}: cannot read the data file ({e.strerror or e})") from None


def _check_file(path: str, local: Path) -> None:
    if local.is_dir():
        raise UserError(f"{path} is a directory; give a data file ({', '.join(LOCAL_SUFFIXES)})")
    if not local.is_file():
        # Relative paths were already tried against the recipe's folder (recipe.py), then the cwd.
        raise UserError(data_file_not_found(path))


def _read_local(file: Path, limit: int) -> Iterator[RawRow]:
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(file, limit)
    elif suffix == ".json":
        yield from _bounded(_read_json(file, limit), limit)
    elif suffix == ".csv":
        yield from _bounded(_read_csv(file, limit), limit)
    elif suffix == ".parquet":
        yield from _bounded(_read_parquet(file), limit)
    else:
        raise UserError(f"{file}: unsupported data file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}")


def _too_large(size: int, limit: int) -> str:
    return f"the row is {size:,} bytes, over data.max_row_bytes ({limit:,}); it was not read (raise the limit to read it)"


def _text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string in a row (keys and values), a measure of its size for any format."""
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(_text_bytes(k) + _text_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(v) for v in value)
    return 0


def _bounded(rows: Iterator[RawRow], limit: int) -> Iterator[RawRow]:
    for row in rows:
        size = _text_bytes(row.data) if row.error is None else 0
        yield _bad(row.origin, _too_large(size, limit)) if size > limit else row


def _lines(handle: Any, limit: int) -> Iterator[tuple[bytes | None, int]]:
    """Each line (None when its content, line ending left out, is over `limit` bytes) and that size. Lines are read
    in pieces of at most 1 MiB; a long line's pieces are dropped once it is known to be too long."""
    while True:
        piece = handle.readline(1 << 20)
        if piece.endswith(b"\n"):  # the whole line in one piece: nearly always
            size = len(piece) - (2 if piece.endswith(b"\r\n") else 1)
            yield (piece if size <= limit else None), size
            continue
        pieces: list[bytes] | None = [piece]
        size = len(piece)
        if size > limit + 2:
            pieces = None
        while piece := handle.readline(1 << 20):
            size += len(piece)
            if pieces is not None:
                pieces.append(piece)
                if size > limit + 2:
                    pieces = None  # too long whatever its line ending: count the rest, keep nothing
            if piece.endswith(b"\n"):
                break
        if not size:
            return
        raw = b"".join(pieces) if pieces is not None else piece
        ending = 2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0
        yield (raw if pieces is not None and size - ending <= limit else None), size - ending


def _read_jsonl(file: Path, limit: int, span: LineSpan | None = None) -> Iterator[RawRow]:
    with file.open("rb") as handle:
        lines = _lines(handle, limit)
        if span is not None:
            handle.seek(span.start)
            lines = itertools.islice(lines, span.lines)
        name = str(file)
        for number, (raw, size) in enumerate(lines, start=span.first if span else 1):
            origin = f"{name}:{number}"
            if raw is None:
                yield _bad(origin, _too_large(size, limit))
                continue
            try:
                # utf-8-sig on the first line: editors on Windows start files with a BOM, which json rejects.
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield _bad(origin, f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                # Without its newline: an unfinished line would otherwise be reported at "line 2 column 1".
                data = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                yield _bad(origin, f"malformed JSON: {e.msg} at column {e.colno}")
                continue
            except RecursionError:  # valid JSON nested past the depth Python's reader can follow
                yield _bad(origin, "JSON nested too deeply to read (past Python's recursion limit)")
                continue
            if not isinstance(data, dict):
                yield _bad(origin, f"expected a JSON object, got {type(data).__name__}")
                continue
            yield RawRow(data, origin)


def _read_json(file: Path, limit: int) -> Iterator[RawRow]:
    with file.open("rb") as handle:
        first, bound = first_character(handle), JSON_ITEM_FACTOR * limit
        if first in ("[", "{"):
            rows = _array_rows(file, handle, bound) if first == "[" else _field_rows(file, handle, bound)
            yield from _streamed_json(file, rows, bound)
            return
    yield from _read_json_whole(file)  # not JSON at all: json.loads' own message


def _array_rows(file: Path, handle: Any, bound: int) -> Iterator[RawRow]:
    """A top-level array, streamed (json_array.py): one item in memory at a time, named by its line."""
    for item, line in array_items(handle, bound):
        origin = f"{file}:{line}"
        yield RawRow(item, origin) if isinstance(item, dict) else _bad(origin, "expected a JSON object")


def _field_rows(file: Path, handle: Any, bound: int) -> Iterator[RawRow]:
    """The {"data": [...]} form, streamed the same way; an item is named by its index, as when it was read whole."""
    for index, (item, _) in enumerate(field_items(handle, "data", bound)):
        origin = f"{file}[data][{index}]"
        yield RawRow(item, origin) if isinstance(item, dict) else _bad(origin, "expected a JSON object")


def _streamed_json(file: Path, rows: Iterator[RawRow], bound: int) -> Iterator[RawRow]:
    """The rows of a streamed .json file, its errors said as the whole-file reader says them (by line)."""
    try:
        yield from rows
    except ItemTooLarge as e:
        raise UserError(f"{file}:{e.line}: {e.msg}, over {JSON_ITEM_FACTOR} x data.max_row_bytes ({bound:,}): the "
                        "reader cannot find the next item without reading this one; raise the limit to read it") \
            from None
    except FieldNotAList:
        raise UserError(f"{file}: expected a JSON list of objects (or {{'data': [...]}})") from None
    except JSONStreamError as e:
        if e.byte is not None:
            raise UserError(f"{file}: {e.msg}") from None
        raise UserError(f"{file}:{e.line}: malformed JSON: {e.msg} at column {e.column}") from None


def _read_json_whole(file: Path) -> Iterator[RawRow]:
    """The file read whole with json.loads: what the streamed readers must agree with (the tests compare them), and
    the reader of a .json file that is neither an array nor an object, to say in json's words why it is refused."""
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        byte = e.start + (3 if raw.startswith(codecs.BOM_UTF8) else 0)  # utf-8-sig counts after the BOM
        raise UserError(f"{file}: not valid UTF-8 ({e.reason} at byte {byte})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{file}:{e.lineno}: malformed JSON: {e.msg} at column {e.colno}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data, origins = data["data"], [f"{file}[data][{i}]" for i in range(len(data["data"]))]
    elif isinstance(data, list):
        # A top-level list: name each item by the line it starts on, like the other formats.
        origins = [f"{file}:{line}" for line in _item_lines(text)]
    else:
        raise UserError(f"{file}: expected a JSON list of objects (or {{'data': [...]}})")
    for item, origin in zip(data, origins):
        yield RawRow(item, origin) if isinstance(item, dict) else _bad(origin, "expected a JSON object")


def _item_lines(text: str) -> list[int]:
    """The 1-based line on which each item of a (valid) top-level JSON list starts."""
    decoder, lines = json.JSONDecoder(), []
    ws = " \t\r\n"
    i = text.index("[") + 1
    line, counted = 1, 0  # counted on from the item before: counting from the start each time was quadratic
    while True:
        while text[i] in ws:
            i += 1
        if text[i] == "]":
            return lines
        line, counted = line + text.count("\n", counted, i), i
        lines.append(line)
        _, i = decoder.raw_decode(text, i)
        while text[i] in ws:
            i += 1
        if text[i] == ",":
            i += 1


@contextlib.contextmanager
def _csv_field_limit(limit: int) -> Iterator[None]:
    """csv's field size limit (a process-wide setting, 128 KiB by default) set to `limit` while one file is read."""
    before = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(before)


def _read_csv(file: Path, limit: int) -> Iterator[RawRow]:
    reader = None
    try:
        with _csv_field_limit(limit), file.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            for row in reader:
                # DictReader's line_num is the physical line just read (header is line 1).
                origin = f"{file}:{reader.line_num}"
                if None in row:  # DictReader files surplus values under the key None
                    yield _bad(origin, f"{len(row[None])} more values than the header's {len(reader.fieldnames)} "
                                       "columns (a comma in an unquoted value?)")
                    continue
                yield RawRow(dict(row), origin)
    except UnicodeDecodeError as e:
        raise UserError(f"{file}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except csv.Error as e:  # e.g. a field over the size limit, a NUL byte
        line = reader.line_num + 1 if reader else 1
        if "field larger than field limit" in str(e):
            raise UserError(f"{file}:{line}: a CSV field over data.max_row_bytes ({limit:,} characters); the "
                            "reader cannot find the next row after it: raise the limit to read it") from None
        raise UserError(f"{file}:{line}: malformed CSV: {e}") from None


def _read_parquet(file: Path) -> Iterator[RawRow]:
    first = 0
    for batch in _parquet_batches(file):
        yield from _batch_rows(file, first, batch)
        first += batch.num_rows


def _batch_rows(file: Path, first: int, batch: Any) -> Iterator[RawRow]:
    """The rows of a batch from _parquet_batches whose first row is row `first` of the file."""
    try:
        rows = batch.to_pylist()
    except Exception as e:  # as _parquet_batches names what pyarrow cannot read
        raise UserError(f"{file}: cannot read parquet{f' at row {first}' if first else ''} ({e})") from None
    name = str(file)
    for index, row in enumerate(rows, start=first):
        yield RawRow(row, f"{name}[row {index}]")


def _parquet_batches(file: Path) -> Iterator[Any]:
    """The file's rows a batch at a time, as pyarrow decodes them (a row group's column chunks at most), never the
    whole table; a file pyarrow cannot read is a UserError, naming the row it stopped at when it was not the first."""
    import pyarrow.parquet as pq  # installed with datasets; imported only when a parquet file is used

    done = 0
    try:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            yield batch
            done += batch.num_rows
    except Exception as e:  # pyarrow raises several types for a broken file
        where = f" at row {done}" if done else ""
        raise UserError(f"{file}: cannot read parquet{where} ({e})") from None


def _read_hub(name: str, *, split: str, subset: str | None, data_files: list[str] | None = None,
              streaming: bool = False) -> Iterator[RawRow]:
    import datasets  # heavy: only for hub datasets

    try:
        dataset = datasets.load_dataset(name, subset, split=split, data_files=data_files,
                                        **({"streaming": True} if streaming else {}))  # the default call otherwise
    except Exception as e:  # offline, unknown name, missing split: all user-fixable
        raise UserError(
            f"dataset {name!r}: not a local file, and loading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).\n"
            f"  If it is a local file, check the path (relative to the recipe file). If it is a hub dataset, "
            f"this machine needs network access or a populated HF cache."
        ) from None
    for index, row in enumerate(_undecoded(dataset)):
        yield RawRow(dict(row), f"{name}[{split}][{index}]")


def _undecoded(dataset: Any) -> Any:
    """Image columns (an Image or a list of them) as stored, {bytes, path}, not decoded: the image's own bytes are
    kept (data/image_files.py writes them once as a file), never pixels re-encoded."""
    import datasets

    for column, feature in (dataset.features or {}).items():  # a streamed dataset may not know its features
        inner = feature.feature if isinstance(feature, datasets.List) else feature
        if isinstance(inner, datasets.Image) and inner.decode:
            image = datasets.Image(decode=False)
            dataset = dataset.cast_column(column, image if inner is feature else datasets.List(image))
    return dataset


def _bad(origin: str, why: str) -> RawRow:
    # Yielded, not raised: a generator that raises cannot go on, and `on_bad_row: skip` must go on.
    return RawRow({}, origin, error=why)
