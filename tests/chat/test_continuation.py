"""A conversation continued turn by turn in tokens (finetune/chat/continuation.py), against two independent paths on
every tested family that renders tool messages (tests/chat_families.py TOOL_EXPECTED): the policy's turns as sampled
(each the text its trained span holds in the whole rendering, tokenized alone) and the environment's turns appended
as the template renders them give

- where the template preserves the prefix: exactly the text of apply_chat_template on the final conversation, its ids
  (but where BPE merges across an assistant header's end: HEADER_MERGES), and the same trained text as the SFT
  masker's;
- where it does not (a template that rewrites an earlier turn when a turn is added): the detection at the exact turn,
  refused with `rewrites: refuse`, and with `keep` the policy's tokens as sampled and the environment's turn as
  rendered after the policy's turn.
"""

from __future__ import annotations

import pytest
from chat_families import FAMILY, TOOL_EXPECTED, tool_row

from finetune.chat.continuation import TemplateRewrites, environment_turn
from finetune.chat.spans import chat_layout, render_chat
from finetune.data.formats import to_example
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.labels import IGNORE_INDEX

TOOL_FAMILIES = sorted(name for name, expected in TOOL_EXPECTED.items() if not isinstance(expected, str))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_by_turn(family, rewrites: str = "keep"):
    """The tool row's conversation built as an RL rollout: the prompt up to the user's question, then each
    assistant turn as sampled and each tool message's turn from environment_turn. Returns (prompt ids, completion
    ids, env_mask, continuations, the final messages, the tools)."""
    tokenizer = family.build()
    example = to_example(RawRow(tool_row(), "t.jsonl:1"), "chat")
    messages, tools = [dict(m) for m in example.messages], example.tools
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = render_chat(tokenizer, messages[:first], family.kwargs, add_generation_prompt=True, tools=tools)
    full = render_chat(tokenizer, messages, family.kwargs, tools=tools)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = {t.message_index: full[t.start:t.end] for t in chat_layout(tokenizer, messages, assistants,
                                                                        family.kwargs, tools).turns}
    completion, mask, so_far, steps = [], [], prompt, []
    i = first
    while i < len(messages):
        sampled = ids(tokenizer, spans[i])  # what the policy samples: its trained span's text
        completion += sampled
        mask += [1] * len(sampled)
        so_far += spans[i]
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        if j == i + 1:
            break
        step = environment_turn(tokenizer, messages[:i + 1], messages[i + 1:j], so_far,
                                template_kwargs=family.kwargs, tools=tools, rewrites=rewrites,
                                turn=assistants.index(i) + 1)
        steps.append(step)
        completion += step.ids
        mask += [0] * len(step.ids)
        so_far += step.text
        i = j
    return tokenizer, ids(tokenizer, prompt), completion, mask, steps, messages, tools


# Families whose byte-level BPE merges characters across the end of the assistant header ("\n\n" then the turn's
# first word): the prompt, tokenized alone as at inference, ends with the header's "\n\n" token, where tokenizing the
# whole conversation at once splits the same characters otherwise. The policy's tokens are the inference ones; the
# text, and what is trained of it, are the same.
HEADER_MERGES = {"llama3.1", "llama3.2"}


def runs(tokenizer, tokens: list[int], trained: list[bool]) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    out, run = [], []
    for token, on in [*zip(tokens, trained), (None, False)]:
        if on:
            run.append(token)
        elif run:
            out.append(tokenizer.decode(run))
            run = []
    return out


@pytest.mark.parametrize("name", TOOL_FAMILIES)
def test_turn_by_turn_ids_equal_the_whole_renderings_and_train_what_sft_trains(name):
    family = FAMILY[name]
    tokenizer, prompt, completion, mask, steps, messages, tools = turn_by_turn(family)
    if not all(step.prefix_kept for step in steps):
        pytest.skip(f"{name}'s template rewrites an earlier turn: test_a_template_that_rewrites_is_detected")
    text = render_chat(tokenizer, messages, family.kwargs, tools=tools)
    ours = prompt + completion
    assert text.startswith(tokenizer.decode(ours))
    whole = ids(tokenizer, text)
    assert (whole[:len(ours)] == ours) == (name not in HEADER_MERGES), name
    sample = tokenize_example(to_example(RawRow(tool_row(), "t.jsonl:1"), "chat"), tokenizer, family.kwargs)
    sft = [label != IGNORE_INDEX for label in sample["labels"]]
    assert runs(tokenizer, completion, [bool(m) for m in mask]) == runs(tokenizer, sample["input_ids"], sft)
    assert 0 < sum(mask) < len(mask)


def _rewriting_families() -> list[str]:
    out = []
    for name in TOOL_FAMILIES:
        steps = turn_by_turn(FAMILY[name])[4]
        if not all(step.prefix_kept for step in steps):
            out.append(name)
    return out


REWRITING = _rewriting_families()


def test_some_family_preserves_the_prefix_and_the_rewriting_ones_are_known():
    """The families whose template rewrites an earlier turn here: those whose template drops the reasoning of
    earlier assistant turns (the Qwen3 line renders an empty think block only for the last one)."""
    assert set(TOOL_FAMILIES) - set(REWRITING), "no family preserves the prefix: the differential test tests nothing"
    assert all(name.startswith("qwen3") for name in REWRITING), REWRITING


@pytest.mark.parametrize("name", REWRITING or ["none"])
def test_a_template_that_rewrites_is_detected_at_its_turn(name):
    if name == "none":
        pytest.skip("no tested family rewrites an earlier turn here")
    family = FAMILY[name]
    with pytest.raises(TemplateRewrites, match="after policy turn 1 is added"):
        turn_by_turn(family, rewrites="refuse")
    tokenizer, prompt, completion, mask, steps, messages, tools = turn_by_turn(family, rewrites="keep")
    assert not steps[0].prefix_kept
    env = tokenizer.decode([t for t, m in zip(completion, mask) if not m])
    assert "temp_c" in env and "<|im_start|>assistant" in env.split("temp_c")[1]  # the result, then the header
