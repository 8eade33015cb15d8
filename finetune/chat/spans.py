"""Where each message of a conversation lands in its chat-template rendering: the trained character spans.

The conversation is rendered once, and that text is what gets tokenized. regions.py locates each message's
text in it (its region: what changes when the message's content, reasoning and tool-call arguments are replaced by
a sentinel), exactly for every template, also for those that render a turn differently depending on what follows
it (Qwen3, Phi-3.5, gpt-oss), in a number of renderings that does not grow with the conversation.

A trained assistant turn runs from the end of the template's assistant header (what `add_generation_prompt`
appends) to the end-of-turn marker the template writes after the message's text, both included: text the template
puts between header and content is what the model generates after the generation prompt (Qwen3's think block,
gpt-oss's `<|channel|>final<|message|>`, a tool call's `<tool_call>` tags), so it is trained. A trained system,
user or tool message is its content plus the end-of-turn marker after it. docs/chat-templates.md shows the result
for each tested family.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.chat.content_blind import content_blind
from finetune.chat.regions import (
    REASONING_FIELDS,
    TemplateNotLocal,
    common_prefix,
    find_regions,
    swapped_regions,
    swapped_rendering,
    unused_char,
)
from finetune.chat.shapes import SentinelRenders, Sentinels, exact_key
from finetune.chat.turns import Neighbours, TurnContext, turn_end, turn_start

__all__ = ["REASONING_FIELDS", "ChatLayout", "TemplateNotLocal", "TurnSpan", "added_tokens", "chat_layout",
           "end_of_turn_markers", "render_chat"]

# Single tokens that end a turn in the official templates we know. Only those that are one added token of the
# tokenizer at hand count (plain text never matches), plus the tokenizer's eos.
END_OF_TURN_MARKERS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|return|>", "<|call|>", "</s>",
    "<｜end▁of▁sentence｜>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<turn|>",
)

# Not frozen: a frozen dataclass's __init__ costs ~0.6 us more, paid for every row of a corpus. Never changed.
@dataclass(slots=True)
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


# Not frozen: a frozen dataclass's __init__ costs ~0.6 us more, paid for every row of a corpus. Never changed.
@dataclass(slots=True)
class ChatLayout:
    """A rendered conversation, the spans of the messages asked for, and those the template did not render."""

    text: str
    turns: tuple[TurnSpan, ...]
    unrendered: tuple[int, ...]
    """Messages asked for whose text the template does not render at all (Mistral Nemo drops the system prompt
    unless the last message is a user's)."""
    calls_not_rendered: tuple[int, ...] = ()
    """Messages whose tool calls the template does not render, all or some (a template without tool support)."""
    verbatim: bool = False
    """Every message's content is written verbatim (regions.Regions.verbatim_shape): no turn's text changed."""


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None,
                add_generation_prompt: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The chat template's rendering of `messages` (template kwargs and the row's tools passed through, as at
    inference)."""
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **_template_inputs(template_kwargs, tools))


def render_chats(tokenizer: Any, conversations: Sequence[Sequence[Mapping[str, Any]]],
                 template_kwargs: Mapping[str, Any] | None) -> list[str] | None:
    """render_chat of each conversation (none with tools of its own), in one call: transformers renders a batch
    with the template's setup done once (19 us a quickstart row, against 27 rendered one by one). None when the
    template refuses any of them: then each is rendered on its own, and the one refused is a bad row."""
    if not conversations:
        return []
    try:
        out = tokenizer.apply_chat_template([[dict(m) for m in c] for c in conversations], tokenize=False,
                                            **_template_inputs(template_kwargs, None))
    except Exception:
        return None
    return list(out) if isinstance(out, list) and len(out) == len(conversations) else None


def _template_inputs(template_kwargs: Mapping[str, Any] | None,
                     tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """What render_chat passes the template besides the messages."""
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = [dict(t) for t in tools]
    return kwargs


TemplateKey = tuple[str, str, tuple[tuple[str, str], ...]]

# (template, kwargs, special tokens) -> (header, closing)
_PROBES: dict[TemplateKey, tuple[str, str]] = {}


def template_key(tokenizer: Any, template_kwargs: Mapping[str, Any] | None) -> TemplateKey:
    """(template, kwargs as json, special tokens): the probes' key, and with the kwargs and tools told apart exactly,
    the sentinel renderings' (_sentinel_cache). Built once per conversation, from cheap parts (json of the special
    tokens, twice a row, was 5% of tokenizing one)."""
    kwargs = json.dumps(template_kwargs, sort_keys=True, default=str) if template_kwargs else "{}"
    return str(tokenizer.chat_template), kwargs, tuple(sorted(tokenizer.special_tokens_map.items()))


def _probes(tokenizer: Any, template_kwargs: Mapping[str, Any] | None,
            key: TemplateKey | None = None) -> tuple[str, str]:
    """What a template writes around a lone user turn, (header, closing), measured once per template, kwargs and
    special tokens (`key`: template_key's, when the caller has it).

    header: what `add_generation_prompt` appends (only where it ends matters, as it is searched from the end:
    Phi-3.5's plain rendering ends with '<|endoftext|>' and its prompted one with '<|assistant|>\\n', so the two
    share '<|' and the header found is 'assistant|>\\n'). closing: what follows the user's content ('[/INST]').
    """
    key = key or template_key(tokenizer, template_kwargs)
    found = _PROBES.get(key)
    if found is None:
        found = _PROBES[key] = (_probe_text("header", tokenizer, template_kwargs),
                                _probe_text("closing", tokenizer, template_kwargs))
    return found


def _probe_text(kind: str, tokenizer: Any, template_kwargs: Mapping[str, Any] | None) -> str:
    try:
        if kind == "header":
            probe = [{"role": "user", "content": "Hi"}]
            plain = render_chat(tokenizer, probe, template_kwargs)
            prompted = render_chat(tokenizer, probe, template_kwargs, add_generation_prompt=True)
            return prompted[common_prefix(prompted, plain):]
        plain = render_chat(tokenizer, [{"role": "user", "content": "\ue000"}], template_kwargs)
        return plain.split("\ue000", 1)[1] if plain.count("\ue000") == 1 else ""
    except Exception:  # a template that refuses a lone user turn: no header to look for
        return ""


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


_MARKERS: dict[tuple[frozenset[str], str | None], tuple[str, ...]] = {}


def end_of_turn_markers(tokenizer: Any) -> tuple[str, ...]:
    """The known end-of-turn markers that are added tokens of this tokenizer, and its eos; longest first (kept
    per added tokens and eos: asked once a conversation)."""
    added, _ = added_tokens(tokenizer)
    eos = tokenizer.eos_token
    markers = _MARKERS.get((added, eos))
    if markers is None:
        found = {m for m in END_OF_TURN_MARKERS if m in added}
        if eos and eos in added:
            found.add(eos)
        markers = _MARKERS[(added, eos)] = tuple(sorted(found, key=lambda m: (-len(m), m)))
    return markers


_SENTINEL_RENDERS: weakref.WeakKeyDictionary[Any, SentinelRenders] = weakref.WeakKeyDictionary()
PLANS_PER_SHAPE = 16


# What a template can read that changes between calls: transformers' clock, Jinja's random filter and lorem ipsum.
_IMPURE = re.compile(r"\b(strftime_now|random|lipsum)\b")


@functools.lru_cache(maxsize=64)
def _pure(template: str) -> bool:
    """Whether the template's rendering depends on its inputs only (a name of the clock or of chance anywhere in it,
    even in a branch not taken, counts against it: Llama 3's template writes today's date unless given one)."""
    return _IMPURE.search(template) is None


def _sentinel_cache(tokenizer: Any, key: TemplateKey, template_kwargs: Mapping[str, Any] | None,
                    tools: Sequence[Mapping[str, Any]] | None) -> tuple[SentinelRenders | None, Hashable | None]:
    """The tokenizer's own cache of sentinel renderings (one per tokenizer: a tokenizer class may render its own
    way), and the scope of this conversation's entry: the template and special tokens (`key`) and, told apart
    exactly, the kwargs and tools the template is given (None, nothing kept, when they are not plain data, or when
    the template's rendering can change between calls)."""
    if not _pure(key[0]):
        return None, None
    try:
        cache = _SENTINEL_RENDERS.get(tokenizer)
        if cache is None:
            cache = _SENTINEL_RENDERS[tokenizer] = SentinelRenders()
    except TypeError:  # a tokenizer that takes no weak reference: nothing kept
        return None, None
    inputs = exact_key(_template_inputs(template_kwargs, tools))
    return cache, ((key, inputs) if inputs is not None else None)


@dataclass(frozen=True)
class TemplateFacts:
    """What laying out a conversation asks of the tokenizer and the recipe's template kwargs, found once for many
    rows (a chunk's) rather than once a row: the template's key, the tokenizer's cache of sentinel renderings and
    the scope in it of rows without tools of their own (None, None: nothing kept), the end-of-turn markers, the
    added tokens (all, and the special ones) and the vocabulary's size."""

    key: TemplateKey
    cache: SentinelRenders | None
    scope: Hashable | None
    markers: tuple[str, ...]
    added: frozenset[str]
    specials: tuple[str, ...]
    vocab: int
    blind: bool = False
    """The template writes every message's content verbatim and reads nothing else of it (content_blind.py)."""


def template_facts(tokenizer: Any, template_kwargs: Mapping[str, Any] | None) -> TemplateFacts:
    """The TemplateFacts of a tokenizer and template kwargs as they are now."""
    key = template_key(tokenizer, template_kwargs)
    return TemplateFacts(key, *_sentinel_cache(tokenizer, key, template_kwargs, None),
                         end_of_turn_markers(tokenizer), *added_tokens(tokenizer), len(tokenizer),
                         content_blind(key[0]) and key[0] not in _DISTRUSTED)


# Templates whose skipped rendering once differed from the real one (a gap in content_blind.py's proof): rendered
# every time from then on, in this process.
_DISTRUSTED: set[str] = set()


def skip_holds(tokenizer: Any, facts: TemplateFacts, messages: Sequence[Mapping[str, Any]],
               template_kwargs: Mapping[str, Any] | None, layout: ChatLayout) -> bool:
    """Whether a skipped layout's text is the template's own rendering of `messages`: the spot check the caller
    makes on one row of each chunk it skips. When it is not, the template is distrusted (rendered from then on)."""
    if render_chat(tokenizer, messages, template_kwargs) == layout.text:
        return True
    _DISTRUSTED.add(facts.key[0])
    return False


def skipped_layout(facts: TemplateFacts, messages: Sequence[Mapping[str, Any]],
                   wanted: Sequence[int]) -> ChatLayout | None:
    """The layout of a conversation of plain messages without rendering it, where its template is content-blind and
    its shape's rendering and turn plan are kept: the shape's rendering with the contents put in is then exactly
    what the template would write (content_blind.py says why). None otherwise: the row is rendered."""
    if not facts.blind or facts.cache is None:
        return None
    known = _known_key(facts, messages, "", tuple(sorted(set(wanted))))
    kept = facts.cache.layouts.get(known) if known is not None else None
    if kept is None:
        return None
    shape, plan = kept
    swapped = swapped_rendering(shape.every, shape.marks.order, shape.marks.spans,
                                [m["content"] for m in messages], len(messages))
    return plan.layout(*swapped) if swapped is not None else None


def chat_layout(tokenizer: Any, messages: Sequence[Mapping[str, Any]], wanted: Sequence[int],
                template_kwargs: Mapping[str, Any] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None, rendered: str | None = None,
                facts: TemplateFacts | None = None) -> ChatLayout:
    """The rendering of `messages` (with the row's `tools`) and the trained span of each message index in `wanted`.
    `rendered`: that rendering, when the caller made it already (render_chats); `facts`: template_facts(tokenizer,
    template_kwargs), when the caller keeps them for many rows.

    Raises TemplateNotLocal when two messages' regions overlap (the template is not local: reported rather
    than mis-masked); exceptions of the template itself (a refused conversation) pass through.
    """
    facts = facts or template_facts(tokenizer, template_kwargs)
    full = rendered if rendered is not None else render_chat(tokenizer, messages, template_kwargs, tools=tools)
    wanted_key = tuple(sorted(set(wanted)))
    known = None if tools else _known_key(facts, messages, full, wanted_key)
    if known is not None and facts.cache is not None:
        layout = _known_layout(facts.cache.layouts.get(known), full, messages)
        if layout is not None:
            return layout
    layout, kept = _laid_out(tokenizer, [dict(m) for m in messages], wanted_key, template_kwargs, tools, full, facts)
    if known is not None and kept is not None and facts.cache is not None:
        facts.cache.keep_layout(known, kept)
    return layout


def _laid_out(tokenizer: Any, msgs: list[dict[str, Any]], wanted: tuple[int, ...],
              template_kwargs: Mapping[str, Any] | None, tools: Sequence[Mapping[str, Any]] | None, full: str,
              facts: TemplateFacts) -> tuple[ChatLayout, tuple[Sentinels, _Plan] | None]:
    """chat_layout from the regions (regions.py), and the shape's kept rendering and turn plan, when it has
    one."""

    def render(part: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return render_chat(tokenizer, part, template_kwargs, add_generation_prompt, tools)

    scoped = (facts.cache, facts.scope) if not tools else _sentinel_cache(tokenizer, facts.key, template_kwargs, tools)
    found = find_regions(render, msgs, full, tools, *scoped)
    shape = found.verbatim_shape  # the shape's kept rendering, where its plans live
    plan_key = (wanted, facts.vocab)  # the markers depend on the added tokens
    plan = shape.plans.get(plan_key) if shape is not None else None
    if plan is not None:
        return plan.layout(full, found.regions), (shape, plan)
    regions = list(found.regions)
    ctx = TurnContext(full, msgs, regions, render, *_probes(tokenizer, template_kwargs, facts.key), facts.markers,
                      facts.added)
    neighbours = Neighbours(regions, len(full))
    turns, unrendered = [], []
    for i in wanted:
        region = regions[i]
        if region is None:
            unrendered.append(i)
            continue
        p, q = region
        lo, hi = neighbours.around(i, p, q)
        start = turn_start(ctx, i, lo, p) if msgs[i]["role"] == "assistant" else p
        end, marker = turn_end(ctx, q, hi)
        turns.append(TurnSpan(i, start, p, q, end, marker))
    layout = ChatLayout(full, tuple(turns), tuple(unrendered), found.calls_not_rendered, shape is not None)
    # Without a header, a turn's start can depend on its row's text. A few wanted sets per shape: per-message
    # train flags could otherwise make one plan per combination.
    if shape is not None and ctx.header and len(shape.plans) < PLANS_PER_SHAPE:
        plan = shape.plans[plan_key] = _Plan.of(layout)
        return layout, (shape, plan)
    return layout, None


def _known_key(facts: TemplateFacts, messages: Sequence[Mapping[str, Any]], full: str,
               wanted: tuple[int, ...]) -> Hashable | None:
    """For a conversation of plain messages (each exactly a role and a non-empty content, strings, in that order),
    the key of its shape's turn plan among those kept (SentinelRenders.layouts): its messages with their texts
    replaced are told apart by their roles alone, so the key is the scope, the sentinel character, the roles and
    the plan's own key. None for other conversations, and where nothing is kept. `full`: the rendering ("" when
    it is not made: skipped_layout; a content-blind template's is its shape's text and the contents, and a shape is
    kept only with a character its text lacks)."""
    if facts.scope is None:
        return None
    roles, texts = [], []
    for m in messages:
        if type(m) is not dict or len(m) != 2 or next(iter(m)) != "role":
            return None
        role, content = m["role"], m.get("content")
        if type(role) is not str or type(content) is not str or not content:
            return None
        roles.append(role)
        texts += (role, content)
    # The character regions_at_once picks: the strings of such messages are these and the keys "role", "content".
    c = unused_char(full, "\0".join(texts))
    return (facts.scope, c, tuple(roles), wanted, facts.vocab) if c else None


def _known_layout(kept: tuple[Sentinels, _Plan] | None, full: str,
                  messages: Sequence[Mapping[str, Any]]) -> ChatLayout | None:
    """The layout a plain conversation's kept shape and plan give (what chat_layout would find through
    regions_by_content and the plan, without building its messages with sentinels), or None when the contents do
    not give its rendering verbatim."""
    if kept is None:
        return None
    shape, plan = kept
    regions = swapped_regions(full, shape.every, shape.marks.order, shape.marks.spans,
                              [m["content"] for m in messages], len(messages))
    return plan.layout(full, regions) if regions is not None else None


@dataclass(frozen=True)
class _Plan:
    """The turns of every conversation of one shape whose contents the template writes verbatim, for one set of
    wanted messages: per turn, how far its start lies before its content and its end after it. Both are found by
    searching the template's own text between the contents (the assistant header before, the end-of-turn marker
    after), which is the same in every rendering of the shape (Regions.verbatim_shape, whose `plans` keep them by
    wanted messages and vocabulary size), so the first row's layout gives every other's from its regions.
    Templates without an assistant header are left out: their turn starts are found by rendering the row's own
    prefix."""

    turns: tuple[tuple[int, int, int, str], ...]
    """(message index, content start - turn start, turn end - content end, marker)."""
    unrendered: tuple[int, ...]
    calls_not_rendered: tuple[int, ...]

    @classmethod
    def of(cls, layout: ChatLayout) -> _Plan:
        return cls(tuple((t.message_index, t.content_start - t.start, t.end - t.content_end, t.marker)
                         for t in layout.turns), layout.unrendered, layout.calls_not_rendered)

    def layout(self, full: str, regions: Sequence[tuple[int, int] | None]) -> ChatLayout:
        turns = []
        for i, before, after, marker in self.turns:
            p, q = regions[i]
            turns.append(TurnSpan(i, p - before, p, q, q + after, marker))
        return ChatLayout(full, tuple(turns), self.unrendered, self.calls_not_rendered, True)
