"""Turn raw rows into examples: a list of chat messages (alpaca, chat) or a plain text (completion).

Which messages are trained is decided here, once per message: a message's own `train: true|false` wins,
otherwise its role is trained when it is in the dataset's `roles_to_train` (default: assistant only). With
`train_on_inputs: true` every token is trained, except the turns of messages marked `train: false`. A trained
assistant message with nothing in it (no content, reasoning or tool calls) is a bad row: it would only teach the
model to stop at once. Messages are read by messages.py. Every check names the row's origin (file:line). Nothing
here knows about tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.data.images import RowImages, part_texts
from finetune.data.messages import REASONING_FIELDS, ROLES, MessageFields, chat_message, row_images, row_tools
from finetune.data.prompts import alpaca_prompt
from finetune.data.sources import BadRow, RawRow
from finetune.data.teacher_logprobs import StoredTeacher, read_stored

__all__ = ["DEFAULT_ROLES_TO_TRAIN", "ROLES", "Example", "MessageFields", "chat_message", "to_example"]

DEFAULT_ROLES_TO_TRAIN = ("assistant",)
_DEFAULT_FIELDS = MessageFields()


# Not frozen: a frozen dataclass's __init__ costs ~0.6 us more, paid for every row of a corpus. Never changed.
@dataclass(slots=True)
class Example:
    """A training example: `messages` (chat-like formats), `text` (completion), or a fixed `prompt` and its
    `completion` (alpaca rows with a prompt template), plus where it came from."""

    origin: str
    messages: tuple[dict[str, Any], ...] = ()
    text: str | None = None
    train_on_inputs: bool = False
    trained: tuple[bool, ...] = ()
    """Per message: is its turn trained? Empty: the assistant turns are (an Example built without formats.py)."""
    prompt: str | None = None
    completion: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    """The row's `tools` (function schemas), passed to the chat template."""
    images: tuple[str, ...] = ()
    """The absolute paths of the images of the messages' image parts, in the order they appear."""
    teacher: StoredTeacher | None = None
    """The row's stored teacher log-probabilities (distill.teacher_logprobs), per token position."""


def to_example(row: RawRow, fmt: str, *, messages_field: str = "messages", text_field: str = "text",
               train_on_inputs: bool = False, roles_to_train: tuple[str, ...] = DEFAULT_ROLES_TO_TRAIN,
               fields: MessageFields = _DEFAULT_FIELDS, prompt_template: str = "chat") -> Example:
    """Convert one raw row; raise BadRow (a UserError) naming the row's origin when it does not fit the format."""
    if row.error:
        raise BadRow(f"{row.origin}: {row.error}")
    example = _to_example(row, fmt, messages_field, text_field, train_on_inputs, roles_to_train, fields,
                          prompt_template)
    if fields.teacher is not None:
        example.teacher = read_stored(row.origin, row.data, fields.teacher)
    return example


def _to_example(row: RawRow, fmt: str, messages_field: str, text_field: str, train_on_inputs: bool,
                roles_to_train: tuple[str, ...], fields: MessageFields, prompt_template: str) -> Example:
    flags: tuple[bool | None, ...]
    tools = None
    images = row_images(row.origin, row.data, fields, fmt)  # images of a non-chat row: a bad row
    if fmt == "chat":
        messages, flags = _chat_messages(row, messages_field, fields, images)
        images.check_used()
        tools = row_tools(row.origin, row.data)
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
    return Example(row.origin, messages=messages, train_on_inputs=train_on_inputs, trained=trained, tools=tools,
                   images=tuple(images.paths))


def _trained(origin: str, messages: tuple[dict[str, Any], ...], flags: tuple[bool | None, ...],
             train_on_inputs: bool, roles_to_train: tuple[str, ...]) -> tuple[bool, ...]:
    """Per message: its own `train` flag, else its role in roles_to_train (train_on_inputs: every message)."""
    by_role = tuple(flag if flag is not None else m["role"] in roles_to_train for m, flag in zip(messages, flags))
    if not any(by_role):
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow(f"{origin}: no assistant turn, so nothing to train on")
        if not train_on_inputs:
            raise BadRow(f"{origin}: no message is trained (roles_to_train: {', '.join(roles_to_train)}; a "
                         "message marked train: false is not), so nothing to train on")
    trained = tuple(flag if flag is not None else True for flag in flags) if train_on_inputs else by_role
    for i, (m, t) in enumerate(zip(messages, trained)):
        if t and m["role"] == "assistant" and _is_empty(m):
            raise BadRow(f"{origin}: message {i} (assistant) is empty (no content, reasoning or tool_calls): trained, "
                         "it would teach the model to answer with nothing but the end-of-turn marker. Give it an "
                         'answer, or mark it "train": false to keep it as context')
    return trained


def _is_empty(message: dict[str, Any]) -> bool:
    content = message.get("content")
    if isinstance(content, str) and content.strip():  # nearly every row: the content alone decides
        return False
    texts = [*part_texts(content), *(message.get(k) for k in REASONING_FIELDS)]
    return not message.get("tool_calls") and not any(isinstance(t, str) and t.strip() for t in texts)


def _chat_messages(row: RawRow, field: str, fields: MessageFields,
                   images: RowImages) -> tuple[tuple[dict[str, Any], ...], tuple[bool | None, ...]]:
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
        messages.append(chat_message(row.origin, i, message, fields, images))
        flags.append(_train_flag(row.origin, i, message))
    if fields.drop_system:
        if messages[0]["role"] == "system":
            del messages[0], flags[0]
        if not messages:
            raise BadRow(f"{row.origin}: only a system message, which drop_system_message leaves out")
        return tuple(messages), tuple(flags)
    system = row.data.get(fields.system) if fields.system else None
    if system is not None and messages[0]["role"] != "system":
        if not isinstance(system, str):
            raise BadRow(f"{row.origin}: field {fields.system!r} (the system message) must be a string")
        messages.insert(0, {"role": "system", "content": system})
        flags.insert(0, None)
    return tuple(messages), tuple(flags)


def _train_flag(origin: str, i: int, message: dict[str, Any]) -> bool | None:
    """A message's own `train: true|false` (None: absent, its role decides)."""
    flag = message.get("train")
    if flag is not None and not isinstance(flag, bool):
        raise BadRow(f"{origin}: message {i} has train: {flag!r}; it must be true or false")
    return flag


def _alpaca_messages(row: RawRow) -> tuple[dict[str, str], ...]:
    data = row.data
    for key in ("instruction", "output"):
        if not isinstance(data.get(key), str):
            raise BadRow(f"{row.origin}: alpaca rows need a string {key!r}{_fields_hint(data)}")
    if not data["output"].strip():
        raise BadRow(f"{row.origin}: empty 'output', so nothing to train on")
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
