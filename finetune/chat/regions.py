"""Where each message's text lands in a conversation's rendering: its region, the stretch of the whole rendering
that changes when the message's free text is replaced by a sentinel (spans.py turns regions into spans).

A message's free text: its content, its reasoning fields and the arguments of its tool calls. The sentinel is made
of a character that occurs nowhere in the conversation or its rendering (a private-use one): `c7c` for message 7's
content, `c7rc` for its reasoning, `c7a0c` for the arguments of its first tool call. A rendering with sentinels
agrees with the real one outside the sentinels' regions, and each region is found by the longest common prefix and
suffix of the two renderings, so it is exactly the text the message produced, whatever the template did to it
(strip, trim, reasoning split off or dropped, a tool call wrapped in tags).

Two ways to find them, with the same answer:

* `regions_at_once`, two or four renderings whatever the length of the conversation (linear time). Two when the
  template writes each message's content verbatim (`regions_by_content`: S, every message's text replaced at once,
  with each sentinel swapped back for its message's content, is the real rendering, character for character; no
  message has reasoning or tool calls): each content is then where its sentinel was. Else four: S, every message's
  text replaced at once, gives the order in which the template renders the messages; messages are dealt
  alternately, in that order, to two halves A and B; X_A (A real, the rest replaced) and X_B. Each message of A lies
  between two messages of B, whose sentinels sit at known places both in S and in X_A: the windows between them
  differ only by this one message, so their common prefix and suffix give its region, exactly as a rendering
  with only this message replaced would. Then the check: S with every message's sentinel stretch swapped for its
  real text must be the real rendering, character for character, and the stretches must not overlap. A
  conversation that fails (a template that renders one message differently when another's text changes, or
  renders a message's text twice) is passed to the second way, which either agrees or reports the template.
  S holds none of the conversation's text, only its shape (roles, other fields, indices): a cache
  (`SentinelRenders`, shapes.py) keeps it per shape, so rows of a shape seen before render once (the real rendering) or three
  times, and the check still compares each row's own real rendering.
* `regions_one_by_one`: N+1 renderings for N messages, each with one message replaced (quadratic time).

Neither assumes that a prefix of a conversation renders as a prefix of the whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from finetune.chat.shapes import SentinelRenders, Sentinels
from finetune.errors import UserError

# Message fields besides `content` whose text a template renders (transformers aliases them onto each other).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Render = Callable[[list[dict[str, Any]]], str]
Region = tuple[int, int]


class TemplateNotLocal(UserError):
    """The template renders one message differently when another message's text changes."""


@dataclass(frozen=True)
class Regions:
    """Each message's region in the real rendering (None: the template does not render its text), and the messages
    whose tool calls the template does not render (all of them, or some)."""

    regions: tuple[Region | None, ...]
    calls_not_rendered: tuple[int, ...]
    verbatim_shape: Sentinels | None = field(default=None, compare=False)
    """The shape's kept rendering (SentinelRenders' entry) when every message's content is written verbatim and
    none is empty (regions_by_content): the rendering is then that entry's text with the contents put in, so the
    text between two regions is the same for every conversation of this shape. None otherwise, and when nothing
    is kept."""


# --- sentinels ---------------------------------------------------------------------------------------------

def _strings(value: Any, out: list[str]) -> list[str]:
    """Every string in a nested value (keys too), appended to `out` (a walk that appends: a generator per level
    cost more than the search it serves)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _strings(k, out)
            _strings(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _strings(v, out)
    return out


def sentinel_char(full: str, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
    """A private-use character found nowhere in the rendering, the messages or the tools."""
    # One search of the strings joined: a character is in the joined text if and only if it is in one of them
    # (the separator is no private-use character).
    c = unused_char(full, "\0".join(_strings(tools, _strings(list(messages), []))))
    if not c:
        raise UserError("this conversation uses every private-use character; it cannot be masked")  # pragma: no cover
    return c


def unused_char(full: str, text: str) -> str:
    """The first private-use character in neither `full` nor `text` ('' when there is none)."""
    for code in range(0xE000, 0xF900):  # the private-use area: never produced by a template
        c = chr(code)
        if c not in full and c not in text:
            return c
    return ""


def _sentinel_arguments(arguments: Any, mark: str) -> Any:
    # Of the arguments' own kind: a template may test `arguments is string`, or iterate an object's items.
    return mark if isinstance(arguments, str) else {mark: mark}


def sentinel_message(message: Mapping[str, Any], c: str, j: int) -> dict[str, Any]:
    """Message j with its free text replaced by sentinels (other fields, empty reasoning kept).

    Content is replaced unless it is empty or None beside tool calls: those calls then mark where the message is.
    A list of parts (text and images) becomes one text part, so that the message's region spans all its parts.
    """
    out = dict(message)
    calls = out.get("tool_calls") or []
    if isinstance(out.get("content"), str) and (out["content"] or not calls):
        out["content"] = f"{c}{j}{c}"
    elif isinstance(out.get("content"), list):  # text and image parts: the region is all of them, images included
        out["content"] = [{"type": "text", "text": f"{c}{j}{c}"}]
    for key in REASONING_FIELDS:
        if isinstance(out.get(key), str) and out[key]:
            out[key] = f"{c}{j}r{c}"
    if calls:
        replaced = []
        for k, call in enumerate(calls):
            call, mark = dict(call), f"{c}{j}a{k}{c}"
            if isinstance(call.get("function"), Mapping):
                function = dict(call["function"])
                function["arguments"] = _sentinel_arguments(function.get("arguments"), mark)
                call["function"] = function
            else:
                call["arguments"] = _sentinel_arguments(call.get("arguments"), mark)
            replaced.append(call)
        out["tool_calls"] = replaced
    return out


@dataclass(frozen=True)
class _Marks:
    """The sentinels found in one rendering."""

    spans: dict[int, Region]
    """Per message: from its first sentinel's start to its last one's end."""
    order: tuple[int, ...]
    """Messages in the order their sentinels appear."""
    calls: dict[int, frozenset[int]]
    """Per message: the tool calls whose argument sentinels appear."""


def _marks(text: str, c: str) -> _Marks | None:
    """The sentinels of `text`; None when one message's sentinels are split by another's, or stray marks remain."""
    spans: dict[int, Region] = {}
    calls: dict[int, set[int]] = {}
    order: list[int] = []
    found = 0
    for m in re.finditer(f"{c}(\\d+)(?:r|a(\\d+))?{c}", text):
        found += 1
        j = int(m.group(1))
        if j in spans:
            if order[-1] != j:
                return None
            spans[j] = (spans[j][0], m.end())
        else:
            spans[j] = (m.start(), m.end())
            order.append(j)
        if m.group(2) is not None:
            calls.setdefault(j, set()).add(int(m.group(2)))
    if text.count(c) != 2 * found:
        return None
    return _Marks(spans, tuple(order), {j: frozenset(k) for j, k in calls.items()})


def _calls_missing(messages: Sequence[Mapping[str, Any]], found: Callable[[int], frozenset[int]]) -> tuple[int, ...]:
    """Messages with tool calls whose argument sentinels do not all appear."""
    return tuple(j for j, m in enumerate(messages)
                 if m.get("tool_calls") and found(j) != frozenset(range(len(m["tool_calls"]))))


# --- common prefix and suffix --------------------------------------------------------------------------------

def common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slice equality: C-speed compares, no Python loop over characters
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _diff(a: str, b: str) -> tuple[int, int]:
    """(p, s): `a` and `b` agree on their first p and last s characters, and no more (p + s <= either length)."""
    p = common_prefix(a, b)
    return p, _common_suffix(a, b, min(len(a), len(b)) - p)


# --- one by one ----------------------------------------------------------------------------------------------

def regions_one_by_one(render: Render, messages: list[dict[str, Any]], full: str, tools: Any = None) -> Regions:
    """N renderings, each with one message replaced. Raises TemplateNotLocal when two regions overlap."""
    c = sentinel_char(full, messages, tools)
    regions: list[Region | None] = []
    calls: dict[int, frozenset[int]] = {}
    for j, message in enumerate(messages):
        other = render([*messages[:j], sentinel_message(message, c, j), *messages[j + 1:]])
        if other == full:
            regions.append(None)
        else:
            p, s = _diff(full, other)
            regions.append((p, len(full) - s))
        if message.get("tool_calls"):
            calls[j] = frozenset(k for k in range(len(message["tool_calls"])) if f"{c}{j}a{k}{c}" in other)
    for i, a in enumerate(regions):
        for j in range(i + 1, len(regions)):
            b = regions[j]
            if a and b and a[0] < b[1] and b[0] < a[1] and (a[0] < a[1] or b[0] < b[1]):
                raise TemplateNotLocal(
                    f"the chat template renders message {i} ({messages[i]['role']}) differently when the text of "
                    f"message {j} ({messages[j]['role']}) changes, so their turns cannot be told apart for label "
                    "masking. Use another template (tokenizer.chat_template), or set train_on_inputs: true.")
    return Regions(tuple(regions), _calls_missing(messages, lambda j: calls.get(j, frozenset())))


# --- at once -------------------------------------------------------------------------------------------------

def _window(marks: _Marks, order: Sequence[int], pos: int, length: int) -> Region:
    """Between the sentinels of the messages rendered just before and just after order[pos]."""
    start = marks.spans[order[pos - 1]][1] if pos else 0
    end = marks.spans[order[pos + 1]][0] if pos + 1 < len(order) else length
    return start, end


def regions_at_once(render: Render, messages: list[dict[str, Any]], full: str, tools: Any = None,
                    cache: SentinelRenders | None = None, scope: Hashable | None = None) -> Regions | None:
    """Four renderings, or two (regions_by_content); None when the check fails (then regions_one_by_one decides).

    With a `cache` and a `scope` (what the rendering depends on besides the messages: SentinelRenders), the
    rendering with every message replaced is taken from the cache when a conversation of the same shape had it.
    """
    c = sentinel_char(full, messages, tools)
    replaced = [sentinel_message(m, c, j) for j, m in enumerate(messages)]
    key = cache.key(scope, c, replaced) if cache is not None else None
    sentinels = cache.get(key) if cache is not None and key is not None else None
    if sentinels is None:
        sentinels = _sentinels(render, replaced, c)
        if sentinels is None:
            return None
        if cache is not None and key is not None:
            cache.put(key, sentinels)
    return _at_once(render, messages, replaced, full, c, sentinels, sentinels if key is not None else None)


def _sentinels(render: Render, replaced: list[dict[str, Any]], c: str) -> Sentinels | None:
    """The rendering with every message replaced and its sentinels; None when the template refuses it or its
    sentinels are mixed up (then the slow way renders one message at a time)."""
    try:
        every = render(replaced)
    except Exception:
        return None
    marks = _marks(every, c)
    return Sentinels(every, marks) if marks is not None else None


def _at_once(render: Render, messages: list[dict[str, Any]], replaced: list[dict[str, Any]], full: str, c: str,
             sentinels: Sentinels, shape: Sentinels | None = None) -> Regions | None:
    """regions_at_once from the rendering with every message replaced (`shape`: it, when the cache keeps it)."""
    every, marks = sentinels.every, sentinels.marks
    by_content = regions_by_content(messages, full, every, marks, shape)
    if by_content is not None:
        return by_content
    order = marks.order
    stretch: dict[int, Region] = {}  # per message: its region in `every`
    real: dict[int, str] = {}  # per message: its region's text in the real rendering
    for half in (set(order[0::2]), set(order[1::2])):
        if not half:
            continue
        try:
            text = render([m if j in half else replaced[j] for j, m in enumerate(messages)])
        except Exception:
            return None
        found = _marks(text, c)
        if found is None or found.order != tuple(j for j in order if j not in half):
            return None
        for pos, j in enumerate(order):
            if j not in half:
                continue
            s0, s1 = _window(marks, order, pos, len(every))
            x0, x1 = _window(found, order, pos, len(text))
            p, s = _diff(text[x0:x1], every[s0:s1])
            stretch[j] = (s0 + p, s1 - s)
            real[j] = text[x0 + p:x1 - s]
    return _rebuilt(messages, full, every, order, stretch, real, marks)


def regions_by_content(messages: list[dict[str, Any]], full: str, every: str, marks: _Marks,
                       shape: Sentinels | None = None) -> Regions | None:
    """Two renderings (the real one and `every`): when no message has reasoning or tool calls and swapping each
    message's sentinel in `every` for its content, verbatim, gives the real rendering character for character,
    the regions are where the contents landed. None otherwise (then regions_at_once decides). `shape`, the kept
    entry of `every`, becomes the regions' verbatim_shape when no content is empty."""
    for m in messages:
        if m.get("tool_calls") or not isinstance(m.get("content"), str) or \
                any(isinstance(m.get(k), str) and m[k] for k in REASONING_FIELDS):
            return None
    stretch = {j: marks.spans[j] for j in marks.order}
    real = {j: messages[j]["content"] for j in marks.order}
    verbatim = shape if shape is not None and all(m["content"] for m in messages) else None
    return _rebuilt(messages, full, every, marks.order, stretch, real, marks, verbatim)


def _rebuilt(messages: list[dict[str, Any]], full: str, every: str, order: Sequence[int], stretch: dict[int, Region],
             real: dict[int, str], marks: _Marks, verbatim_shape: Sentinels | None = None) -> Regions | None:
    """The regions in the real rendering, if swapping every stretch of `every` for its real text gives it exactly."""
    regions = swapped_regions(full, every, order, stretch, real, len(messages))
    if regions is None:
        return None
    return Regions(tuple(regions), _calls_missing(messages, lambda j: marks.calls.get(j, frozenset())),
                   verbatim_shape)


def swapped_regions(full: str, every: str, order: Sequence[int], stretch: Mapping[int, Region],
                    real: Mapping[int, str] | Sequence[str], n: int) -> list[Region | None] | None:
    """The regions of n messages in `full`, when swapping each stretch of `every` (message j's: stretch[j], in
    rendering order) for that message's real text gives `full` character for character; else None."""
    swapped = swapped_rendering(every, order, stretch, real, n)
    return swapped[1] if swapped is not None and swapped[0] == full else None


def swapped_rendering(every: str, order: Sequence[int], stretch: Mapping[int, Region],
                      real: Mapping[int, str] | Sequence[str], n: int) -> tuple[str, list[Region | None]] | None:
    """`every` with each stretch (message j's: stretch[j], in rendering order) swapped for that message's real text,
    and the n messages' regions in it; None where two stretches overlap."""
    regions: list[Region | None] = [None] * n
    parts, at, length = [], 0, 0
    for j in order:
        a, b = stretch[j]
        if a < at:  # overlapping stretches: the template is not local here
            return None
        parts.append(every[at:a])
        length += a - at
        text = real[j]
        regions[j] = (length, length + len(text))
        parts.append(text)
        length += len(text)
        at = b
    parts.append(every[at:])
    return "".join(parts), regions


def find_regions(render: Render, messages: list[dict[str, Any]], full: str, tools: Any = None,
                 cache: SentinelRenders | None = None, scope: Hashable | None = None) -> Regions:
    """Each message's region: at once when the check holds, else one by one (which may raise TemplateNotLocal).
    `cache` and `scope`: as regions_at_once takes them."""
    found = regions_at_once(render, messages, full, tools, cache, scope)
    return found if found is not None else regions_one_by_one(render, messages, full, tools)

