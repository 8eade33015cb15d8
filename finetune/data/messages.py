"""One chat message as a row gives it -> the message handed to the chat template, every field accounted for.

A message keeps its role and content (read through datasets[].role_field, content_field, role_map; a content may
be a list of text and image parts, finetune/data/images.py), its reasoning (reasoning_content, thinking or
reasoning: assistant messages only; transformers aliases the three onto each other), `tool_calls` (assistant
messages only), `tool_call_id` and `name` (tool messages only), and `train` (formats.py reads it). Any other field
is a bad row naming it, unless data.ignore_message_fields lists it: a field the template never sees is data
dropped, so it is never dropped unseen.

Tool calls reach the template as the row gives them (OpenAI's `{id, type, function: {name, arguments}}` or the flat
`{name, arguments}`), except that arguments held as a JSON string (as OpenAI's API returns them) are parsed into
the object templates expect: most write arguments with `tojson`, which would quote a string once more. An
assistant message with tool calls may have no content (null or absent: passed on as "", which every tested template
takes for "no text", where some fail on null). A row's `tools` (the
function schemas, a list of objects or a JSON string holding one) are passed to the template as `tools=`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from finetune.data.image_files import DEFAULT_MAX_IMAGE_PIXELS
from finetune.data.images import RowImages, message_parts
from finetune.data.sources import BadRow

ROLES = ("system", "user", "assistant", "tool")
# An assistant turn's reasoning, under the names chat templates read (Qwen3, DeepSeek: reasoning_content; gpt-oss:
# thinking; transformers fills both from `reasoning`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Other tools' names for the per-message flag: errors, since ignoring them would train what the data says not to.
MISNAMED_FLAGS = ("training", "weight")
# Fields only some roles carry.
ROLE_FIELDS = {"tool_calls": ("assistant",), "tool_call_id": ("tool",), "name": ("tool",),
               **{k: ("assistant",) for k in REASONING_FIELDS}}


@dataclass(frozen=True)
class MessageFields:
    """Where a row keeps its messages' parts (datasets[].role_field, content_field, role_map, system_field), and
    the message fields to leave out (data.ignore_message_fields)."""

    role: str = "role"
    content: str = "content"
    role_map: tuple[tuple[str, str], ...] = ()
    """(name in the data, role) pairs: other names of the roles, e.g. ShareGPT's (human, user), (gpt, assistant)."""
    system: str | None = None
    """A row field whose text becomes a leading system message when the conversation has none."""
    ignore: tuple[str, ...] = ()
    image_root: str | None = None
    """The folder that relative image paths start from: the data file's."""
    images: str = "images"
    """The row field holding the images that image parts without a path take in order (datasets[].images_field)."""
    cache_dir: str | None = None
    """data.cache_dir (None: the default cache root): images given as bytes are written under it (image_files.py)."""
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    """data.max_image_pixels: an image of more pixels (its header says) is a bad row (image_files.py)."""
    teacher: str | None = None
    """distill.teacher_logprobs: the row field holding a stored teacher's top-k log-probabilities (None: not read)."""
    drop_system: bool = False
    """datasets[].drop_system_message: a conversation's leading system message is left out."""

    def role_of(self, name: Any) -> Any:
        return dict(self.role_map).get(name, name) if self.role_map and isinstance(name, str) else name


def chat_message(origin: str, i: int, message: dict[str, Any], fields: MessageFields,
                 images: RowImages | None = None) -> dict[str, Any]:
    """Message i as {role, content[, reasoning][, tool_calls][, tool_call_id, name]}; a BadRow naming `origin` and
    the message when it does not fit. A content that is a list of text and image parts (data/images.py) stays a
    list, its images taken by `images` (None: rows of a format that takes no images)."""
    role, content = fields.role_of(message.get(fields.role)), message.get(fields.content)
    if len(message) == 2 and type(content) is str and role in ROLES and fields.role in message:
        return {"role": role, "content": content}  # nearly every message: a role and a text, nothing else to check
    if role is None and "from" in message and "value" in message:
        # The most common mix-up: ShareGPT rows ({from: human|gpt, value}) read as chat.
        raise BadRow(f"{origin}: message {i} looks like ShareGPT ({{from, value}}); read such rows with "
                     "role_field: from, content_field: value, role_map: {human: user, gpt: assistant}")
    if role not in ROLES:
        known = ", ".join([*ROLES, *(name for name, _ in fields.role_map)])
        raise BadRow(f"{origin}: message {i} has unknown role {message.get(fields.role)!r}; allowed: {known} "
                     "(datasets[].role_map names other roles)")
    _check_fields(origin, i, role, message, fields)
    message = {k: v for k, v in message.items() if k not in fields.ignore}
    calls = tool_calls(f"{origin}: message {i} (assistant)", message.get("tool_calls"))
    if isinstance(content, list):
        taker = images if images is not None else RowImages(origin, fields.images, [], fields.image_root,
                                                             fields.cache_dir, fields.max_image_pixels)
        content = message_parts(origin, i, content, taker)
        if taker.paths and images is None:
            raise BadRow(f"{origin}: message {i} has image parts; images are read in chat rows (format: chat) only "
                         "so far")
    elif not isinstance(content, str) and not (content is None and calls):
        raise BadRow(f"{origin}: message {i} ({role}) needs a string {fields.content!r}")
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    for key in REASONING_FIELDS:
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise BadRow(f"{origin}: message {i} (assistant) has a {key!r} that is not a string")
            out[key] = message[key]
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise BadRow(f"{origin}: message {i} (tool) has a {key!r} that is not a string")
            out[key] = message[key]
    return out


def _check_fields(origin: str, i: int, role: str, message: dict[str, Any], fields: MessageFields) -> None:
    """Every field of the message is read, left out on request, or the row is bad."""
    for name in MISNAMED_FLAGS:
        if name in message and name not in fields.ignore:
            raise BadRow(f"{origin}: message {i} has {name!r}; the per-message flag is train: true|false")
    unknown = []
    for key, value in message.items():
        if key in (fields.role, fields.content, "train") or key in fields.ignore:
            continue
        if key in ROLE_FIELDS:
            if role not in ROLE_FIELDS[key] and value is not None:
                what = "reasoning" if key in REASONING_FIELDS else key
                raise BadRow(f"{origin}: message {i} ({role}) has {key!r}; only {' and '.join(ROLE_FIELDS[key])} "
                             f"messages carry {what}")
            continue
        unknown.append(key)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise BadRow(f"{origin}: message {i} ({role}) has {names}, which finetune does not read, so the template "
                     "would never see it; remove it, or list it in data.ignore_message_fields to leave it out")


def tool_calls(where: str, value: Any) -> list[dict[str, Any]] | None:
    """An assistant message's tool calls, checked, arguments parsed from JSON text; None for none (absent, null
    or an empty list)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRow(f"{where}: 'tool_calls' must be a list of calls, got {type(value).__name__}")
    calls = []
    for k, call in enumerate(value):
        if not isinstance(call, dict):
            raise BadRow(f"{where}: tool call {k} is not an object")
        call = dict(call)
        target = call
        if "function" in call:
            if not isinstance(call["function"], dict):
                raise BadRow(f"{where}: tool call {k} has a 'function' that is not an object")
            target = call["function"] = dict(call["function"])
        if not isinstance(target.get("name"), str) or not target["name"]:
            raise BadRow(f"{where}: tool call {k} needs a function name (a string)")
        target["arguments"] = _arguments(f"{where}: tool call {k} ({target['name']})", target.get("arguments", {}))
        calls.append(call)
    return calls


def _arguments(where: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(f"{where}: 'arguments' is a string that is not JSON ({e.msg} at column {e.colno}); give "
                         "an object, or a string holding one") from None
    if not isinstance(value, dict):
        raise BadRow(f"{where}: 'arguments' must be an object (or a string holding one), got {type(value).__name__}")
    return value


def row_tools(origin: str, data: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    """A row's `tools`: the function schemas passed to the template (a list of objects, or a JSON string of one)."""
    value = data.get("tools")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(f"{origin}: 'tools' is a string that is not JSON ({e.msg} at column {e.colno})") from None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(f"{origin}: 'tools' must be a list of function schemas (objects)")
    return tuple(value)


def row_images(origin: str, data: dict[str, Any], fields: MessageFields, fmt: str = "chat") -> RowImages:
    """The row's images column (fields.images: a list, or one image as datasets with an `image` column hold it) for
    its image parts to take; a BadRow when a row of a format other than chat has images (they would be dropped)."""
    value = data.get(fields.images)
    entries = [] if value is None else value if isinstance(value, list) else [value]
    if entries and fmt != "chat":
        raise BadRow(f"{origin}: the row has {len(entries)} images in {fields.images!r}; images are read in chat rows "
                     f"(format: chat) only, and this dataset's format is {fmt}")
    return RowImages(origin, fields.images, entries, fields.image_root, fields.cache_dir, fields.max_image_pixels)
