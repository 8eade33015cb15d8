"""Turn raw rows into examples: a list of chat messages (alpaca, chat) or a plain text (completion).

Every check names the row's origin (file:line). Nothing here knows about tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.data.sources import BadRow, RawRow

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    """A training example: `messages` (chat-like formats) or `text` (completion), plus where it came from."""

    origin: str
    messages: tuple[dict[str, str], ...] = ()
    text: str | None = None
    train_on_inputs: bool = False


def to_example(row: RawRow, fmt: str, *, messages_field: str = "messages", text_field: str = "text",
               train_on_inputs: bool = False) -> Example:
    """Convert one raw row; raise BadRow (a UserError) naming the row's origin when it does not fit the format."""
    if row.error:
        raise BadRow(f"{row.origin}: {row.error}")
    if fmt == "chat":
        messages = _chat_messages(row, messages_field)
    elif fmt == "alpaca":
        messages = _alpaca_messages(row)
    elif fmt == "completion":
        text = row.data.get(text_field)
        if not isinstance(text, str) or not text:
            raise BadRow(f"{row.origin}: completion rows need a non-empty string field {text_field!r}"
                         f"{_fields_hint(row.data)}")
        return Example(row.origin, text=text, train_on_inputs=True)
    else:
        raise ValueError(f"unknown format {fmt!r}")  # the schema only admits the three above
    return Example(row.origin, messages=messages, train_on_inputs=train_on_inputs)


def _chat_messages(row: RawRow, field: str) -> tuple[dict[str, str], ...]:
    raw = row.data.get(field)
    if raw is None:
        raise BadRow(f"{row.origin}: missing field {field!r}{_fields_hint(row.data)}")
    if not isinstance(raw, list):
        raise BadRow(f"{row.origin}: {field!r} must be a list of {{role, content}}, got {type(raw).__name__}")
    if not raw:
        raise BadRow(f"{row.origin}: empty conversation")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRow(f"{row.origin}: message {i} is not an object")
        role, content = message.get("role"), message.get("content")
        if role is None and "from" in message and "value" in message:
            # The most common mix-up: ShareGPT rows ({from: human|gpt, value}) read as chat.
            raise BadRow(f"{row.origin}: message {i} looks like ShareGPT ({{from, value}}); chat rows need "
                         "{role: system|user|assistant, content}. Convert the data first.")
        if role not in ROLES:
            raise BadRow(f"{row.origin}: message {i} has unknown role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise BadRow(f"{row.origin}: message {i} ({role}) needs a string 'content'")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"{row.origin}: no assistant turn, so nothing to train on")
    return tuple(messages)


def _alpaca_messages(row: RawRow) -> tuple[dict[str, str], ...]:
    data = row.data
    for key in ("instruction", "output"):
        if not isinstance(data.get(key), str):
            raise BadRow(f"{row.origin}: alpaca rows need a string {key!r}{_fields_hint(data)}")
    prompt = data["instruction"]
    extra = data.get("input")
    if extra is not None and not isinstance(extra, str):  # e.g. a list: silently dropping it would mis-train
        raise BadRow(f"{row.origin}: alpaca 'input' must be a string (or absent), got {type(extra).__name__}")
    if extra and extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": data["output"]}]
    if isinstance(data.get("system"), str) and data["system"]:
        messages.insert(0, {"role": "system", "content": data["system"]})
    return tuple(messages)


def _fields_hint(data: dict[str, Any]) -> str:
    return f" (fields present: {', '.join(sorted(data)) or 'none'})"
