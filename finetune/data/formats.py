"""Turn raw rows into examples: a list of chat messages (alpaca, chat) or a plain text (completion).

Which messages are trained is decided here, once per message: a message's own `train: true|false` wins,
otherwise its role is trained when it is in the dataset's `roles_to_train` (default: assistant only). With
`train_on_inputs: true` every token is trained, except the turns of messages marked `train: false`.
Every check names the row's origin (file:line). Nothing here knows about tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.data.prompts import alpaca_prompt
from finetune.data.sources import BadRow, RawRow

ROLES = ("system", "user", "assistant")
DEFAULT_ROLES_TO_TRAIN = ("assistant",)
# Message fields kept besides role and content: an assistant turn's reasoning, under the names chat templates read
# (Qwen3, DeepSeek: reasoning_content; gpt-oss: thinking). Other fields are ignored, except other tools' names for
# the per-message flag, which are errors (ignoring them would train what the data says not to).
REASONING_FIELDS = ("reasoning_content", "thinking")
_MISNAMED_FLAGS = ("training", "weight")


@dataclass(frozen=True)
class MessageFields:
    """Where a row keeps its messages' parts (datasets[].role_field, content_field, role_map, system_field)."""

    role: str = "role"
    content: str = "content"
    role_map: tuple[tuple[str, str], ...] = ()
    """(name in the data, role) pairs: other names of the roles, e.g. ShareGPT's (human, user), (gpt, assistant)."""
    system: str | None = None
    """A row field whose text becomes a leading system message when the conversation has none."""

    def role_of(self, name: Any) -> Any:
        return dict(self.role_map).get(name, name) if isinstance(name, str) else name


@dataclass(frozen=True)
class Example:
    """A training example: `messages` (chat-like formats), `text` (completion), or a fixed `prompt` and its
    `completion` (alpaca rows with a prompt template), plus where it came from."""

    origin: str
    messages: tuple[dict[str, str], ...] = ()
    text: str | None = None
    train_on_inputs: bool = False
    trained: tuple[bool, ...] = ()
    """Per message: is its turn trained? Empty: the assistant turns are (an Example built without formats.py)."""
    prompt: str | None = None
    completion: str | None = None


def to_example(row: RawRow, fmt: str, *, messages_field: str = "messages", text_field: str = "text",
               train_on_inputs: bool = False, roles_to_train: tuple[str, ...] = DEFAULT_ROLES_TO_TRAIN,
               fields: MessageFields = MessageFields(), prompt_template: str = "chat") -> Example:
    """Convert one raw row; raise BadRow (a UserError) naming the row's origin when it does not fit the format."""
    if row.error:
        raise BadRow(f"{row.origin}: {row.error}")
    flags: tuple[bool | None, ...]
    if fmt == "chat":
        messages, flags = _chat_messages(row, messages_field, fields)
    elif fmt == "alpaca" and prompt_template != "chat":
        return _prompted_alpaca(row, prompt_template, train_on_inputs)
    elif fmt == "alpaca":
        messages = _alpaca_messages(row)
        flags = (None,) * len(messages)
    elif fmt == "completion":
        text = row.data.get(text_field)
        if not isinstance(text, str) or not text:
            raise BadRow(f"{row.origin}: completion rows need a non-empty string field {text_field!r}"
                         f"{_fields_hint(row.data)}")
        return Example(row.origin, text=text, train_on_inputs=True)
    else:
        raise ValueError(f"unknown format {fmt!r}")  # the schema only admits the three above
    trained = _trained(row.origin, messages, flags, train_on_inputs, roles_to_train)
    return Example(row.origin, messages=messages, train_on_inputs=train_on_inputs, trained=trained)


def _trained(origin: str, messages: tuple[dict[str, str], ...], flags: tuple[bool | None, ...],
             train_on_inputs: bool, roles_to_train: tuple[str, ...]) -> tuple[bool, ...]:
    """Per message: its own `train` flag, else its role in roles_to_train (train_on_inputs: every message)."""
    by_role = tuple(flag if flag is not None else m["role"] in roles_to_train for m, flag in zip(messages, flags))
    if not any(by_role):
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow(f"{origin}: no assistant turn, so nothing to train on")
        if not train_on_inputs:
            raise BadRow(f"{origin}: no message is trained (roles_to_train: {', '.join(roles_to_train)}; a "
                         "message marked train: false is not), so nothing to train on")
    if train_on_inputs:
        return tuple(flag if flag is not None else True for flag in flags)
    return by_role


def _chat_messages(row: RawRow, field: str,
                   fields: MessageFields) -> tuple[tuple[dict[str, str], ...], tuple[bool | None, ...]]:
    raw = row.data.get(field)
    if raw is None:
        raise BadRow(f"{row.origin}: missing field {field!r}{_fields_hint(row.data)}")
    if not isinstance(raw, list):
        raise BadRow(f"{row.origin}: {field!r} must be a list of {{{fields.role}, {fields.content}}}, got "
                     f"{type(raw).__name__}")
    if not raw:
        raise BadRow(f"{row.origin}: empty conversation")
    messages, flags = [], []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRow(f"{row.origin}: message {i} is not an object")
        messages.append(chat_message(row.origin, i, message, fields))
        flags.append(_train_flag(row.origin, i, message))
    system = row.data.get(fields.system) if fields.system else None
    if system is not None and messages[0]["role"] != "system":
        if not isinstance(system, str):
            raise BadRow(f"{row.origin}: field {fields.system!r} (the system message) must be a string")
        messages.insert(0, {"role": "system", "content": system})
        flags.insert(0, None)
    return tuple(messages), tuple(flags)


def chat_message(origin: str, i: int, message: dict[str, Any], fields: MessageFields) -> dict[str, str]:
    """One message as {role, content[, reasoning]}, its role and text read through `fields`."""
    role, content = fields.role_of(message.get(fields.role)), message.get(fields.content)
    if role is None and "from" in message and "value" in message:
        # The most common mix-up: ShareGPT rows ({from: human|gpt, value}) read as chat.
        raise BadRow(f"{origin}: message {i} looks like ShareGPT ({{from, value}}); read such rows with "
                     "role_field: from, content_field: value, role_map: {human: user, gpt: assistant}")
    if role not in ROLES:
        known = ", ".join([*ROLES, *(name for name, _ in fields.role_map)])
        raise BadRow(f"{origin}: message {i} has unknown role {message.get(fields.role)!r}; allowed: {known} "
                     "(datasets[].role_map names other roles)")
    if not isinstance(content, str):
        raise BadRow(f"{origin}: message {i} ({role}) needs a string {fields.content!r}")
    return {"role": role, "content": content, **_reasoning(origin, i, {**message, "role": role})}


def _train_flag(origin: str, i: int, message: dict[str, Any]) -> bool | None:
    """A message's own `train: true|false` (None: absent, its role decides)."""
    for name in _MISNAMED_FLAGS:
        if name in message:
            raise BadRow(f"{origin}: message {i} has {name!r}; the per-message flag is train: true|false")
    flag = message.get("train")
    if flag is not None and not isinstance(flag, bool):
        raise BadRow(f"{origin}: message {i} has train: {flag!r}; it must be true or false")
    return flag


def _reasoning(origin: str, i: int, message: dict[str, Any]) -> dict[str, str]:
    """The message's reasoning fields, which only an assistant message may carry, as strings."""
    found = {k: message[k] for k in REASONING_FIELDS if message.get(k) is not None}
    for key, value in found.items():
        if message.get("role") != "assistant":
            raise BadRow(f"{origin}: message {i} ({message.get('role')}) has {key!r}; only assistant messages "
                         "carry reasoning")
        if not isinstance(value, str):
            raise BadRow(f"{origin}: message {i} (assistant) has a {key!r} that is not a string")
    return found


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


def _prompted_alpaca(row: RawRow, style: str, train_on_inputs: bool) -> Example:
    """An alpaca row under a fixed prompt: the prompt text and the output, tokenized apart (tokenize.py)."""
    data = row.data
    for key in ("instruction", "output"):
        if not isinstance(data.get(key), str):
            raise BadRow(f"{row.origin}: alpaca rows need a string {key!r}{_fields_hint(data)}")
    extra = data.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRow(f"{row.origin}: alpaca 'input' must be a string (or absent), got {type(extra).__name__}")
    if not data["output"]:
        raise BadRow(f"{row.origin}: empty 'output', so nothing to train on")
    return Example(row.origin, prompt=alpaca_prompt(style, data["instruction"], extra), completion=data["output"],
                   train_on_inputs=train_on_inputs)


def _fields_hint(data: dict[str, Any]) -> str:
    return f" (fields present: {', '.join(sorted(data)) or 'none'})"
