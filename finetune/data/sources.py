"""Read raw rows from local files (.jsonl, .json, .parquet, .csv) or a hub dataset, each tagged with its origin.

The origin (`file:line`) travels with the row so that any later problem (bad JSON, missing field, unknown
role) can name exactly where it is.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.recipe import LOCAL_SUFFIXES, data_file_not_found, local_data_path


@dataclass(frozen=True)
class RawRow:
    """One row as read from its source, with `origin` like `data/train.jsonl:17`."""

    data: dict[str, Any]
    origin: str
    error: str | None = None
    """Why the row cannot be used (malformed JSON, bad bytes): the caller raises or skips it."""


class BadRow(UserError):
    """A row that cannot be used; `data.on_bad_row: skip` counts these instead of stopping."""


def read_rows(path: str, *, split: str = "train", name: str | None = None) -> Iterator[RawRow]:
    """Yield the rows of a local data file or a hub dataset. Malformed rows come with `error` set."""
    local = local_data_path(path)
    if local is not None:
        if local.is_dir():
            raise UserError(f"{path} is a directory; give a data file ({', '.join(LOCAL_SUFFIXES)})")
        if not local.is_file():
            # Relative paths were already tried against the recipe's folder (recipe.py), then the cwd.
            raise UserError(data_file_not_found(path))
        try:
            yield from _read_local(local)
        except OSError as e:  # unreadable (permissions) or vanished while reading
            raise UserError(f"{path}: cannot read the data file ({e.strerror or e})") from None
    else:
        yield from _read_hub(path, split=split, subset=name)


def _read_local(file: Path) -> Iterator[RawRow]:
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(file)
    elif suffix == ".json":
        yield from _read_json(file)
    elif suffix == ".csv":
        yield from _read_csv(file)
    elif suffix == ".parquet":
        yield from _read_parquet(file)
    else:
        raise UserError(f"{file}: unsupported data file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}")


def _read_jsonl(file: Path) -> Iterator[RawRow]:
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            origin = f"{file}:{number}"
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
            if not isinstance(data, dict):
                yield _bad(origin, f"expected a JSON object, got {type(data).__name__}")
                continue
            yield RawRow(data, origin)


def _read_json(file: Path) -> Iterator[RawRow]:
    try:
        text = file.read_text(encoding="utf-8-sig")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        raise UserError(f"{file}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
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
    while True:
        while text[i] in ws:
            i += 1
        if text[i] == "]":
            return lines
        lines.append(text.count("\n", 0, i) + 1)
        _, i = decoder.raw_decode(text, i)
        while text[i] in ws:
            i += 1
        if text[i] == ",":
            i += 1


def _read_csv(file: Path) -> Iterator[RawRow]:
    try:
        with file.open(newline="", encoding="utf-8-sig") as handle:
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
        raise UserError(f"{file}:{reader.line_num}: malformed CSV: {e}") from None


def _read_parquet(file: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq  # installed with datasets; imported only when a parquet file is used

    try:
        table = pq.read_table(file)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise UserError(f"{file}: cannot read parquet ({e})") from None
    for index, row in enumerate(table.to_pylist()):
        yield RawRow(row, f"{file}[row {index}]")


def _read_hub(name: str, *, split: str, subset: str | None) -> Iterator[RawRow]:
    import datasets  # heavy: only for hub datasets

    try:
        dataset = datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # offline, unknown name, missing split: all user-fixable
        raise UserError(
            f"dataset {name!r}: not a local file, and loading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).\n"
            f"  If it is a local file, check the path (relative to the recipe file). If it is a hub dataset, "
            f"this machine needs network access or a populated HF cache."
        ) from None
    for index, row in enumerate(dataset):
        yield RawRow(dict(row), f"{name}[{split}][{index}]")


def _bad(origin: str, why: str) -> RawRow:
    # Yielded, not raised: a generator that raises cannot go on, and `on_bad_row: skip` must go on.
    return RawRow({}, origin, error=why)
