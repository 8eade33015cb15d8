"""A chunk's chat rows rendered in one call (tokenize.render_ahead, chat.spans.render_chats) give exactly the
renderings, and so the samples, of rendering each row by itself, for every template family; a template that refuses
one row of the chunk makes that row a bad row and no other."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from chat_families import FAMILIES, FAMILY, conversations, random_conversation

from finetune.chat.spans import render_chat, render_chats
from finetune.data.formats import Example
from finetune.data.shards import tokenize_chunk
from finetune.data.sources import BadRow
from finetune.data.stats import DataStats
from finetune.data.tokenize import render_ahead, tokenize_example
from finetune.recipe import DataConfig


def _conversations(family) -> list[list[dict]]:
    rng = random.Random(family.name)
    fixed = [*conversations(False).values(), *(conversations(True).values() if family.system_ok else ())]
    return [*fixed, *(random_conversation(rng, family) for _ in range(8))]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_one_call_renders_what_each_row_renders_alone(family):
    tokenizer = family.build()
    chats = _conversations(family)
    assert render_chats(tokenizer, chats, family.kwargs) == [render_chat(tokenizer, c, family.kwargs) for c in chats]


def _examples(chats: list[list[dict]]) -> list[Example]:
    return [Example(f"rows.jsonl:{i + 1}", messages=tuple(c)) for i, c in enumerate(chats)]


def _one_by_one(examples: list[Example], tokenizer, kwargs) -> tuple[list[dict], list[str]]:
    samples, bad = [], []
    for example in examples:
        try:
            samples.append(tokenize_example(example, tokenizer, kwargs, Counter()))
        except BadRow as e:
            bad.append(str(e))
    return samples, bad


@pytest.mark.parametrize("name", ["qwen2.5", "gemma2"])
def test_a_chunk_gives_the_samples_and_bad_rows_of_one_row_at_a_time(name):
    """gemma2's template refuses a system message: with one such row in the chunk, the one call fails, every row is
    rendered by itself, and that row alone is bad."""
    family = FAMILY[name]
    tokenizer = family.build()
    chats = [c for c in _conversations(family)]
    chats.insert(3, [{"role": "system", "content": "Be brief."}, *conversations(False)["single"]])
    examples = _examples(chats)
    ahead = render_ahead(examples, tokenizer, family.kwargs)
    assert all(text is not None for text in ahead) == family.system_ok
    stats = DataStats()
    samples = tokenize_chunk(examples, tokenizer, DataConfig(max_seq_len=None), stats, "skip", family.kwargs, [])
    expected, bad = _one_by_one(examples, tokenizer, family.kwargs)
    assert samples == expected and stats.bad_rows_skipped == len(bad) == (0 if family.system_ok else 1)
    if bad:
        assert stats.bad_row_examples[0].startswith("rows.jsonl:4: the chat template refused this conversation")


def test_rows_with_their_own_tools_and_other_formats_are_rendered_alone():
    tokenizer = FAMILY["qwen2.5"].build()
    chat = conversations(False)["single"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    examples = [Example("a:1", messages=tuple(chat)), Example("a:2", messages=tuple(chat), tools=(tool,)),
                Example("a:3", text="plain text", train_on_inputs=True)]
    ahead = render_ahead(examples, tokenizer, None)
    assert ahead[0] == render_chat(tokenizer, chat, None) and ahead[1:] == [None, None]
