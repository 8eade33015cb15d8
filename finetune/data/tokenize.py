"""Examples -> token ids and labels, with -100 on every token that is not trained.

Chat examples are rendered once with the tokenizer's chat template; the character spans of assistant turns
are found by rendering each conversation prefix, then mapped to tokens through the tokenizer's offsets.
A turn's span runs from after the assistant header (the generation prompt) to the end of the turn, minus
trailing whitespace: for ChatML that is the content plus `<|im_end|>`, not the newline the template writes
between turns (the model stops at `<|im_end|>`; what follows it is the template's, not the answer's).
`train_on_inputs: true` trains every token (but the first, which nothing predicts).
That works with any template whose rendering of a conversation prefix is a prefix of the whole rendering,
and it is checked: a template that rewrites earlier turns is reported, not silently mis-masked.
"""

from __future__ import annotations

from typing import Any

from finetune.data.formats import Example
from finetune.data.sources import BadRow
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX


def tokenize_example(example: Example, tokenizer: Any) -> dict[str, list[int]]:
    """Token ids and labels (unshifted) for one example.

    The first token's label is always IGNORE_INDEX: nothing predicts it, and a packed row then never trains
    one document's last token to predict the next document's first.
    """
    if example.text is not None:
        ids = tokenizer(example.text, add_special_tokens=True)["input_ids"]
        # The eos teaches the model where a document ends; some tokenizers' post-processors add it already.
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = [*ids, tokenizer.eos_token_id]
        labels = list(ids)
    else:
        ids, labels = _tokenize_chat(example, tokenizer)
    if labels:
        labels[0] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def _tokenize_chat(example: Example, tokenizer: Any) -> tuple[list[int], list[int]]:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the tokenizer has no chat template; set tokenizer.chat_template in the recipe "
                        "(or use format: completion)")
    messages = list(example.messages)
    full = _render(tokenizer, messages, example)
    if example.train_on_inputs:
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        return ids, list(ids)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:i], example, generation_prompt=True)
        end_text = _render(tokenizer, messages[: i + 1], example)
        if not (full.startswith(end_text) and end_text.startswith(start_text)):
            raise UserError(
                f"{example.origin}: the chat template renders a conversation prefix differently from the whole "
                "conversation, so assistant turns cannot be located for label masking. Use a template whose "
                "earlier turns do not change (tokenizer.chat_template), or set train_on_inputs: true."
            )
        spans.append((len(start_text), len(end_text.rstrip())))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    span_index = 0
    for t, (start, _end) in enumerate(encoded["offset_mapping"]):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= start < spans[span_index][1]:
            labels[t] = ids[t]
    return ids, labels


def _render(tokenizer: Any, messages: list[dict[str, str]], example: Example, generation_prompt: bool = False) -> str:
    if not messages:
        if not generation_prompt:
            return ""
        # The header before an opening assistant turn. transformers refuses to render an empty conversation,
        # so take what the generation prompt adds after a probe turn. If even that fails, the only cost is
        # that this header gets trained.
        probe = [{"role": "user", "content": "x"}]
        try:
            plain = tokenizer.apply_chat_template(probe, tokenize=False)
            prompted = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:
            return ""
        return prompted[len(plain):] if prompted.startswith(plain) else ""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raises for conversations the template refuses (e.g. role order)
        raise BadRow(f"{example.origin}: the chat template refused this conversation: {e}") from None
