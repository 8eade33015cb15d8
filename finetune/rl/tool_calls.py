"""The tool calls in a policy turn's sampled text (multi-turn RL: docs/rl.md, "Tools and environments").

Parsed with transformers' own facility, `tokenizer.parse_response` and a response template (its declarative format):
the tokenizer's own `response_template` where it ships one, else the one of the tool-call format the chat template
writes, found from the template's text (or named by grpo.tool_call_format):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more, after optional text (Qwen2.5,
  Qwen3, SmolLM3, Hermes, and ChatML templates written for tools);
- llama3: `{"name": ..., "parameters": {...}}` closed by `<|eot_id|>` (Llama 3.1, 3.2, 3.3);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]` (Mistral Nemo and the v3 tokenizers);
- mistral_v7: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call (Mistral Small 3.1 and 3.2, Magistral);
- harmony: OpenAI's harmony messages (gpt-oss; transformers ships no response template for it): the analysis channel
  (`<|channel|>analysis<|message|>...<|end|>`) is the reasoning, the final channel
  (`<|channel|>final<|message|>...<|return|>`) the content, and a message to `functions.NAME` a call, its recipient
  in the header (`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`, as the
  template writes it) or after the channel (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`).
  Other messages (a commentary preamble) and the headers are dropped; a final answer beside a call too (the template
  writes a call's content as its analysis, and refuses both). One call a turn: gpt-oss's generation config ends the
  sampling at `<|call|>`, and the template renders one call a message. A turn holding `<|call|>` but no call that
  parses (malformed JSON, a recipient other than `functions.`, such as the built-in `python`) is counted unparsed.

A turn whose call does not parse (malformed JSON, no name) is a plain-text turn that ends the episode: counted, not
an error (what a policy learns from its reward). Only the sampled text is parsed, never the prompt before it, so a
call in the conversation's history is never taken for a new one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from finetune.errors import UserError

Format = Literal["auto", "tokenizer", "hermes", "llama3", "mistral", "mistral_v7", "harmony"]

# The end-of-turn markers a turn's text may end with (the sampled end token is part of the text).
_ENDS = r"(?:<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>|<\|eom_id\|>|</s>|<end_of_turn>|<\|end\|>)"
# start_anchor is required by the format; it never matches the empty prefix given, so the whole text is parsed.
_ANCHOR = r"\A\b\B"

# harmony (gpt-oss): a message ends at its end marker, or where the next header starts; a call is a message to
# functions.NAME, the recipient in the header before the channel or after it, then the content type (` json`,
# ` <|constrain|>json`, or none) up to <|message|>.
_HARMONY_END = r"\s*(?:<\|end\|>|<\|return\|>|<\|call\|>|(?=<\|start\|>|<\|channel\|>))"
_HARMONY_TO = r"to=functions\.(?P<name>[^\s<]+)"
_HARMONY_CALL = (rf"(?:{_HARMONY_TO}\s*<\|channel\|>\w+|<\|channel\|>\w+\s+{_HARMONY_TO})"
                 r"[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>")

TEMPLATES: dict[str, dict[str, Any]] = {
    "hermes": {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": _ANCHOR,
        "fields": {
            "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
            "tool_calls": {"open_pattern": r"\s*<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                           "content": "json", "transform": {"type": "function", "function": "{content}"}},
            "content": {"close_pattern": rf"\s*{_ENDS}", "content": "text"},
        },
    },
    "llama3": {  # TRL 1.16's llama3 template (trl/chat_template_utils.py)
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": _ANCHOR,
        "fields": {
            "tool_calls": {"open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
                           "close_pattern": rf"\}}\s*{_ENDS}\s*", "repeats": True, "content": "json",
                           "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
            "content": {"close_pattern": rf"\s*{_ENDS}", "content": "text"},
        },
    },
    "mistral": {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": _ANCHOR,
        "fields": {
            "tool_calls": {"open": "[TOOL_CALLS]", "close_pattern": rf"\s*{_ENDS}", "content": "json",
                           "transform": {"type": "function", "id": "{id}", "function": {
                               "name": "{name}", "arguments": "{arguments}"}}, "transform_each": True},
            "content": {"close_pattern": rf"\s*{_ENDS}", "content": "text"},
        },
    },
    "mistral_v7": {  # [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, one per call (Mistral Small 3.1/3.2, Magistral)
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": _ANCHOR,
        "fields": {
            "tool_calls": {"open_pattern": r"\[TOOL_CALLS\](?P<name>[^\[\]]+)\[CALL_ID\](?P<id>[^\[\]]+)\[ARGS\]",
                           "close_pattern": rf"(?=\[TOOL_CALLS\])|\s*{_ENDS}", "repeats": True, "content": "json",
                           "transform": {"type": "function", "id": "{id}",
                                         "function": {"name": "{name}", "arguments": "{content}"}}},
            "content": {"close_pattern": rf"\s*{_ENDS}", "content": "text"},
        },
    },
    "harmony": {  # the turn follows the generation prompt `<|start|>assistant`; no implicit field: headers and
        # messages to other recipients are dropped. A message's text ends at its end marker or at the next header.
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": _ANCHOR,
        "fields": {
            "reasoning_content": {"open": "<|channel|>analysis<|message|>", "close_pattern": _HARMONY_END,
                                  "repeats": True, "join": "\n", "content": "text"},
            "tool_calls": {"open_pattern": _HARMONY_CALL, "close_pattern": _HARMONY_END, "repeats": True,
                           "content": "json", "transform": {"type": "function", "function": {
                               "name": "{name}", "arguments": "{content}"}}},
            "content": {"open": "<|channel|>final<|message|>", "close_pattern": _HARMONY_END, "repeats": True,
                        "join": "\n", "content": "text"},
        },
    },
}
# What in a chat template's text says which format it writes (the first that matches).
_MARKERS = (("<tool_call>", "hermes"), ("[ARGS]", "mistral_v7"), ("[TOOL_CALLS]", "mistral"),
            ("<|channel|>", "harmony"), ('"parameters"', "llama3"))
# Where a call starts in the sampled text, per format: a turn holding one that does not parse is counted.
_OPENS = {"hermes": "<tool_call>", "llama3": '{"name"', "mistral": "[TOOL_CALLS]", "mistral_v7": "[TOOL_CALLS]",
          "harmony": "<|call|>"}


@dataclass
class Parsed:
    """A policy turn as a message for the template, its calls, and whether it tried a call that did not parse."""

    message: dict[str, Any]
    calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False


@dataclass(frozen=True)
class CallParser:
    """Parses a policy turn's text with one response template."""

    tokenizer: Any
    template: dict[str, Any]
    fmt: str
    tools: tuple[Mapping[str, Any], ...] = ()

    def parse(self, text: str) -> Parsed:
        """The turn as an assistant message (its content, reasoning and tool calls); a call that does not parse
        leaves the turn plain text, `malformed`."""
        try:
            message = self.tokenizer.parse_response(text, self.template, prefix="",
                                                    tools=[dict(t) for t in self.tools] or None)
        except (ValueError, KeyError, TypeError):
            return Parsed({"role": "assistant", "content": text}, [], True)
        calls = message.get("tool_calls") or []
        if not all(_well_formed(c) for c in calls):
            return Parsed({"role": "assistant", "content": text}, [], True)
        message.setdefault("content", "")
        if calls and self.fmt == "harmony":  # a final answer ends a harmony turn: none beside a call (the template
            message["content"] = ""         # writes a call's content as its analysis, and refuses both)
        opened = _OPENS.get(self.fmt)
        return Parsed(message, calls, malformed=bool(not calls and opened and opened in text))


def _well_formed(call: Any) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), dict)


def call_parser(tokenizer: Any, fmt: Format, tools: Sequence[Mapping[str, Any]]) -> CallParser:
    """The parser of the policy's tool calls: `fmt` (grpo.tool_call_format), or with "auto" the tokenizer's own
    response_template, else the format the chat template writes. A UserError when none is known."""
    if fmt in ("auto", "tokenizer") and getattr(tokenizer, "response_template", None) is not None:
        return CallParser(tokenizer, tokenizer.response_template, "tokenizer", tuple(tools))
    if fmt == "tokenizer":
        raise UserError("grpo.tool_call_format: tokenizer, and the tokenizer has no response_template")
    if fmt == "auto":
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        fmt = next((name for marker, name in _MARKERS if marker in template), None)  # type: ignore[assignment]
        if fmt is None:
            raise UserError("grpo.tools: the chat template writes tool calls in no format finetune knows (hermes "
                            "<tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], gpt-oss harmony), and the tokenizer has "
                            "no response_template: set grpo.tool_call_format, or tokenizer.chat_template to a template "
                            "that renders tools")
    return CallParser(tokenizer, TEMPLATES[fmt], fmt, tuple(tools))
