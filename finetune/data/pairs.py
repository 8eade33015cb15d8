"""Preference rows -> pairs of tokenized conversations sharing a prompt (format: preference, TRL's layout).

A row is `prompt` (a string, or a list of chat messages) with `chosen` and `rejected` (a string, or a list of
assistant messages), or the implicit-prompt form: `chosen` and `rejected` are two whole conversations, and the
prompt is their longest common prefix of messages. Each side is rendered with the chat template as one
conversation (prompt + completion), and only the completion's assistant turns are scored, by the same masking
as SFT data (finetune/data/tokenize.py). Messages are read as chat rows' are (messages.py: reasoning, tool calls,
tool messages; any other field is a bad row), and a row's `tools` are passed to the template for both sides.

A pair is one sample of two documents (chosen, then rejected), {"input_ids", "labels", "docs": [n_chosen,
n_rejected]}, and it stays whole: it is never split across rows, micro-batches or ranks, and data.max_seq_len
bounds the pair (both sequences together), so a packed row always holds whole pairs and packing on or off
scores the same tokens. Too long a pair loses tokens from the end of its longer completion first
(data.truncation: truncate), never its prompt, or is dropped (drop); a pair left without a scored token on
either side is dropped.

Where a completion ends (dpo.completion_end, orpo.completion_end; docs/preference.md, "The completion
boundary"): `marker`, its assistant turns as SFT masks them (each turn's content and end-of-turn marker), or
`template`, every token from its first scored one to the end of the rendering (with ChatML also the newline the
template writes after `<|im_end|>`), which is TRL's DPOTrainer's completion; `template+eos` (ORPO's `template`)
then appends the tokenizer's eos when the rendering does not end with it, as TRL's ORPOTrainer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from finetune.data.formats import ROLES, Example, MessageFields
from finetune.data.messages import chat_message, row_images, row_tools
from finetune.data.sources import BadRow, RawRow
from finetune.data.tokenize import tokenize_example
from finetune.labels import IGNORE_INDEX
from finetune.recipe import Recipe

Messages = tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class PairExample:
    """A preference row as messages: the shared prompt and the two completions."""

    origin: str
    prompt: Messages
    chosen: Messages
    rejected: Messages
    tools: tuple[dict[str, Any], ...] | None = None
    """The row's `tools` (function schemas), passed to the chat template for both sides."""
    margin: float | None = None
    """The row's `margin` (TRL's field): by how much a reward model's chosen score should exceed the rejected one's."""

    def side(self, completion: Messages) -> Example:
        """One side as a chat example whose scored turns are the completion's assistant turns."""
        trained = (False,) * len(self.prompt) + tuple(m["role"] == "assistant" for m in completion)
        return Example(self.origin, messages=self.prompt + completion, trained=trained, tools=self.tools)


@dataclass(frozen=True)
class PairFields:
    """Where a preference row keeps its parts (datasets[].prompt_field, chosen_field, rejected_field) and its
    messages' role and text (role_field, content_field, role_map)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    messages: MessageFields = MessageFields()


def to_pair(row: RawRow, fields: PairFields = PairFields()) -> PairExample:
    """Convert one preference row; BadRow naming the row's origin when it does not fit the format."""
    if row.error:
        raise BadRow(f"{row.origin}: {row.error}")
    data, f = row.data, fields
    row_images(row.origin, data, f.messages, "preference")  # images in the row: a bad row, never dropped unseen
    for key in (f.chosen, f.rejected):
        if key not in data:
            raise BadRow(f"{row.origin}: preference rows need {f.chosen!r} and {f.rejected!r} (fields present: "
                         f"{', '.join(sorted(data)) or 'none'})")
    if f.prompt in data:
        prompt = _messages(row.origin, f.prompt, data[f.prompt], "user", f.messages)
        if prompt and prompt[-1]["role"] == "assistant":
            raise BadRow(f"{row.origin}: the prompt ends with an assistant message; the completions answer it")
        chosen = _messages(row.origin, f.chosen, data[f.chosen], "assistant", f.messages)
        rejected = _messages(row.origin, f.rejected, data[f.rejected], "assistant", f.messages)
    else:
        prompt, chosen, rejected = _implicit_prompt(row.origin, data[f.chosen], data[f.rejected], fields)
    for name, completion in ((f.chosen, chosen), (f.rejected, rejected)):
        if not completion or completion[0]["role"] != "assistant":
            raise BadRow(f"{row.origin}: '{name}' must start with an assistant message")
    if chosen == rejected:
        raise BadRow(f"{row.origin}: {f.chosen!r} and {f.rejected!r} are the same; a pair must differ")
    prompt = _with_system(row.origin, data, f.messages.system, prompt)
    return PairExample(row.origin, prompt, chosen, rejected, row_tools(row.origin, data), _margin(row.origin, data))


def _with_system(origin: str, data: dict[str, Any], field: str | None, prompt: Messages) -> Messages:
    """The prompt with the row's `field` (datasets[].system_field) as a leading system message, when the field holds
    text and the prompt has no system message (Axolotl's bradley_terry rows: system, input, chosen, rejected)."""
    system = data.get(field) if field else None
    if system is None or (prompt and prompt[0]["role"] == "system"):
        return prompt
    if not isinstance(system, str):
        raise BadRow(f"{origin}: field {field!r} (the system message) must be a string")
    return (({"role": "system", "content": system},) if system else ()) + prompt


def _margin(origin: str, data: dict[str, Any]) -> float | None:
    """The row's `margin`: a finite number, or null/absent (None)."""
    value = data.get("margin")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRow(f"{origin}: 'margin' must be a finite number (a reward model's margin for the pair), got "
                     f"{value!r}")
    return float(value)


def _messages(origin: str, key: str, value: Any, default_role: str, fields: MessageFields) -> Messages:
    if isinstance(value, str):
        return ({"role": default_role, "content": value},)
    if not isinstance(value, list) or not value:
        raise BadRow(f"{origin}: '{key}' must be a string or a non-empty list of messages, got "
                     f"{type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        role = fields.role_of(m.get(fields.role)) if isinstance(m, dict) else None
        content = m.get(fields.content) if isinstance(m, dict) else None
        if role not in ROLES or not (isinstance(content, str) or (content is None and m.get("tool_calls"))):
            raise BadRow(f"{origin}: '{key}' message {i} needs a role ({', '.join(ROLES)}) and a string content "
                         f"(fields {fields.role!r}, {fields.content!r})")
        out.append(chat_message(f"{origin}: '{key}'", i, m, fields))  # other fields as in chat rows
    return tuple(out)


def _implicit_prompt(origin: str, chosen: Any, rejected: Any,
                     fields: PairFields) -> tuple[Messages, Messages, Messages]:
    """The longest common prefix of two conversations, taken as their prompt (messages compared whole)."""
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        raise BadRow(f"{origin}: without {fields.prompt!r}, {fields.chosen!r} and {fields.rejected!r} must be whole "
                     f"conversations (lists of messages) sharing their prompt; for plain strings, give {fields.prompt!r}")
    c = _messages(origin, fields.chosen, chosen, "assistant", fields.messages)
    r = _messages(origin, fields.rejected, rejected, "assistant", fields.messages)
    shared = 0
    while shared < min(len(c), len(r)) and c[shared] == r[shared]:
        shared += 1
    while shared and c[shared - 1]["role"] == "assistant":  # the prompt ends before an assistant turn
        shared -= 1
    if not shared:
        raise BadRow(f"{origin}: 'chosen' and 'rejected' share no prompt (their first messages differ)")
    return c[:shared], c[shared:], r[shared:]


COMPLETION_ENDS = ("marker", "template", "template+eos")


def completion_end(recipe: Recipe) -> str:
    """The completion boundary of the recipe's pairs (one of COMPLETION_ENDS): its objective's completion_end,
    ORPO's `template` being TRL's ORPOTrainer's (the rendering, then an eos)."""
    if recipe.train.objective == "dpo":
        return recipe.dpo.completion_end
    if recipe.train.objective == "orpo" and recipe.orpo.completion_end == "template":
        return "template+eos"
    return "marker"


def tokenize_pair(pair: PairExample, tokenizer: Any, template_kwargs: Any = None, notes: Any = None,
                  end: str = "marker") -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Each side as one tokenized conversation, its completion scored up to `end` (COMPLETION_ENDS)."""
    sides = (tokenize_example(pair.side(pair.chosen), tokenizer, template_kwargs, notes),
             tokenize_example(pair.side(pair.rejected), tokenizer, template_kwargs, notes))
    if end == "marker":
        return sides
    eos = tokenizer.eos_token_id if end == "template+eos" else None
    return _to_rendering_end(sides[0], eos), _to_rendering_end(sides[1], eos)


def _to_rendering_end(side: dict[str, list[int]], eos: int | None) -> dict[str, list[int]]:
    """Every token from the first scored one to the end scored (the template's text after the last end-of-turn
    marker too), and `eos` appended when given and the rendering does not end with it. A side with nothing scored
    is left as it is (fit_pair drops it)."""
    ids, labels = list(side["input_ids"]), side["labels"]
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
    if first is None:
        return side
    if eos is not None and ids[-1] != eos:
        ids.append(eos)
    return {"input_ids": ids, "labels": labels[:first] + ids[first:]}


def pair_sample(chosen: dict[str, list[int]], rejected: dict[str, list[int]]) -> dict:
    """The sample of a pair: one unit of two documents, chosen then rejected."""
    return {"input_ids": chosen["input_ids"] + rejected["input_ids"], "labels": chosen["labels"] + rejected["labels"],
            "docs": [len(chosen["input_ids"]), len(rejected["input_ids"])]}


def fit_pair(chosen: dict[str, list[int]], rejected: dict[str, list[int]],
             max_seq_len: int | None) -> tuple[dict[str, list[int]], dict[str, list[int]], int] | None:
    """(chosen, rejected, tokens cut) within max_seq_len together, cut from the end of the longer completion
    first and never into a prompt nor a side's last scored token; None when they cannot fit so."""
    lengths = [len(chosen["input_ids"]), len(rejected["input_ids"])]
    keep = [_last_kept(side) for side in (chosen, rejected)]
    if None in keep:
        return None  # a side with nothing scored (truncated away by the template, or empty)
    excess = sum(lengths) - max_seq_len if max_seq_len else 0
    cut = 0
    while excess > 0:
        side = 0 if lengths[0] - keep[0] >= lengths[1] - keep[1] else 1
        if lengths[side] <= keep[side]:
            return None
        lengths[side] -= 1
        excess, cut = excess - 1, cut + 1
    sides = [{k: v[:n] for k, v in s.items()} for s, n in zip((chosen, rejected), lengths)]
    return sides[0], sides[1], cut


def _last_kept(side: dict[str, list[int]]) -> int | None:
    """The fewest tokens a side can keep: up to and including its first scored token."""
    labels = side["labels"]
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
    return None if first is None else first + 1


def unfit_reason(chosen: dict[str, list[int]], rejected: dict[str, list[int]], max_seq_len: int | None,
                 truncation: str) -> str:
    """Why fit_pair (or data.truncation: drop) leaves a pair out, in words for the data report."""
    n = len(chosen["input_ids"]) + len(rejected["input_ids"])
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if _last_kept(side) is None:
            return f"pair of {n} tokens: its {name} side has no scored token"
    if truncation == "drop":
        return f"pair of {n} tokens, over data.max_seq_len {max_seq_len} (data.truncation: drop)"
    return (f"pair of {n} tokens, over data.max_seq_len {max_seq_len} even with both completions cut to their "
            "first scored token")
