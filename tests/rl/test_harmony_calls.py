"""gpt-oss's tool calls in multi-turn rollouts (finetune/rl/tool_calls.py, the `harmony` response template): each shape
of a harmony turn parsed (the recipient in the header or after the channel, `json` or `<|constrain|>json`, with and
without an analysis message, a final answer), a call that does not parse counted, the format found from gpt-oss's
chat template, and scripted tool conversations whose policy turns are harmony text, parsed and rendered back by the
template (tests/chat_families.py FAMILY["gpt-oss"], the official template on a stand-in vocabulary)."""

from __future__ import annotations

import json

import pytest
from chat_families import FAMILY

from finetune.chat.spans import render_chat
from finetune.recipe import GRPOConfig, Recipe
from finetune.rl.episodes import Episodes
from finetune.rl.prompts import Prompt
from finetune.rl.tool_calls import TEMPLATES, call_parser
from finetune.rl.tools import tool_of

GPT_OSS = FAMILY["gpt-oss"]
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]
THINK = "<|channel|>analysis<|message|>I should multiply.<|end|><|start|>assistant"
ANSWER = "<|channel|>final<|message|>The answer is 42.<|return|>"
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: the first
        b: the second
    """
    return a * b


def header_call(name: str = "multiply", args: str = '{"a": 6, "b": 7}', kind: str = " json") -> str:
    """A call as the template writes it: the recipient in the header (after the generation prompt's
    `<|start|>assistant`)."""
    return f" to=functions.{name}<|channel|>commentary{kind}<|message|>{args}<|call|>"


def channel_call(name: str = "multiply", args: str = '{"a": 6, "b": 7}') -> str:
    """A call with its recipient after the channel, as harmony also allows."""
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"


@pytest.fixture(scope="module")
def parser():
    tokenizer = GPT_OSS.build()
    return call_parser(tokenizer, "auto", [tool_of(multiply, "t").schema])


def test_gpt_oss_is_found_from_its_chat_template(parser):
    assert parser.fmt == "harmony" and parser.template is TEMPLATES["harmony"]
    assert call_parser(GPT_OSS.build(), "harmony", []).fmt == "harmony"


@pytest.mark.parametrize("text", [header_call(), header_call(kind=" <|constrain|>json"), header_call(kind=""),
                                  channel_call(), THINK + header_call(), THINK + channel_call()])
def test_each_shape_of_a_harmony_call_parses(parser, text):
    parsed = parser.parse(text)
    assert parsed.calls == [CALL] and parsed.message["tool_calls"] == [CALL] and not parsed.malformed
    assert parsed.message["content"] == ""
    assert parsed.message.get("reasoning_content") == ("I should multiply." if text.startswith(THINK) else None)


@pytest.mark.parametrize(("text", "reasoning"), [
    (ANSWER, None), (THINK + ANSWER, "I should multiply."),
    (THINK + ANSWER.replace("<|return|>", "<|end|>"), "I should multiply."),
    (THINK + ANSWER.replace("<|return|>", ""), "I should multiply."),  # cut by the token budget
])
def test_a_final_answer_is_the_content_and_the_analysis_the_reasoning(parser, text, reasoning):
    parsed = parser.parse(text)
    assert parsed.calls == [] and not parsed.malformed
    assert parsed.message["content"] == "The answer is 42." and parsed.message.get("reasoning_content") == reasoning


@pytest.mark.parametrize("text", [
    header_call(args='{"a": 6, "b": '),  # malformed JSON
    THINK + channel_call(args='{"a": 6 "b": 7}'),
    header_call(args="[6, 7]"),  # arguments that are no object
    header_call(args='{"a": 6, "b": 7}').removesuffix("<|call|>")[:-3],  # cut by the token budget
    " to=python<|channel|>analysis code<|message|>print(6 * 7)<|call|>",  # the built-in python tool, not a function
])
def test_a_call_that_does_not_parse_is_a_plain_turn_counted(parser, text):
    parsed = parser.parse(text)
    assert parsed.calls == [] and parsed.malformed and "tool_calls" not in parsed.message


def test_other_messages_and_headers_are_not_content(parser):
    preamble = "<|channel|>commentary<|message|>Let me compute.<|end|><|start|>assistant"
    parsed = parser.parse(THINK + preamble + header_call())
    assert parsed.calls == [CALL] and parsed.message == {"role": "assistant", "reasoning_content": "I should multiply.",
                                                         "tool_calls": [CALL], "content": ""}
    # a message left open ends where the next header starts
    unclosed = "<|channel|>analysis<|message|>I should multiply.<|start|>assistant"
    parsed = parser.parse(unclosed + header_call())
    assert parsed.calls == [CALL] and parsed.message["reasoning_content"] == "I should multiply."


def test_a_final_answer_beside_a_call_is_dropped_as_the_template_refuses_both(parser):
    parsed = parser.parse(THINK + ANSWER.replace("<|return|>", "<|end|><|start|>assistant") + header_call())
    assert parsed.calls == [CALL] and parsed.message["content"] == ""
    assert parsed.message["reasoning_content"] == "I should multiply."


class Scripted:
    """A policy that writes `script(text so far)`, harmony text with its own end token (`<|call|>`, `<|return|>`)."""

    def __init__(self, tokenizer, script) -> None:
        self.tokenizer, self.script = tokenizer, script

    def generate(self, prompts, greedy=False, stop=lambda: False, max_new_tokens=None):
        return [self.tokenizer(self.script(self.tokenizer.decode(ids)), add_special_tokens=False)["input_ids"]
                [:max_new_tokens] for ids in prompts]


def calls_then_answers(call: str, think: str = THINK, rounds: int = 1):
    """Calls `rounds` times (after an analysis message), then answers with the last tool result it saw."""
    def script(text: str) -> str:
        seen = text.count(" to=assistant<|channel|>commentary<|message|>")
        if seen < rounds:
            return think + call
        result = json.loads(text.rsplit("to=assistant<|channel|>commentary<|message|>", 1)[1].split("<|end|>")[0])
        return think + f"<|channel|>final<|message|>The answer is {result}.<|return|>"
    return script


def episodes(script, **grpo):
    tokenizer = GPT_OSS.build()
    tools = [tool_of(multiply, "t")]
    recipe = Recipe(grpo=GRPOConfig(**{"max_new_tokens": 512, **grpo}))
    ends = set(tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"]))  # gpt-oss's generation config's
    run = Episodes(Scripted(tokenizer, script), tokenizer, recipe, tools, None,
                   call_parser(tokenizer, "auto", [t.schema for t in tools]), ends)
    prompt = Prompt(QUESTION, [], {}, "p.jsonl:1", [dict(m) for m in QUESTION])
    return tokenizer, tools, run, run.run([prompt, prompt], False, lambda: False)


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_harmony_tool_conversation_renders_back_as_sampled(rounds):
    """The template writes a call's analysis while no final answer follows it, so the environment's turn follows
    the sampled text exactly: the ids are those of the whole conversation rendered."""
    tokenizer, tools, run, made = episodes(calls_then_answers(header_call(), rounds=rounds))
    e = made[0]
    assert (e.turns, e.calls, e.malformed, e.rewritten) == (rounds + 1, rounds, False, False)
    assert tokenizer.decode(e.completion).endswith(THINK + ANSWER)
    env = tokenizer.decode([t for t, m in zip(e.completion, e.env_mask) if not m])
    assert env == rounds * '<|start|>functions.multiply to=assistant<|channel|>commentary<|message|>"42"<|end|>' \
                           "<|start|>assistant"
    assert e.messages[1] == {"role": "assistant", "reasoning_content": "I should multiply.", "tool_calls": [CALL],
                             "content": ""}
    assert e.messages[2] == {"role": "tool", "name": "multiply", "content": "42"}
    assert e.completion_messages[-1] == {"role": "assistant", "reasoning_content": "I should multiply.",
                                         "content": "The answer is 42."}
    sampled = tokenizer.decode(e.prompt_ids + e.completion)
    history = e.messages[:-1]  # the template drops the calls' analysis once a final answer follows: the prefix
    assert render_chat(tokenizer, history, None, add_generation_prompt=True, tools=[t.schema for t in tools]) == \
        sampled.removesuffix(THINK + ANSWER)
    assert run.counts.calls == 2 * rounds and run.counts.errors == 0


# finetune/chat/continuation.py tries the turn's raw text as an alternative message, which gpt-oss's template
# refuses (channel tags in content; a tool message after no call): that try is skipped, not raised.
@pytest.mark.parametrize("call", [channel_call(), header_call(kind=" <|constrain|>json")])
@pytest.mark.parametrize("think", [THINK, ""])
def test_a_call_the_template_writes_otherwise_keeps_the_sampled_ids(call, think):
    """A call written otherwise than the template writes it (recipient after the channel, <|constrain|>): the
    template rewrites the policy's turn, and template_rewrites: keep trains the ids as sampled."""
    tokenizer, tools, run, made = episodes(calls_then_answers(call, think=think))
    e = made[0]
    assert (e.turns, e.calls, e.malformed, e.rewritten) == (2, 1, False, True)
    sampled = [t for t, m in zip(e.completion, e.env_mask) if m]
    assert tokenizer.decode(sampled) == think + call + think + "<|channel|>final<|message|>The answer is 42.<|return|>"
    env = tokenizer.decode([t for t, m in zip(e.completion, e.env_mask) if not m])
    assert env == '<|start|>functions.multiply to=assistant<|channel|>commentary<|message|>"42"<|end|>' \
                  "<|start|>assistant"


def test_a_turn_that_does_not_parse_ends_the_episode_and_is_counted():
    tokenizer, tools, run, made = episodes(lambda text: THINK + header_call(args='{"a": 6'))
    e = made[0]
    assert e.done and e.turns == 1 and e.malformed and e.calls == 0 and 0 not in e.env_mask
