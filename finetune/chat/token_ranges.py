"""Which tokens a chat turn's characters became: a token is trained when its first character lies in the turn's
span (spans.TurnSpan), so each turn's tokens are one index range, found from the tokens' offsets."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterator, Sequence
from typing import Any

from finetune.chat.spans import TurnSpan

_FIRST = operator.itemgetter(0)


class EncodingOffsets(Sequence[tuple[int, int]]):
    """A tokenizers Encoding's token offsets, asked token by token: turning all of them into Python tuples cost 5 us
    a quickstart row and fed the collector, where a row's turns need a few tokens' offsets each."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def __len__(self) -> int:
        return len(self.encoding)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return self.encoding.offsets[k]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        found = self.encoding.token_to_chars(k % len(self))
        return found if found is not None else self.encoding.offsets[k]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.encoding.offsets)

    def __eq__(self, other: object) -> bool:  # as the list of offsets it stands for
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def first_at(self, pos: int) -> int:
        """The first token whose first character is at or after `pos`: bisect_left over the starts, begun at the
        token the Encoding says covers `pos` (the starts never decrease, so walking from any token is exact)."""
        encoding = self.encoding
        k = encoding.char_to_token(pos)
        if k is None:  # pos is the end of the text, or a character no token covers
            return bisect.bisect_left(encoding.offsets, pos, key=_FIRST)
        chars, n = encoding.token_to_chars, len(encoding)
        try:
            while k < n and chars(k)[0] < pos:  # a token that starts before pos is not the one
                k += 1
            while k > 0 and chars(k - 1)[0] >= pos:  # the first of tokens that start at pos (a character split)
                k -= 1
        except TypeError:  # a token of no sequence has no offsets here: all of them, then
            return bisect.bisect_left(encoding.offsets, pos, key=_FIRST)
        return k


def trained_tokens(offsets: Sequence[tuple[int, int]], turns: Sequence[TurnSpan]) -> list[tuple[int, int]]:
    """The tokens trained, as index ranges [a, b) in turn order: a token is trained when its first character lies in
    a turn's span (the offsets' starts never decrease, so each turn's tokens are one range, found by bisection)."""
    if isinstance(offsets, EncodingOffsets):
        return [(offsets.first_at(turn.start), offsets.first_at(turn.end)) for turn in turns]
    return [(bisect.bisect_left(offsets, turn.start, key=_FIRST), bisect.bisect_left(offsets, turn.end, key=_FIRST))
            for turn in turns]
