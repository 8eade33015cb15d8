"""Tool use in chat data: assistant `tool_calls`, `role: tool` messages and a row's `tools` reach the chat template,
and the calls are trained by the same rule as any assistant text (from the end of the assistant header through the
end-of-turn marker); a template that leaves them out makes a bad row. Message fields finetune does not read are
bad rows naming them unless data.ignore_message_fields lists them, and an empty trained answer is a bad row.
"""

from __future__ import annotations

import copy
import json
import random
import re

import pytest
from chat_families import ANSWER, FAMILIES, FAMILY, QWEN_CALL, TOOL_EXPECTED, WEATHER_TOOL, tool_row
from conftest import tiny_recipe
from helpers import profile_events

from finetune.chat.regions import regions_at_once, regions_one_by_one
from finetune.chat.spans import render_chat
from finetune.data import build_samples
from finetune.data.formats import MessageFields, to_example
from finetune.data.pairs import to_pair, tokenize_pair
from finetune.data.sources import BadRow, RawRow
from finetune.data.tokenize import tokenize_example
from finetune.labels import IGNORE_INDEX
from finetune.recipe import validate


def trained_runs(tokenizer, text: str, sample: dict) -> list[str]:
    """The text of each maximal run of trained tokens, read from the tokens' character offsets in `text`."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == sample["input_ids"], "the sample is not the tokenized rendering"
    runs, start, end = [], None, None
    for (a, b), label in zip(encoded["offset_mapping"], sample["labels"]):
        if label != IGNORE_INDEX:
            start, end = (a if start is None else start), b
        elif start is not None:
            runs.append(text[start:end])
            start = None
    return runs + ([text[start:end]] if start is not None else [])


def tokenized(family, row: dict, **options) -> tuple[dict, str]:
    tokenizer = family.build()
    example = to_example(RawRow(row, "t.jsonl:3"), "chat", **options)
    sample = tokenize_example(example, tokenizer, family.kwargs)
    return sample, render_chat(tokenizer, example.messages, family.kwargs, tools=example.tools)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_tool_calls_are_rendered_and_trained_exactly(family):
    expected = TOOL_EXPECTED[family.name]
    if isinstance(expected, str):
        with pytest.raises(BadRow, match=re.escape(f"t.jsonl:3: {expected}")):
            tokenized(family, tool_row())
        return
    sample, text = tokenized(family, tool_row())
    assert trained_runs(family.build(), text, sample) == expected
    assert "get_weather" in text.split('{"city": "Paris"}')[0]  # the tools' schema is rendered before the call
    assert 'temp_c' in text  # the tool's answer is rendered, as input (Llama and gpt-oss quote it as JSON)


@pytest.mark.parametrize("name", [n for n, e in TOOL_EXPECTED.items() if not isinstance(e, str)])
def test_tool_rows_are_located_at_once_as_one_by_one(name):
    family = FAMILY[name]
    tokenizer = family.build()
    example = to_example(RawRow(tool_row(), "t.jsonl:3"), "chat")
    messages = [dict(m) for m in example.messages]

    def render(part):
        return render_chat(tokenizer, part, family.kwargs, tools=example.tools)

    full = render(messages)
    fast = regions_at_once(render, messages, full, example.tools)
    assert fast is not None and fast == regions_one_by_one(render, messages, full, example.tools)
    assert fast.calls_not_rendered == ()


def test_content_beside_tool_calls_and_several_calls():
    row = tool_row()
    call = row["messages"][1]["tool_calls"][0]
    row["messages"][1] = {"role": "assistant", "content": "Checking.", "tool_calls": [call, {**call, "id": "call00002"}]}
    sample, text = tokenized(FAMILY["qwen2.5"], row)
    assert trained_runs(FAMILY["qwen2.5"].build(), text, sample)[0] == \
        "Checking.\n" + QWEN_CALL.replace("<|im_end|>", "\n") + QWEN_CALL
    # gpt-oss renders one call per message: the second would be dropped unseen.
    with pytest.raises(BadRow, match="t.jsonl:3: the chat template does not render the tool_calls of message 1"):
        tokenized(FAMILY["gpt-oss"], {**row, "messages": [{**m, "content": ""} if i == 1 else m
                                                          for i, m in enumerate(row["messages"])]})
    with pytest.raises(BadRow, match="the chat template refused this conversation: This model only supports single"):
        tokenized(FAMILY["llama3.1"], row)


def test_reasoning_beside_a_tool_call():
    row = tool_row()
    row["messages"][1]["reasoning_content"] = "I need the weather."
    sample, text = tokenized(FAMILY["qwen3"], row)
    assert trained_runs(FAMILY["qwen3"].build(), text, sample)[0] == "<think>\nI need the weather.\n</think>\n\n" + QWEN_CALL


def test_arguments_and_tools_given_as_json_text_or_objects_train_the_same():
    as_text = tool_row()
    as_objects = copy.deepcopy(as_text)
    as_objects["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    as_text["tools"] = json.dumps(as_text["tools"])
    flat = copy.deepcopy(as_objects)  # the flat form {name, arguments}, without `function`
    flat["messages"][1]["tool_calls"] = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    family = FAMILY["qwen2.5"]
    samples = [tokenized(family, row)[0] for row in (as_text, as_objects, flat)]
    assert samples[0] == samples[1] == samples[2]


@pytest.mark.parametrize("change,error", [
    (lambda r: r["messages"][0].update(tool_calls=[{"name": "f"}]),
     "t.jsonl:3: message 0 (user) has 'tool_calls'; only assistant messages carry tool_calls"),
    (lambda r: r["messages"][1].update(tool_calls={"name": "f"}), "'tool_calls' must be a list of calls, got dict"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{city: Paris}"),
     "message 1 (assistant): tool call 0 (get_weather): 'arguments' is a string that is not JSON"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="[1]"),
     "'arguments' must be an object (or a string holding one), got list"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].pop("name"), "tool call 0 needs a function name"),
    (lambda r: r["messages"][2].update(content={"temp_c": 18}), "message 2 (tool) needs a string 'content'"),
    (lambda r: r["messages"][0].update(name="Ann"), "message 0 (user) has 'name'; only tool messages carry name"),
    (lambda r: r.update(tools={"name": "f"}), "t.jsonl:3: 'tools' must be a list of function schemas"),
    (lambda r: r.update(tools="[{"), "t.jsonl:3: 'tools' is a string that is not JSON"),
])
def test_malformed_tool_data_is_a_bad_row_naming_it(change, error):
    row = tool_row()
    change(row)
    with pytest.raises(BadRow, match=re.escape(error)):
        to_example(RawRow(row, "t.jsonl:3"), "chat")


def test_tools_a_template_does_not_render_make_a_bad_row():
    row = {"tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello"}]}
    with pytest.raises(BadRow, match="t.jsonl:3: the chat template does not render the row's tools"):
        tokenized(FAMILY["smollm2"], row)
    sample, text = tokenized(FAMILY["qwen2.5"], row)
    assert "# Tools" in text and trained_runs(FAMILY["qwen2.5"].build(), text, sample) == ["Hello<|im_end|>"]


def test_unknown_message_fields_are_bad_rows_unless_ignored():
    row = tool_row()
    row["messages"][3].update(metadata={"source": "x"}, score=1)
    with pytest.raises(BadRow, match=re.escape(
            "t.jsonl:3: message 3 (assistant) has 'metadata', 'score', which finetune does not read, so the template "
            "would never see it; remove it, or list it in data.ignore_message_fields to leave it out")):
        to_example(RawRow(row, "t.jsonl:3"), "chat")
    ignored = to_example(RawRow(row, "t.jsonl:3"), "chat", fields=MessageFields(ignore=("metadata", "score")))
    assert ignored == to_example(RawRow(tool_row(), "t.jsonl:3"), "chat")
    # ignore_message_fields also lets the misnamed per-message flags through, left out.
    row["messages"][3] = {"role": "assistant", "content": ANSWER, "weight": 1}
    assert to_example(RawRow(row, "t.jsonl:3"), "chat", fields=MessageFields(ignore=("weight",))).messages[3] == \
        {"role": "assistant", "content": ANSWER}


def test_ignore_message_fields_reaches_the_data_from_the_recipe(tmp_path):
    data = tmp_path / "train.jsonl"
    row = {"messages": [{"role": "user", "content": "Q", "id": 1}, {"role": "assistant", "content": "A", "id": 2}]}
    data.write_text(json.dumps(row) + "\n")
    raw = tiny_recipe(tmp_path / "run", data)
    with pytest.raises(BadRow, match=re.escape(f"{data}:1: message 0 (user) has 'id', which finetune does not read")):
        build_samples(validate(raw), FAMILY["qwen2.5"].build())
    raw["data"]["ignore_message_fields"] = ["id"]
    (sample,), _, stats, _ = build_samples(validate(raw), FAMILY["qwen2.5"].build())
    assert stats.samples == 1 and stats.bad_rows_skipped == 0


@pytest.mark.parametrize("content", ["", "  \n", None])
def test_an_empty_trained_answer_is_a_bad_row(content):
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content}]}
    with pytest.raises(BadRow, match=re.escape("t.jsonl:3: message 1 (assistant) is empty" if content is not None
                                               else "t.jsonl:3: message 1 (assistant) needs a string 'content'")):
        to_example(RawRow(row, "t.jsonl:3"), "chat")
    if content is not None:  # kept as context, not trained: fine
        row["messages"][1]["train"] = False
        row["messages"].append({"role": "assistant", "content": "A"})
        assert to_example(RawRow(row, "t.jsonl:3"), "chat").trained == (False, False, True)
    alpaca = RawRow({"instruction": "Say hi", "output": content or ""}, "t.jsonl:4")
    with pytest.raises(BadRow, match="t.jsonl:4: empty 'output', so nothing to train on"):
        to_example(alpaca, "alpaca")


def test_preference_rows_with_tool_calls():
    row = tool_row()
    prompt, call = row["messages"][:1], row["messages"][1]
    other = copy.deepcopy(call)
    other["tool_calls"][0]["function"]["arguments"] = '{"city": "Lyon"}'
    pair = to_pair(RawRow({"tools": row["tools"], "prompt": prompt, "chosen": [call], "rejected": [other]},
                          "p.jsonl:1"))
    family = FAMILY["qwen2.5"]
    tokenizer = family.build()
    chosen, rejected = tokenize_pair(pair, tokenizer, family.kwargs)
    for side, city in ((chosen, "Paris"), (rejected, "Lyon")):
        text = render_chat(tokenizer, [*prompt, *pair.chosen] if city == "Paris" else [*prompt, *pair.rejected],
                           family.kwargs, tools=pair.tools)
        assert trained_runs(tokenizer, text, side) == [QWEN_CALL.replace("Paris", city)]
    bad = {"prompt": prompt, "chosen": [{**call, "extra": 1}], "rejected": [other]}
    with pytest.raises(BadRow, match=re.escape("p.jsonl:1: 'chosen': message 0 (assistant) has 'extra'")):
        to_pair(RawRow(bad, "p.jsonl:1"))


# How each family's trained text of a call starts (what the model generates after the generation prompt).
CALL_STARTS = {"qwen2.5": '<tool_call>\n{"name": "get_weather"', "qwen3": '<tool_call>\n{"name": "get_weather"',
               "qwen3-no-thinking": '<tool_call>\n{"name": "get_weather"', "llama3.1": '{"name": "get_weather"',
               "mistral-nemo": '[TOOL_CALLS][{"name": "get_weather"', "mistral-small-3.2": "[TOOL_CALLS]get_weather",
               "gpt-oss": " to=functions.get_weather<|channel|>commentary json<|message|>"}


def tool_conversation(rng: random.Random, rounds: int) -> dict:
    """Rounds of a user question, one or two calls each answered by the tool, and a final answer."""
    row: dict = {"tools": [WEATHER_TOOL], "messages": []}
    for r in range(rounds):
        row["messages"].append({"role": "user", "content": f"Round {r}?"})
        for c in range(rng.randint(1, 2)):
            call_id = f"c{r % 100:02d}{c}abcde"  # 9 characters, as Mistral requires
            row["messages"].append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": f"C{r}-{c}"}}}]})
            row["messages"].append({"role": "tool", "tool_call_id": call_id, "content": f"{r}{c} degrees"})
        row["messages"].append({"role": "assistant", "content": f"Answer {r}."})
    return row


@pytest.mark.parametrize("name", sorted(CALL_STARTS))
def test_random_tool_conversations_train_every_call_and_answer_whole(name):
    # Calls after the user's question, after a tool's answer, before and after the last user message (Mistral puts
    # the tools there, so earlier prefixes do not render as prefixes of the whole).
    rng = random.Random(f"tools-{name}")
    family = FAMILY[name]
    for _ in range(4):
        row = tool_conversation(rng, rng.randint(1, 3))
        sample, text = tokenized(family, row)
        runs = trained_runs(family.build(), text, sample)
        assistants = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(runs) == len(assistants), runs
        for run, m in zip(runs, assistants):
            if m.get("tool_calls"):
                city = m["tool_calls"][0]["function"]["arguments"]["city"]
                assert run.startswith(CALL_STARTS[name]) and city in run and "degrees" not in run, run
            else:
                assert m["content"] in run and not run.startswith("Round"), run


@pytest.mark.parametrize("name", ["qwen2.5", "mistral-nemo"])
def test_a_2000_message_tool_chat_tokenizes_in_linear_work(name):
    """10x the rounds is ~10x the work (measured 9.6x; helpers.profile_events counts calls, not seconds, so a busy
    machine cannot fail it; 2,000-2,500 messages take 1.5-3 s here)."""
    # Not gpt-oss: its template looks ahead over the rest of the conversation at every call, so each of the four
    # renderings is itself quadratic (2.5 s for 2,500 messages here).
    work, samples = [], []
    for rounds in (50, 500):  # 500: 2,000-2,500 messages
        row = tool_conversation(random.Random(0), rounds)
        work.append(profile_events(lambda r=row: samples.append(tokenized(FAMILY[name], r)[0])))
    assert work[1] / work[0] < 15, work
    assert sum(1 for label in samples[-1]["labels"] if label != IGNORE_INDEX) > 5000


def test_tool_rows_count_in_build_samples(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(tool_row()) + "\n" + json.dumps({**tool_row(), "tools": "nope"}) + "\n")
    raw = tiny_recipe(tmp_path / "run", data)
    raw["data"].update(on_bad_row="skip", max_seq_len=1024)  # Qwen's tools preamble is long
    (sample,), _, stats, _ = build_samples(validate(raw), FAMILY["qwen2.5"].build())
    assert stats.bad_rows_skipped == 1 and stats.bad_row_examples == [
        f"{data}:2: 'tools' is a string that is not JSON (Expecting value at column 1)"]
    assert stats.target_tokens == sum(1 for t in sample["labels"][1:] if t != IGNORE_INDEX) > 20
