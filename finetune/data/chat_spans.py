"""Where each message of a conversation lands in its chat-template rendering: the trained character spans.

The conversation is rendered once, and that text is what gets tokenized. Each message is then located in it by
rendering the conversation again with that message's free text (content, reasoning) replaced by a sentinel
made of a character that occurs nowhere else: the two renderings agree outside one stretch, and that stretch
(longest common prefix and suffix) is exactly the text the message produced, whatever the template did to it
(strip, trim, reasoning split off or dropped). N+1 renderings for N messages, and exact for every template,
also for those that render a turn differently depending on what follows it (Qwen3, Phi-3.5, gpt-oss): nothing
assumes that a prefix of the conversation renders as a prefix of the whole.

A trained assistant turn runs from the end of the template's assistant header (what `add_generation_prompt`
appends) to the end-of-turn marker the template writes after the content, both included: text the template
puts between header and content is what the model generates after the generation prompt (Qwen3's think block,
gpt-oss's `<|channel|>final<|message|>`), so it is trained. A trained system or user message is its content plus
the end-of-turn marker after it. docs/chat-templates.md shows the result for each tested family.
"""

from __future__ import annotations

import bisect
import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.errors import UserError

# Single tokens that end a turn in the official templates we know. Only those that are one added token of the
# tokenizer at hand count (plain text never matches), plus the tokenizer's eos.
END_OF_TURN_MARKERS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|return|>", "<|call|>", "</s>",
    "<｜end▁of▁sentence｜>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<turn|>",
)
# Message fields besides `content` whose text a template renders (transformers aliases them onto each other).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateNotLocal(UserError):
    """The template renders one message differently when another message's text changes."""


@dataclass(frozen=True)
class TurnSpan:
    """One trained message in the rendering: characters [start, end) are trained."""

    message_index: int
    start: int
    """First trained character: after the assistant header (assistant turns), else the content's start."""
    content_start: int
    """[content_start, content_end) is the text the message's own fields produced."""
    content_end: int
    end: int
    """One past the end-of-turn marker (content_end when the template writes none)."""
    marker: str
    """The end-of-turn marker included, '' when none."""


@dataclass(frozen=True)
class ChatLayout:
    """A rendered conversation, the spans of the messages asked for, and those the template did not render."""

    text: str
    turns: tuple[TurnSpan, ...]
    unrendered: tuple[int, ...]
    """Messages asked for whose text the template does not render at all (Mistral Nemo drops the system prompt
    unless the last message is a user's)."""


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None,
                add_generation_prompt: bool = False) -> str:
    """The chat template's rendering of `messages` (template kwargs passed through, as at inference)."""
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **dict(template_kwargs or {}))


def _common_prefix(a: str, b: str) -> int:
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


def _diff_region(full: str, other: str) -> tuple[int, int]:
    """[p, q) in `full` outside of which `full` and `other` agree."""
    p = _common_prefix(full, other)
    return p, len(full) - _common_suffix(full, other, min(len(full), len(other)) - p)


def _sentinel_char(full: str, messages: Sequence[Mapping[str, Any]]) -> str:
    texts = [full, *(v for m in messages for v in m.values() if isinstance(v, str))]
    for code in range(0xE000, 0xF900):  # the private-use area: never produced by a template
        c = chr(code)
        if not any(c in t for t in texts):
            return c
    raise UserError("this conversation uses every private-use character; it cannot be masked")  # pragma: no cover


def _with_sentinel(message: Mapping[str, Any], mark: str) -> dict[str, Any]:
    """`message` with its free text replaced by `mark` (other fields and empty reasoning fields kept)."""
    out = dict(message)
    out["content"] = mark
    for key in REASONING_FIELDS:
        if isinstance(out.get(key), str) and out[key]:
            out[key] = mark + "r"
    return out


_PROBES: dict[tuple[str, str, str, str], str] = {}  # (kind, template, kwargs, special tokens) -> text


def _probe(kind: str, tokenizer: Any, template_kwargs: Mapping[str, Any] | None) -> str:
    """What a template writes around a lone user turn, measured once per template, kwargs and special tokens.

    header: what `add_generation_prompt` appends (only where it ends matters, as it is searched from the end:
    Phi-3.5's plain rendering ends with '<|endoftext|>' and its prompted one with '<|assistant|>\\n', so the two
    share '<|' and the header found is 'assistant|>\\n'). closing: what follows the user's content ('[/INST]').
    """
    key = (kind, str(tokenizer.chat_template), json.dumps(template_kwargs or {}, sort_keys=True, default=str),
           json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))
    if key not in _PROBES:
        try:
            if kind == "header":
                probe = [{"role": "user", "content": "Hi"}]
                plain = render_chat(tokenizer, probe, template_kwargs)
                prompted = render_chat(tokenizer, probe, template_kwargs, add_generation_prompt=True)
                found = prompted[_common_prefix(prompted, plain):]
            else:
                plain = render_chat(tokenizer, [{"role": "user", "content": "\ue000"}], template_kwargs)
                found = plain.split("\ue000", 1)[1] if plain.count("\ue000") == 1 else ""
        except Exception:  # a template that refuses a lone user turn: no header to look for
            found = ""
        _PROBES[key] = found
    return _PROBES[key]


_ADDED: weakref.WeakKeyDictionary[Any, tuple[int, frozenset[str], tuple[str, ...]]] = weakref.WeakKeyDictionary()


def added_tokens(tokenizer: Any) -> tuple[frozenset[str], tuple[str, ...]]:
    """(every added token's text, the special ones'), kept per tokenizer until its vocabulary grows."""
    size = len(tokenizer)
    cached = _ADDED.get(tokenizer)
    if cached is None or cached[0] != size:
        decoder = tokenizer.added_tokens_decoder
        cached = (size, frozenset(t.content for t in decoder.values()),
                  tuple(sorted(t.content for t in decoder.values() if t.special)))
        _ADDED[tokenizer] = cached
    return cached[1], cached[2]


def end_of_turn_markers(tokenizer: Any) -> tuple[str, ...]:
    """The known end-of-turn markers that are added tokens of this tokenizer, and its eos; longest first."""
    added, _ = added_tokens(tokenizer)
    found = {m for m in END_OF_TURN_MARKERS if m in added}
    if tokenizer.eos_token and tokenizer.eos_token in added:
        found.add(tokenizer.eos_token)
    return tuple(sorted(found, key=lambda m: (-len(m), m)))


def _regions(render: Any, messages: list[dict[str, Any]], full: str) -> list[tuple[int, int] | None]:
    """Each message's region in `full`, None for a message whose text the template does not render."""
    c = _sentinel_char(full, messages)
    regions: list[tuple[int, int] | None] = []
    for j, message in enumerate(messages):
        other = render([*messages[:j], _with_sentinel(message, f"{c}{j}{c}"), *messages[j + 1:]])
        regions.append(None if other == full else _diff_region(full, other))
    for i, a in enumerate(regions):
        for j in range(i + 1, len(regions)):
            b = regions[j]
            if a and b and a[0] < b[1] and b[0] < a[1] and (a[0] < a[1] or b[0] < b[1]):
                raise TemplateNotLocal(
                    f"the chat template renders message {i} ({messages[i]['role']}) differently when the text of "
                    f"message {j} ({messages[j]['role']}) changes, so their turns cannot be told apart for label "
                    "masking. Use another template (tokenizer.chat_template), or set train_on_inputs: true.")
    return regions


def _turn_start(ctx: _Context, i: int, lo: int, p: int) -> int:
    """Where assistant message i's trained text starts: after the assistant header in front of its content."""
    k = ctx.full.rfind(ctx.header, lo, p) if ctx.header else -1
    if k >= 0:
        return k + len(ctx.header)
    # No header in front of this turn: the template renders history differently from its generation prompt
    # (DeepSeek-R1-distill's prompt ends with a '<think>\n' prefill history lacks), or has none (Mistral).
    # Where the prefix rendered with the generation prompt is a prefix of the whole, the turn starts where it
    # ends; without a generation prompt, where the user turn's closing text ('[/INST]') ends; else at the content.
    if i:
        try:
            prefix = ctx.render(ctx.messages[:i], add_generation_prompt=True)
        except Exception:
            prefix = None
        if prefix is not None and ctx.full.startswith(prefix) and lo <= len(prefix) <= p:
            return len(prefix)
        before = ctx.regions[i - 1]
        if not ctx.header and before and ctx.messages[i - 1]["role"] == "user":
            closing = ctx.closing
            if closing and ctx.full.startswith(closing, before[1]) and before[1] + len(closing) <= p:
                return before[1] + len(closing)
    return p


def _turn_end(ctx: _Context, q: int, hi: int) -> tuple[int, str]:
    """The end of the first end-of-turn marker after the content and before the next message, and the marker."""
    best: tuple[int, str] | None = None
    for marker in ctx.markers:
        k = ctx.full.find(marker, q, hi)
        if k >= 0 and (best is None or k < best[0]):
            best = (k, marker)
    return (best[0] + len(best[1]), best[1]) if best else (q, "")


@dataclass
class _Context:
    full: str
    messages: list[dict[str, Any]]
    regions: list[tuple[int, int] | None]
    render: Any
    header: str
    closing: str
    markers: tuple[str, ...]


def chat_layout(tokenizer: Any, messages: Sequence[Mapping[str, Any]], wanted: Sequence[int],
                template_kwargs: Mapping[str, Any] | None = None) -> ChatLayout:
    """The rendering of `messages` and the trained span of each message index in `wanted`.

    Raises TemplateNotLocal when two messages' regions overlap (the template is not local: reported rather
    than mis-masked); exceptions of the template itself (a refused conversation) pass through.
    """
    msgs = [dict(m) for m in messages]

    def render(part: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return render_chat(tokenizer, part, template_kwargs, add_generation_prompt)

    full = render(msgs)
    regions = _regions(render, msgs, full)
    ctx = _Context(full, msgs, regions, render, _probe("header", tokenizer, template_kwargs),
                   _probe("closing", tokenizer, template_kwargs), end_of_turn_markers(tokenizer))
    turns, unrendered = [], []
    for i in sorted(set(wanted)):
        region = regions[i]
        if region is None:
            unrendered.append(i)
            continue
        p, q = region
        others = [r for j, r in enumerate(regions) if r is not None and j != i]
        lo = max((b for a, b in others if b <= p), default=0)
        hi = min((a for a, b in others if a >= q and b > p), default=len(full))
        start = _turn_start(ctx, i, lo, p) if msgs[i]["role"] == "assistant" else p
        end, marker = _turn_end(ctx, q, hi)
        turns.append(TurnSpan(i, start, p, q, end, marker))
    return ChatLayout(full, tuple(turns), tuple(unrendered))


def trained_tokens(offsets: Sequence[tuple[int, int]], turns: Sequence[TurnSpan]) -> list[bool]:
    """Per token: is it trained? A token is trained when its first character lies in a turn's span."""
    starts = [start for start, _ in offsets]
    flags = [False] * len(starts)
    for turn in turns:
        for t in range(bisect.bisect_left(starts, turn.start), bisect.bisect_left(starts, turn.end)):
            flags[t] = True
    return flags
