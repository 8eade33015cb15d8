"""Prompt datasets (`format: prompt`): a prompt as text or messages, and any other fields, which the reward
functions receive (e.g. `answer` for exact_answer).

A prompt row the template or the tokenizer refuses (a lone surrogate from a JSON `\\ud800` escape) is a bad row,
as in SFT data: `data.on_bad_row` stops the run naming its file:line, or skips and counts it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from finetune.chat.spans import render_chat
from finetune.data.messages import MessageFields, chat_message
from finetune.data.samples import message_fields
from finetune.data.sources import DEFAULT_MAX_ROW_BYTES, BadRow, read_rows
from finetune.data.stats import DataStats
from finetune.data.tokenize import encode
from finetune.errors import UserError
from finetune.recipe import DatasetConfig

PLAIN = MessageFields()  # messages as {role, content, ...}: no field or role mapping


@dataclass
class Prompt:
    """One prompt row: as written (text or messages), its token ids, its other fields and its file:line."""

    prompt: Any
    prompt_ids: list[int]
    fields: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    messages: list[dict[str, Any]] | None = None
    """The prompt's messages as the template gets them (role_map applied); None for a text prompt."""


def prompt_messages(prompt: list, where: str, fields: MessageFields = PLAIN) -> list[dict[str, Any]]:
    """A prompt's messages as the template gets them, checked by SFT's rule (data/messages.py: known roles or
    datasets[].role_map, every field read); a BadRow naming `where` and the message otherwise."""
    if not prompt or not all(isinstance(m, dict) for m in prompt):
        raise BadRow(f"{where}: prompt messages are objects with a role and content")
    return [chat_message(where, i, m, fields) for i, m in enumerate(prompt)]


def prompt_ids(prompt: Any, tokenizer: Any, template_kwargs: dict | None, where: str,
               fields: MessageFields = PLAIN, tools: Sequence[dict] | None = None) -> list[int]:
    """Messages rendered with the chat template and its generation prompt (and the tools' schemas, for a multi-turn
    rollout), or text as it is; tokenized without added special tokens (the template writes them)."""
    if isinstance(prompt, list):
        prompt = prompt_messages(prompt, where, fields)
        try:
            prompt = render_chat(tokenizer, prompt, template_kwargs, add_generation_prompt=True, tools=tools)
        except Exception as e:  # noqa: BLE001 - the template's own error, for this row
            raise BadRow(f"{where}: the chat template cannot render the prompt ({e})") from e
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRow(f"{where}: `prompt` must be non-empty text or a list of messages")
    return encode(tokenizer, where, prompt, add_special_tokens=False)["input_ids"]


def read_prompts(configs: Sequence[DatasetConfig], tokenizer: Any, template_kwargs: dict | None,
                 on_bad_row: str, max_prompt_tokens: int | None, key: str = "datasets",
                 max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, ignore: tuple[str, ...] = (),
                 tools: Sequence[dict] | None = None) -> tuple[list[Prompt], int]:
    """Every prompt row of the datasets, and how many bad rows were skipped (on_bad_row: skip). A row over
    `max_row_bytes` (data.max_row_bytes) is a bad row, not read; `ignore`: data.ignore_message_fields; `tools`: the
    schemas a multi-turn rollout's prompt is rendered with (its length counts them)."""
    prompts, stats = [], DataStats()
    for index, cfg in enumerate(configs):
        taken = 0
        try:
            for row in read_rows(cfg.path, split=cfg.split, name=cfg.name, max_row_bytes=max_row_bytes,
                                 data_files=cfg.data_files):
                if cfg.max_rows is not None and taken >= cfg.max_rows:
                    break
                stats.rows_read += 1
                try:
                    prompts.append(_prompt(row, tokenizer, template_kwargs, max_prompt_tokens,
                                           message_fields(cfg, ignore), tools))
                    taken += 1
                except BadRow as e:
                    stats.bad_row(e, on_bad_row)  # the SFT path's rule and message: stop naming file:line, or count
        except BadRow:
            raise  # already names its file:line
        except UserError as e:
            raise UserError(f"{key}.{index}.path: {e}") from None
    return prompts, stats.bad_rows_skipped


def _prompt(row: Any, tokenizer: Any, template_kwargs: dict | None, max_prompt_tokens: int | None,
            fields: MessageFields, tools: Sequence[dict] | None = None) -> Prompt:
    if row.error:
        raise BadRow(f"{row.origin}: {row.error}")
    if "prompt" not in row.data:
        raise BadRow(f"{row.origin}: a prompt row needs a `prompt` (text or messages); it has "
                     f"{sorted(row.data) or 'no fields'}")
    ids = prompt_ids(row.data["prompt"], tokenizer, template_kwargs, row.origin, fields, tools)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise BadRow(f"{row.origin}: the prompt is {len(ids)} tokens; data.max_seq_len - grpo.max_new_tokens "
                     f"leaves {max_prompt_tokens}")
    messages = prompt_messages(row.data["prompt"], row.origin, fields) if isinstance(row.data["prompt"], list) else None
    others = {k: v for k, v in row.data.items() if k != "prompt"}
    return Prompt(row.data["prompt"], ids, others, row.origin, messages)
