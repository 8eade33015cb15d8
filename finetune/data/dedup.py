"""data.deduplicate: exact: a row whose example is the same as an earlier one's is dropped, the first kept.

An example is identified by the SHA-256 (its first 16 bytes) of its canonical JSON: every field read from the row
(messages, text, prompt and completion, which turns train, tools, image paths, a stored teacher) but its origin
(file:line). Two rows that read as the same example tokenize to the same sample, whatever their other fields or
their formatting in the file. One Seen holds the hashes of a split (every training dataset together, or every eval
dataset): it needs the examples in input order in one process, so the rows are read there (samples.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

DIGEST_BYTES = 16  # 128 bits: a collision among even 10^12 rows is ~10^-15 likely


def example_key(example: Any) -> bytes:
    """The example's identity: a hash of its canonical JSON, without where it came from."""
    body = {f.name: getattr(example, f.name) for f in dataclasses.fields(example) if f.name != "origin"}
    text = json.dumps([type(example).__name__, body], sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      default=_plain)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:DIGEST_BYTES]


def _plain(value: Any) -> Any:
    """What json cannot write by itself: a dataclass inside an example (a stored teacher), bytes, anything else."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


class Seen:
    """The examples of a split seen so far."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    def first(self, example: Any) -> bool:
        """True the first time an example is seen (it is kept), False for every later copy (it is dropped)."""
        key = example_key(example)
        if key in self._keys:
            return False
        self._keys.add(key)
        return True


def seen_for(mode: str) -> Seen | None:
    """A Seen for data.deduplicate exact; None (nothing dropped) for none."""
    return Seen() if mode == "exact" else None
