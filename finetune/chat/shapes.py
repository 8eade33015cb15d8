"""The rendering of a conversation with every message's text replaced by sentinels (regions.py), kept per
shape: such a rendering holds none of the row's text, only its shape (roles, other fields, indices), so rows of one
shape render it once. Also kept with it: spans.py's turn plans.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from finetune.chat.regions import _Marks

_SCALARS = frozenset({str, int, float, bool, type(None)})


def exact_key(value: Any) -> str | None:
    """A text that tells plain data apart exactly (the repr of str, int, float, bool and None, and of lists, tuples
    and dicts of them, insertion order included), or None for anything else: an object's repr need not show what a
    template reads of it."""
    return repr(value) if _plain(value) else None


def _plain(value: Any) -> bool:
    # Scalars are checked in place, not by a call each: asked once a conversation, for every field of every message.
    kind = type(value)
    if kind is dict:
        for k, v in value.items():
            if type(k) not in _SCALARS or (type(v) not in _SCALARS and not _plain(v)):
                return False
        return True
    if kind is list or kind is tuple:
        return all(type(v) in _SCALARS or _plain(v) for v in value)
    return kind in _SCALARS


SentinelKey = tuple[Hashable, str, str]
"""(scope, sentinel character, exact text of the replaced messages)."""


@dataclass(frozen=True)
class Sentinels:
    """The rendering with every message replaced (`every`), and its sentinels. `plans`: what spans.py derives
    once per shape (its turn plans), kept here so that it leaves the cache with the entry."""

    every: str
    marks: _Marks
    plans: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)


class SentinelRenders:
    """The renderings with every message replaced of recent conversations, by all they depend on: the template's
    other inputs (`scope`: the template, the special tokens, the kwargs and the row's tools, from the caller, which
    keeps one cache per tokenizer), the sentinel character and the replaced messages, which hold none of the row's
    text (their roles, other fields and indices: the conversation's shape). Rows of one shape then render it once.
    Always without the generation prompt, as regions_at_once renders it. The least recently used go past `size`
    entries or `chars` characters (renderings and keys: long conversations, whose shapes rarely repeat, would
    otherwise hold megabytes each).

    Exact for a template whose rendering is a function of those inputs: the kept rendering is the one rendering it
    again would give, so every region, and the check of each row's own real rendering, is what it was without the
    cache. The caller keeps none for templates that read the clock or draw at random (spans.py): the check
    would not catch a stale one, since the four-rendering way attributes text that changed to a message's region.
    """

    def __init__(self, size: int = 4096, chars: int = 1 << 23) -> None:
        self.size, self.chars = size, chars
        self._entries: OrderedDict[SentinelKey, tuple[Sentinels, int]] = OrderedDict()
        self._held = 0  # characters of the entries' renderings and keys
        self.layouts: dict[Hashable, Any] = {}
        """spans.py's turn plans of conversations of plain messages, with their shapes' entries, by a key
        told apart from the messages' roles alone (spans._known_key): such rows are laid out without building
        their messages with sentinels. Emptied when it grows past `size`."""

    def key(self, scope: Hashable | None, c: str, replaced: list[dict[str, Any]]) -> SentinelKey | None:
        """The entry's key; None (nothing kept) without a scope, or for messages that are not plain data."""
        shape = exact_key(replaced) if scope is not None else None
        return (scope, c, shape) if shape is not None else None

    def get(self, key: SentinelKey) -> Sentinels | None:
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: SentinelKey, sentinels: Sentinels) -> None:
        weight = len(key[2]) + len(sentinels.every)
        if weight > self.chars:  # one conversation over the whole budget: not kept
            return
        old = self._entries.pop(key, None)
        self._held += weight - (old[1] if old else 0)
        self._entries[key] = (sentinels, weight)
        while len(self._entries) > self.size or self._held > self.chars:
            self._held -= self._entries.popitem(last=False)[1][1]

    def keep_layout(self, key: Hashable, kept: Any) -> None:
        if len(self.layouts) >= self.size:
            self.layouts.clear()
        self.layouts[key] = kept

    def __len__(self) -> int:
        return len(self._entries)
