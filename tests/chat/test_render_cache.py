"""The cache of sentinel renderings (chat.regions.SentinelRenders, one per tokenizer: chat/spans.py): rows of one
shape render the rendering with every message replaced once; tokenizers, templates, kwargs and tools never share
an entry; a template that is not a pure substitution still gets exactly the regions of rendering afresh; and a
template whose output can change between calls (a date) is never kept. The turn plans kept beside it (rows whose
contents the template writes verbatim take their turns' starts and ends from the first row of their shape) give
every family's layouts exactly.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from chat_families import FAMILIES, FAMILY, FRAGMENTS, USER_ONLY, conversations, random_conversation
from helpers import CountingTokenizer

from finetune.chat import spans
from finetune.chat.regions import find_regions, regions_one_by_one
from finetune.chat.shapes import SentinelRenders, Sentinels
from finetune.chat.spans import chat_layout, render_chat

QWEN = FAMILY["qwen2.5"]
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}"
UPPER = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}<|im_end|>{% endfor %}"
CUT = "{% for m in messages %}<{{ m.role }}>{{ m.content[:2] }}<|im_end|>{% endfor %}"
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}


def chat(question: str, answer: str, system: str | None = None) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]


ROWS = [chat("What is 2 * 5?", "10"), chat("Reverse: bread, leaf", "leaf, bread"), chat("Say hi", "hi there")]


def renders(tokenizer: CountingTokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None = None,
            tools: list[dict[str, Any]] | None = None) -> int:
    """How many renderings chat_layout made for one conversation (its assistant turns asked for)."""
    before = tokenizer.renders
    chat_layout(tokenizer, messages, [i for i, m in enumerate(messages) if m["role"] == "assistant"], kwargs, tools)
    return tokenizer.renders - before


def primed(template: str | None = None) -> CountingTokenizer:
    """A counting tokenizer with an empty cache of its own, the template's probes (cached for all) already made."""
    inner = QWEN.build()
    if template is not None:
        inner.chat_template = template
    chat_layout(CountingTokenizer(inner), ROWS[0], [1])
    return CountingTokenizer(inner)


def test_rows_of_one_shape_render_the_sentinel_version_once():
    tokenizer = primed()
    assert [renders(tokenizer, m) for m in ROWS] == [2, 1, 1]  # the real rendering and, once, every text replaced
    assert renders(tokenizer, chat("Hi", "Hello", system="Be brief.")) == 2  # another shape: a system message
    assert renders(tokenizer, chat("Hey", "Hello", system="Be kind.")) == 1
    for messages in ROWS:  # what the cache served is what rendering afresh gives
        wanted = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert chat_layout(tokenizer, messages, wanted) == chat_layout(primed(), messages, wanted)


def test_tokenizers_never_share_entries():
    first, second = primed(), primed()
    assert renders(first, ROWS[0]) == 2
    assert renders(second, ROWS[1]) == 2  # the same template, but its own cache


@pytest.mark.parametrize("change", ["template", "kwargs", "tools"])
def test_templates_kwargs_and_tools_never_share_entries(change):
    def layout(tokenizer: CountingTokenizer, variant: int, messages: list[dict[str, str]]) -> int:
        if change == "template":
            tokenizer.inner.chat_template = (QWEN.build().chat_template, PLAIN)[variant]
            return renders(tokenizer, messages)
        if change == "kwargs":  # 1 == 1.0, but a template writes them apart
            return renders(tokenizer, messages, kwargs=({"flag": 1}, {"flag": 1.0})[variant])
        return renders(tokenizer, messages, tools=[TOOL] if variant else None)

    for variant in (0, 1):  # the variants' probes, made once for all
        layout(primed(), variant, ROWS[2])
    tokenizer = primed()
    counts = [layout(tokenizer, 0, ROWS[0]), layout(tokenizer, 1, ROWS[1]), layout(tokenizer, 0, ROWS[2]),
              layout(tokenizer, 1, ROWS[0])]
    assert counts == [2, 2, 1, 1], counts  # each variant renders every text replaced once, kept beside the other's
    QWEN.build()  # the shared tokenizer's own template back


@pytest.mark.parametrize("template", [UPPER, CUT], ids=["upper", "cut"])
def test_a_template_that_is_not_a_substitution_gets_the_regions_of_rendering_afresh(template):
    # UPPER: swapping the contents back does not give the real rendering (the check fails, four renderings find the
    # regions); CUT cuts the sentinels too (the slow way decides). Either way the answer is the slow way's.
    tokenizer = QWEN.build()
    tokenizer.chat_template = template
    cache = SentinelRenders()

    def render(part: list[dict[str, Any]]) -> str:
        return render_chat(tokenizer, part, None)

    for messages in ROWS:
        full = render(messages)
        assert find_regions(render, messages, full, None, cache, "scope") == regions_one_by_one(render, messages, full)
    QWEN.build()


@pytest.mark.parametrize("impure", ["strftime_now('%Y')", "[1, 2] | random", "lipsum(1)"])
def test_a_template_that_can_change_between_calls_is_never_kept(impure):
    # The check would not catch a kept rendering gone stale: four renderings give a message's region the text
    # that changed (a date written before it). So such a template renders every text replaced for each row.
    template = "{{ " + impure + " if false else '' }}" + PLAIN
    tokenizer = primed(template)
    assert [renders(tokenizer, m) for m in ROWS] == [2, 2, 2]
    assert [chat_layout(tokenizer, m, [1]) for m in ROWS] == [chat_layout(primed(template), m, [1]) for m in ROWS]
    QWEN.build()


def test_the_cache_is_bounded():
    cache = SentinelRenders(size=2)
    keys = [cache.key("scope", "\ue000", [{"role": "user", "content": str(i)}]) for i in range(3)]
    for key in keys:
        cache.put(key, Sentinels("", None))  # type: ignore[arg-type]
        cache.get(keys[0])  # the first stays the most recently used
    assert len(cache) == 2 and cache.get(keys[0]) is not None and cache.get(keys[1]) is None
    # And by characters: a long conversation's rendering pushes out others, one over the budget is not kept.
    cache = SentinelRenders(chars=100)
    keys = [cache.key("scope", "\ue000", [i]) for i in range(3)]  # each key's text: 3 characters ('[0]')
    for key, every in zip(keys, ("a" * 10, "b" * 10, "c" * 90)):
        cache.put(key, Sentinels(every, None))  # type: ignore[arg-type]
    assert len(cache) == 1 and cache.get(keys[2]).every == "c" * 90
    cache.put(keys[0], Sentinels("d" * 98, None))  # type: ignore[arg-type]
    assert len(cache) == 1 and cache.get(keys[0]) is None
    # Nothing is kept without a scope, or for messages that are not plain data (a repr need not tell them apart).
    assert cache.key(None, "\ue000", [{"role": "user"}]) is None
    assert cache.key("scope", "\ue000", [{"role": "user", "content": object()}]) is None


def _same_shape(rng: random.Random, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with other contents (user text that spells control tokens too), its roles and fields kept."""
    out = []
    for m in messages:
        pool = FRAGMENTS + USER_ONLY if m["role"] == "user" else FRAGMENTS
        out.append({**m, "content": "".join(rng.choices(pool, k=rng.randint(1, 5))) + "x"})
    return out


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_turn_plans_give_the_layouts_of_a_fresh_tokenizer(family):
    # Each shape twice or more with other contents: the later rows take the first one's plan. A fresh wrapper
    # (its own caches) lays every row out from scratch. The wanted sets: the assistant turns, and every message.
    inner = family.build()
    kept = CountingTokenizer(inner)
    rng = random.Random(f"plans-{family.name}")
    shapes = [m for s in (False, True) if s <= family.system_ok for m in conversations(s).values()]
    shapes += [random_conversation(rng, family) for _ in range(3)]
    verbatim = 0
    for shape in shapes:
        for messages in (shape, _same_shape(rng, shape), _same_shape(rng, shape)):
            for wanted in ([i for i, m in enumerate(messages) if m["role"] == "assistant"], range(len(messages))):
                try:
                    fresh = chat_layout(CountingTokenizer(inner), messages, wanted, family.kwargs)
                except Exception as e:  # a conversation the template refuses: refused the same way with plans
                    with pytest.raises(type(e)):
                        chat_layout(kept, messages, wanted, family.kwargs)
                    continue
                assert chat_layout(kept, messages, wanted, family.kwargs) == fresh, messages
                verbatim += fresh.verbatim
    if verbatim and _probes_header(inner, family.kwargs):  # plans were made, and kept with the shapes' entries
        assert any(entry.plans for entry, _ in spans._SENTINEL_RENDERS[kept]._entries.values())
    family.build()


def _probes_header(tokenizer: Any, kwargs: Any) -> str:
    return spans._probes(tokenizer, kwargs)[0]


EDGES = ["", " ", "\n", "  \n", "\t"]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_plain_rows_of_a_known_shape_are_laid_out_as_a_fresh_tokenizer_lays_them_out(family, monkeypatch):
    # Rows whose messages are a role and a content only take their shape's kept plan without being rebuilt with
    # sentinels (spans._known_key, SentinelRenders.layouts). Contents with whitespace at either end, which some
    # templates strip, are not written verbatim: those rows must fall back to the regions, and agree all the same.
    inner = family.build()
    kept = CountingTokenizer(inner)
    slow = []
    laid_out = spans._laid_out
    monkeypatch.setattr(spans, "_laid_out", lambda *a: slow.append(1) or laid_out(*a))
    rng = random.Random(f"known-{family.name}")
    shape = conversations(False)["multi"]
    seen_verbatim = fast = 0
    for _ in range(12):
        messages = [{"role": m["role"], "content": rng.choice(EDGES) + "".join(rng.choices(FRAGMENTS, k=2)) + "x"
                     + rng.choice(EDGES)} for m in shape]
        wanted = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        fresh = chat_layout(CountingTokenizer(inner), messages, wanted, family.kwargs)
        before = len(slow)
        assert chat_layout(kept, messages, wanted, family.kwargs) == fresh, messages
        if fresh.verbatim and seen_verbatim and _probes_header(inner, family.kwargs):
            assert len(slow) == before, "a verbatim row of a known shape went the slow way"
            fast += 1
        seen_verbatim += fresh.verbatim
    if family.name in ("qwen2.5", "smollm2", "phi4"):  # templates that write any content verbatim
        assert fast == 11, fast
    family.build()


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_rows_of_a_known_shape_skip_the_rendering_only_where_the_template_is_content_blind(family):
    """A chunk's plain rows of shapes already kept are laid out without rendering them (spans.skipped_layout) when
    the template writes contents verbatim and reads nothing else of them (chat/content_blind.py): their samples are
    those of a fresh tokenizer rendering each row, ids and labels, with whitespace at the contents' ends and
    control-token text among them; other templates render every row, as before. A template wrongly judged blind is
    caught by the spot check and rendered from then on."""
    from collections import Counter

    from finetune.data.formats import Example
    from finetune.data.tokenize import render_ahead, tokenize_example

    inner = family.build()
    kept = CountingTokenizer(inner)
    rng = random.Random(f"skip-{family.name}")
    shapes = [m for s in (False, True) if s <= family.system_ok for m in conversations(s).values()]

    def chunk(first: bool = False) -> list[Example]:
        rows = []
        for shape in shapes:
            for k in range(3):
                messages = tuple({"role": m["role"], "content": rng.choice(EDGES) + "".join(
                    rng.choices(FRAGMENTS + USER_ONLY if m["role"] == "user" else FRAGMENTS, k=2)) + "x"}
                    for m in shape)
                inputs = k == 1 if first else rng.random() < 0.3  # the first chunk keeps both turn plans of a shape
                rows.append(Example(origin="row", messages=messages, train_on_inputs=inputs))
        return rows

    def tokenized(tokenizer: Any, rows: list[Example]) -> list[Any]:
        facts = spans.template_facts(tokenizer, family.kwargs)
        out = []
        for example, rendered in zip(rows, render_ahead(rows, tokenizer, family.kwargs, facts)):
            try:
                out.append(tokenize_example(example, tokenizer, family.kwargs, Counter(), rendered, facts))
            except Exception as e:  # a conversation the template refuses
                out.append(type(e).__name__)
        return out

    tokenized(kept, chunk(first=True))  # the shapes kept
    rows = chunk()
    before = kept.renders
    fresh = [tokenized(CountingTokenizer(inner), [row])[0] for row in rows]
    assert any(type(x) is dict for x in fresh)  # samples, not only refusals
    assert tokenized(kept, rows) == fresh
    renders = kept.renders - before
    if family.name in ("qwen2.5", "smollm2", "phi3.5", "phi4"):  # content-blind, with an assistant header
        assert renders == 1, renders  # one row of the chunk rendered all the same, as a spot check (skip_holds)
    else:
        assert renders >= 1
    family.build()


def test_a_template_wrongly_judged_content_blind_is_caught_by_the_spot_check(monkeypatch):
    """The chunk's spot check (spans.skip_holds) renders one skipped row: a template that writes most contents
    verbatim but redacts some (so its shape is kept from the first rows), were the proof wrong about it, is then
    distrusted and every row rendered, exactly."""
    from collections import Counter

    from finetune.data.formats import Example
    from finetune.data.tokenize import render_ahead, tokenize_example

    monkeypatch.setattr(spans, "content_blind", lambda template: True)
    monkeypatch.setattr(spans, "_DISTRUSTED", set())
    inner = QWEN.build()
    inner.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if 'secret' in m.content %}[redacted]"
                           "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    secret = [[{**m, "content": m["content"] + " secret"} for m in messages] for messages in ROWS]
    rows = [Example(origin="row", messages=tuple(m)) for m in ROWS + secret]

    def tokenized(tokenizer: Any, batch: list[Example]) -> list[Any]:
        facts = spans.template_facts(tokenizer, None)
        return [tokenize_example(e, tokenizer, None, Counter(), r, facts)
                for e, r in zip(batch, render_ahead(batch, tokenizer, None, facts))]

    kept = CountingTokenizer(inner)
    tokenized(kept, rows[:3])  # the shape and its plan kept
    rows = rows[3:] + rows[:3]  # the chunk's first skipped row, the one checked, redacted
    assert tokenized(kept, rows) == [tokenized(CountingTokenizer(inner), [row])[0] for row in rows]
    assert {inner.chat_template} == spans._DISTRUSTED
    assert not spans.template_facts(kept, None).blind
    QWEN.build()
