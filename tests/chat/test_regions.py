"""Locating each message in its rendering (finetune/chat/regions.py): the linear way (four renderings) gives
exactly what rendering once per message gives, on every family's fixed and random conversations; a conversation
it cannot check goes the slow way; and a long chat costs a fixed number of renderings, so time linear in its length.
"""

from __future__ import annotations

import random

import pytest
from chat_families import FAMILIES, FAMILY, conversations, random_conversation
from helpers import CountingTokenizer, profile_events

from finetune.chat.regions import find_regions, regions_at_once, regions_one_by_one
from finetune.chat.spans import chat_layout, render_chat
from finetune.data.formats import to_example
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.labels import IGNORE_INDEX

LONG_CHAT_MESSAGES = 2000  # the rendering count: the same for 4 messages as for this many
# The "10,000-turn chat in seconds": measured 2.0-2.2 s per family here (2,000 messages: 0.35-0.6 s, so
# linear); rendering once per message took 37-186 s at 2,000 and grows with the square. The test counts work.
LONG_CHAT_TOKENIZED = 5_000
LINEAR_BASE_MESSAGES = 500


def long_chat(n_messages: int) -> list[dict[str, str]]:
    msgs = []
    for i in range(n_messages // 2):
        msgs += [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                 {"role": "assistant", "content": f"It is {2 * i}."}]
    return msgs


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_at_once_agrees_with_one_by_one(family):
    tokenizer = family.build()

    def render(part):
        return render_chat(tokenizer, part, family.kwargs)

    rng = random.Random(f"regions-{family.name}")
    cases = [m for s in (False, True) if s <= family.system_ok for m in conversations(s).values()]
    cases += [random_conversation(rng, family) for _ in range(12)]
    for messages in cases:
        full = render(messages)
        fast = regions_at_once(render, messages, full)
        assert fast is not None, messages
        assert fast == regions_one_by_one(render, messages, full)


def test_a_conversation_the_fast_way_cannot_check_goes_the_slow_way():
    # A template that cuts content to 2 characters cuts the sentinels too: the fast way cannot pair them up.
    family = FAMILY["qwen2.5"]
    tokenizer = family.build()
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content[:2] }}<|im_end|>{% endfor %}"
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "World"}]

    def render(part):
        return render_chat(tokenizer, part, None)

    full = render(messages)
    assert full == "<user>He<|im_end|><assistant>Wo<|im_end|>"
    assert regions_at_once(render, messages, full) is None
    slow = regions_one_by_one(render, messages, full)
    assert find_regions(render, messages, full) == slow
    assert [full[a:b] for a, b in slow.regions] == ["He", "Wo"]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3-no-thinking", "mistral-nemo", "gpt-oss", "r1-distill-qwen"])
def test_a_long_chat_costs_as_many_renderings_as_a_short_one(name):
    family = FAMILY[name]
    chat_layout(family.build(), long_chat(2), [1], family.kwargs)  # the header and closing probes, cached
    counts = []
    for n in (4, LONG_CHAT_MESSAGES):
        tokenizer = CountingTokenizer(family.build())
        messages = long_chat(n)
        layout = chat_layout(tokenizer, messages, [i for i in range(n) if i % 2], family.kwargs)
        assert len(layout.turns) == n // 2
        counts.append(tokenizer.renders)
    # The whole and every message replaced (2: the contents swapped back give the whole, regions_by_content), or
    # also each half replaced (4): a constant number whatever the length.
    assert counts[0] == counts[1] and counts[0] in (2, 4), counts


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "mistral-nemo"])
def test_a_5000_message_chat_tokenizes_in_linear_work(name):
    """10x the messages is ~10x the work (measured 9.96-9.99x from 1,000 to 10,000), where rendering once per
    message would be ~100x: the guard counts function calls rather than seconds, so a busy machine cannot fail it
    (10,000 messages take ~2 s here; benchmarks/chat_masking.py times them)."""
    family = FAMILY[name]
    tokenizer = family.build()
    work, samples = [], []
    for n in (LINEAR_BASE_MESSAGES, LONG_CHAT_TOKENIZED):
        tokenize_example(to_example(RawRow({"messages": long_chat(n)}, "t.jsonl:1"), "chat"), tokenizer,
                         family.kwargs)  # the shape's caches filled, as for every row after the first
        example = to_example(RawRow({"messages": long_chat(n)}, "t.jsonl:1"), "chat")
        work.append(profile_events(lambda ex=example: samples.append(tokenize_example(ex, tokenizer, family.kwargs))))
    assert work[1] / work[0] < 15, work
    sample = samples[-1]
    trained = tokenizer.decode([t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX])
    assert trained.startswith("It is 0.") and trained.count("It is ") == LONG_CHAT_TOKENIZED // 2
