"""The items of a .json file holding one top-level array, read as a stream: the file is decoded in bounded chunks
and each item parsed with `json.JSONDecoder.raw_decode` as soon as it is whole, so memory holds about one chunk
and one item, never the file.

Each item comes with the 1-based line it starts on (its origin, as the other formats give theirs). What
`json.loads` would refuse is refused here with its own message, line and column (`malformed JSON: Expecting ','
delimiter at column 9`), raised when the reader reaches it: the items before it have been yielded by then.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import Any, BinaryIO

CHUNK_BYTES = 1 << 20
_WS = " \t\r\n"
# An error this far before the end of the text read so far was not caused by the text ending there: a literal
# (`fals`), a number (`1e`) or an escape (`\u00`) cut by the chunk boundary fails within a few characters of it.
_CUT_MARGIN = 16


class JSONStreamError(ValueError):
    """Why the file is not one JSON array: `msg` (json's own wording where json would refuse it), `line`,
    `column` (1-based, in characters, as json counts them), or `byte` for text that is not UTF-8."""

    def __init__(self, msg: str, line: int = 0, column: int = 0, byte: int | None = None) -> None:
        super().__init__(msg)
        self.msg, self.line, self.column, self.byte = msg, line, column, byte


class ItemTooLarge(JSONStreamError):
    """An item whose JSON text outgrew the bound given to the reader before it ended."""


class _Text:
    """The file's decoded text, held from the current position on: `buf[pos:]` is what is not consumed yet.
    Lines are counted as the position moves on (never from the start again), so naming a position costs only
    the text since the last one named."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.buf, self.pos, self.eof = handle, "", 0, False
        self.fed = 0  # bytes given to the decoder so far
        # Plain UTF-8, the BOM dropped by hand: utf-8-sig's decoder would count error positions after the BOM.
        self.decoder, self.started = codecs.getincrementaldecoder("utf-8")(), False
        # buf[_at] is on line _line, and the last newline before it is at buf[_nl] (negative before buf[0]:
        # -1 - the column of buf[0], so that a column is always index - _nl).
        self._at, self._line, self._nl = 0, 1, -1

    def fill(self) -> bool:
        """Read one more chunk; False at the end of the file."""
        if self.eof:
            return False
        raw = self.handle.read(CHUNK_BYTES)
        pending = len(self.decoder.getstate()[0])
        try:
            text = self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            # The decoder's position counts from the bytes it still held from the chunk before.
            byte = self.fed - pending + e.start
            raise JSONStreamError(f"not valid UTF-8 ({e.reason} at byte {byte})", byte=byte) from None
        self.fed += len(raw)
        self.eof = not raw
        if text and not self.started:
            self.started, text = True, text.removeprefix("\ufeff")  # editors on Windows write one
        if self.pos > CHUNK_BYTES:  # drop the consumed text, keeping count of its lines
            self.where(self.pos)
            k = self.pos
            self.buf, self.pos, self._at, self._nl = self.buf[k:], 0, 0, self._nl - k
        self.buf += text
        return bool(raw)

    def where(self, index: int) -> tuple[int, int]:
        """The 1-based line and column of buf[index] (index at or after the last one asked about)."""
        newlines = self.buf.count("\n", self._at, index)
        if newlines:
            self._line += newlines
            self._nl = self.buf.rfind("\n", self._at, index)
        self._at = index
        return self._line, index - self._nl

    def error(self, msg: str, index: int) -> JSONStreamError:
        line, column = self.where(index)
        return JSONStreamError(msg, line, column)

    def skip_ws(self) -> str:
        """The next character that is not whitespace ('' at the end of the file), left unconsumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""


def first_character(handle: BinaryIO) -> str:
    """The file's first character after a BOM and whitespace ('' for none). Reads a little; rewinds."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="ignore")
    text = ""
    while head := handle.read(4096):
        text = decoder.decode(head).lstrip(_WS)
        if text:
            break
    handle.seek(0)
    return text[:1]


def array_items(handle: BinaryIO, max_item_chars: int) -> Iterator[tuple[Any, int]]:
    """Each item of the array the file holds, with the line it starts on. Raises JSONStreamError where
    `json.loads` would refuse the file, and ItemTooLarge for an item over `max_item_chars` characters of JSON
    (it cannot be skipped without being read: the next item's start is only known once it ends)."""
    text = _Text(handle)
    decoder = json.JSONDecoder()
    if text.skip_ws() != "[":
        raise text.error("Expecting value", text.pos)  # first_character said otherwise: a changing file
    yield from _items(text, decoder, max_item_chars)
    if text.skip_ws():
        raise text.error("Extra data", text.pos)


class FieldNotAList(JSONStreamError):
    """The object has no `field` key whose value is a list (json.loads would have read it; the caller says why)."""


def field_items(handle: BinaryIO, field: str, max_item_chars: int) -> Iterator[tuple[Any, int]]:
    """Each item of the list under `field` of the object the file holds (the {"data": [...]} form), with the line
    it starts on, streamed as array_items streams an array. The other keys' values are parsed and dropped, each
    bounded as an item is. Raises JSONStreamError where `json.loads` would refuse the file, and FieldNotAList at
    the end when no `field` key holds a list. A `field` key after the list was read is refused: json.loads would
    keep the last one, and the list's items are gone by then."""
    text = _Text(handle)
    decoder = json.JSONDecoder()
    if text.skip_ws() != "{":
        raise text.error("Expecting value", text.pos)  # first_character said otherwise: a changing file
    listed = False
    for char in _members(text, "}"):
        if char != '"':
            raise text.error("Expecting property name enclosed in double quotes", text.pos)
        at = text.where(text.pos)  # now: reading on may drop the text before it from the buffer
        key, text.pos = _decode_item(text, decoder, max_item_chars)
        if text.skip_ws() != ":":
            raise text.error("Expecting ':' delimiter", text.pos)
        text.pos += 1
        if key == field and listed:
            raise JSONStreamError(f"a second {field!r} key after the first one's list was read", *at)
        if text.skip_ws() == "[" and key == field:
            listed = True
            yield from _items(text, decoder, max_item_chars)
        else:
            _, text.pos = _decode_item(text, decoder, max_item_chars)
    if text.skip_ws():
        raise text.error("Extra data", text.pos)
    if not listed:
        raise FieldNotAList(f"no {field!r} key holding a list")


def _items(text: _Text, decoder: json.JSONDecoder, limit: int) -> Iterator[tuple[Any, int]]:
    """The items of the array opening at text.pos, each with its line; leaves text.pos after its `]`."""
    for _ in _members(text, "]"):
        line, _ = text.where(text.pos)
        item, text.pos = _decode_item(text, decoder, limit)
        yield item, line


def _members(text: _Text, closing: str) -> Iterator[str]:
    """Walk the members of the array or object opening at text.pos, its commas checked: yields each member's
    first character with text.pos at it (the caller reads the member), and leaves text.pos after `closing`."""
    text.pos += 1
    first = True
    while True:
        char = text.skip_ws()
        if char == closing and first:
            break
        if not first:
            if char == closing:
                break
            if char != ",":
                raise text.error("Expecting ',' delimiter", text.pos)
            text.pos += 1
            char = text.skip_ws()
        first = False
        yield char
    text.pos += 1


def _decode_item(text: _Text, decoder: json.JSONDecoder, limit: int) -> tuple[Any, int]:
    """The value starting at text.pos and the index after it, reading more of the file until it is whole."""
    while True:
        buf, start = text.buf, text.pos
        try:
            item, end = decoder.raw_decode(buf, start)
        except json.JSONDecodeError as e:
            cut = e.msg.startswith("Unterminated string") or e.pos >= len(buf) - _CUT_MARGIN
            if not cut or text.eof:
                raise text.error(e.msg, e.pos) from None
        else:
            if end - start > limit:  # the same refusal whatever the chunks held
                break
            # A number may go on in the next chunk: "1" of "12", "1" of "1.5", "1.5" of "1.5e3" all parse.
            number = isinstance(item, (int, float)) and not isinstance(item, bool)
            if text.eof or not number or end < len(buf) - _CUT_MARGIN:
                return item, end
        if len(buf) - start > limit:
            break
        text.fill()
    line, _ = text.where(start)
    raise ItemTooLarge(f"an item of over {limit:,} characters of JSON", line)
