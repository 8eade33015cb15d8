"""Where a trained turn starts and ends around its message's region (regions.py): after the assistant header
in front of the content, and through the end-of-turn marker the template writes after it, never reaching into a
neighbouring message's region. spans.py asks this for the first row of each shape; its turn plans give the
others.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from finetune.chat.regions import sentinel_char


@dataclass
class TurnContext:
    """A conversation being laid out: its rendering, messages and regions, how to render a part of it, and the
    template's facts (what its generation prompt appends, what follows a user's content, its end-of-turn markers)."""

    full: str
    messages: list[dict[str, Any]]
    regions: list[tuple[int, int] | None]
    render: Any
    header: str
    closing: str
    markers: tuple[str, ...]
    added: frozenset[str]
    sentinel: str = ""
    """A character found nowhere in the conversation: found when first needed, then kept."""


class Neighbours:
    """For a message's region, where the regions of the others end before it and start after it (bisect: linear in
    the conversation overall). Regions never overlap (regions.py checks), so sorted by start they are sorted by
    end too."""

    def __init__(self, regions: Sequence[tuple[int, int] | None], length: int) -> None:
        self.sorted = sorted((r[0], r[1], j) for j, r in enumerate(regions) if r is not None)
        self.starts = [a for a, _, _ in self.sorted]
        self.ends = [b for _, b, _ in self.sorted]
        self.length = length

    def around(self, i: int, p: int, q: int) -> tuple[int, int]:
        """(lo, hi): the end of the last other region ending at or before p, the start of the first other region
        starting at or after q that ends after p."""
        k = bisect.bisect_right(self.ends, p) - 1
        while k >= 0 and self.sorted[k][2] == i:
            k -= 1
        lo = self.ends[k] if k >= 0 else 0
        k = bisect.bisect_left(self.starts, q)
        while k < len(self.sorted) and (self.sorted[k][2] == i or self.sorted[k][1] <= p):
            k += 1
        hi = self.starts[k] if k < len(self.sorted) else self.length
        return lo, hi


def turn_start(ctx: TurnContext, i: int, lo: int, p: int) -> int:
    """Where assistant message i's trained text starts: after the assistant header in front of its content."""
    if ctx.header:
        # Without the whole header in front of this turn, the template renders history differently from its
        # generation prompt (DeepSeek-R1-distill's prompt ends with a '<think>\n' prefill history lacks; Qwen3 with
        # enable_thinking false, an empty think block): the turn starts after the longest part of the header that
        # is there, cut after a newline or an added token ('<｜Assistant｜>', '<|im_start|>assistant\n'), so that a
        # tool call rendered without content ('<tool_call>...') is trained whole; else at its text.
        for part in _header_parts(ctx.header, ctx.added):
            k = ctx.full.rfind(part, lo, p)
            if k >= 0:
                return k + len(part)
        return p
    # A template whose generation prompt adds nothing (Mistral): after a user or tool message, the turn starts
    # where that message's closing text ends ('[/INST]', '[/TOOL_RESULTS]'); else where the prefix rendered with
    # the generation prompt ends, when it is a prefix of the whole (one more rendering for this turn); else at its
    # text.
    before = ctx.regions[i - 1] if i else None
    if before and ctx.messages[i - 1]["role"] in ("user", "tool"):
        closing = ctx.closing if ctx.messages[i - 1]["role"] == "user" else _tool_closing(ctx, i - 1)
        if closing and ctx.full.startswith(closing, before[1]) and before[1] + len(closing) <= p:
            return before[1] + len(closing)
    if i:
        try:
            prefix = ctx.render(ctx.messages[:i], add_generation_prompt=True)
        except Exception:
            prefix = None
        if prefix is not None and ctx.full.startswith(prefix) and lo <= len(prefix) <= p:
            return len(prefix)
    return p


def _tool_closing(ctx: TurnContext, j: int) -> str:
    """What the template writes after tool message j's content, measured on a short conversation that ends with it
    (its content a sentinel, after the call it answers): one small rendering, whatever the conversation's length."""
    if not ctx.sentinel:
        ctx.sentinel = sentinel_char(ctx.full, ctx.messages)
    c = ctx.sentinel
    call = ctx.messages[j - 1] if j and ctx.messages[j - 1].get("tool_calls") else None
    probe = [{"role": "user", "content": "Hi"}, *([call] if call else []), {**ctx.messages[j], "content": c}]
    try:
        text = ctx.render(probe)
    except Exception:  # a template that refuses the short conversation: no closing to look for
        return ""
    return text.split(c, 1)[1] if text.count(c) == 1 else ""


@functools.lru_cache(maxsize=64)
def _header_parts(header: str, added: frozenset[str]) -> tuple[str, ...]:
    """The header and its prefixes that end after a newline or an added token, longest first (kept per header and
    added tokens: asked once a conversation)."""
    cuts = {len(header)}
    for i, ch in enumerate(header):
        if ch == "\n":
            cuts.add(i + 1)
    for token in added:
        at = header.find(token) if token else -1
        while at >= 0:
            cuts.add(at + len(token))
            at = header.find(token, at + 1)
    return tuple(header[:c] for c in sorted(cuts, reverse=True))


def turn_end(ctx: TurnContext, q: int, hi: int) -> tuple[int, str]:
    """The end of the first end-of-turn marker after the content and before the next message, and the marker."""
    best: tuple[int, str] | None = None
    for marker in ctx.markers:
        k = ctx.full.find(marker, q, hi)
        if k >= 0 and (best is None or k < best[0]):
            best = (k, marker)
    return (best[0] + len(best[1]), best[1]) if best else (q, "")
