"""A conversation continued turn by turn in tokens (multi-turn RL: docs/rl.md, "Multi-turn rollouts").

The policy's turns are the ids it sampled, kept verbatim: never decoded and encoded again. What the environment adds
after a policy turn (tool messages, the next assistant header) is what the chat template writes for it: the rendering
of the conversation with the new messages and the generation prompt, from the end of the policy's turn on. That text
is tokenized alone and appended as ids.

Where the new rendering still begins with the text of the ids so far, the template preserves the prefix at this
turn, and the environment's text is what follows it: the ids are then those apply_chat_template gives the whole
conversation (tests/chat/test_continuation.py checks it on every tested family that renders tool messages). A
template that rewrites earlier turns when one is added (Qwen3 drops earlier reasoning) does not, and `rewrites` says
what then: "refuse" stops, naming the turn; "keep" (the default) keeps the policy's ids as sampled and appends the
environment's turn as the template renders it after the policy's last turn, located by the chat engine (the end of
that turn's end-of-turn marker in the new rendering, chat/spans.py), never guessed. "keep" trains the policy on the
very tokens it saw and sampled, which is what on-policy RL needs; the template's rewrite only concerns how a later
conversation is shown to the model at inference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from finetune.chat.spans import chat_layout, render_chat
from finetune.errors import UserError

Rewrites = Literal["keep", "refuse"]


class TemplateRewrites(UserError):
    """The template rewrote an earlier turn when the environment's turn was added, and `rewrites` is "refuse"."""


@dataclass
class Continuation:
    """What the environment's turn adds: its text, its ids, and whether the template kept the earlier turns as
    they were (False: it rewrote them, and the ids follow the policy's instead)."""

    text: str
    ids: list[int]
    prefix_kept: bool
    message: dict[str, Any] | None = None
    """The message the policy's turn was rendered as (the parsed one, or an alternative)."""


def environment_turn(tokenizer: Any, messages: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]],
                     so_far: str, *, template_kwargs: Mapping[str, Any] | None = None,
                     tools: Sequence[Mapping[str, Any]] | None = None, rewrites: Rewrites = "keep",
                     turn: int = 1, alternatives: Sequence[Mapping[str, Any]] = ()) -> Continuation:
    """The ids the environment's turn adds after the policy's last turn.

    `messages`: the conversation so far, ending with the policy's last turn as a message (its content and tool
    calls, parsed from what it sampled); `new`: the environment's messages (tool results); `so_far`: the text of
    the ids so far (the prompt's rendering, then each turn's); `turn`: the policy turn just ended, for messages;
    `alternatives`: other messages that turn may be written as (its raw text, for a template that renders no tool
    calls), tried in order when the first does not render as sampled. `Continuation.message` is the one used."""
    for last in [messages[-1], *alternatives]:
        try:
            after = render_chat(tokenizer, [*messages[:-1], last, *new], template_kwargs, add_generation_prompt=True,
                                tools=tools)
        except Exception:  # noqa: BLE001 - a template may refuse an alternative (gpt-oss: channel tags as content)
            if last is messages[-1]:
                raise
            continue
        if after.startswith(so_far):
            text = after[len(so_far):]
            return Continuation(text, _ids(tokenizer, text), True, dict(last))
    if rewrites == "refuse":
        raise TemplateRewrites(
            f"the chat template rewrites the conversation when the environment's turn after policy turn {turn} is "
            "added (the new rendering does not begin with the text of the tokens so far; Qwen3's template drops "
            "earlier reasoning, for one): set grpo.template_rewrites: keep to train the tokens the policy saw")
    after = render_chat(tokenizer, [*messages, *new], template_kwargs, add_generation_prompt=True, tools=tools)
    end = _last_turn_end(tokenizer, [*messages, *new], len(messages) - 1, template_kwargs, tools)
    text = after[end:]
    return Continuation(text, _ids(tokenizer, text), False, dict(messages[-1]))


def _last_turn_end(tokenizer: Any, conversation: list[Mapping[str, Any]], index: int,
                   template_kwargs: Mapping[str, Any] | None, tools: Sequence[Mapping[str, Any]] | None) -> int:
    """Where the assistant turn `index` ends (after its end-of-turn marker) in the rendering of `conversation`."""
    layout = chat_layout(tokenizer, conversation, [index], template_kwargs, tools)
    if not layout.turns:
        raise UserError(f"the chat template does not render the assistant's turn {index} of the conversation, so "
                        "the environment's turn after it cannot be found")
    return layout.turns[0].end


def _ids(tokenizer: Any, text: str) -> list[int]:
    """The text's ids, tokenized alone and without added special tokens (the template writes those)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
