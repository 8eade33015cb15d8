"""Chat tokenization through Mistral's own library (tokenizer.backend: mistral_common): the conversation's tokens
as mistral-common encodes them, and where each assistant turn lies in them.

Mistral's tokenizers have no Jinja template to render: mistral-common builds the token ids itself, and places some
text by the conversation's shape (the system prompt and the tool list go into the *last* user message before V7).
So turns are not found in a rendering, as for other templates (chat/spans.py), but by construction:
- the ids are those of transformers' MistralCommonBackend.apply_chat_template: `encode_chat_completion` of the
  request that `ChatCompletionRequest.from_openai` makes of the messages;
- an assistant message encodes on its own (`encode_assistant_message`, what encode_instruct concatenates) to its
  content or tool calls and the closing </s>, whatever comes before it; and </s> is written nowhere else (text that
  spells it is encoded as text). So the k-th </s> of the ids closes the k-th assistant message that encodes to any
  tokens, and the message's tokens end there.
Each located turn is checked token for token against its own encoding, and the count of </s> against the count of
such messages: a conversation mistral-common encodes otherwise (consecutive assistant messages it merges, a tool
call argument it rewrites) is a bad row that says so, never a mask that is off by a token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.errors import UserError


class MistralRowError(UserError):
    """A conversation mistral-common refuses, or whose turns cannot be located exactly: a bad row (data/tokenize.py
    makes it one, so data.on_bad_row: skip skips it)."""


def is_mistral_common(tokenizer: Any) -> bool:
    """Whether `tokenizer` is transformers' MistralCommonBackend (tokenizer.backend: mistral_common)."""
    return type(tokenizer).__name__ == "MistralCommonBackend"


def mistral_common_version(tokenizer: Any) -> dict[str, str]:
    """{"mistral_common": its version} where it encodes the conversations, else {}: part of the data cache's key."""
    if not is_mistral_common(tokenizer):
        return {}
    import mistral_common

    return {"mistral_common": mistral_common.__version__}


@dataclass(frozen=True)
class MistralChat:
    """A conversation's token ids and the token range [start, end) of each assistant message that was located;
    `unrendered`: assistant messages mistral-common leaves out (tool calls before the last user message)."""

    ids: list[int]
    turns: dict[int, tuple[int, int]]
    unrendered: tuple[int, ...]


def mistral_chat(tokenizer: Any, origin: str, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> MistralChat:
    """The conversation encoded by mistral-common for fine-tuning, with every assistant message located in it."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    try:
        request = ChatCompletionRequest.from_openai(messages=[dict(m) for m in messages], tools=tools)
        ids = list(tokenizer.tokenizer.encode_chat_completion(request).tokens)
    except Exception as e:  # mistral-common validates roles, order, tool calls and ids, and says what is wrong
        raise MistralRowError(f"{origin}: mistral-common refused this conversation: {type(e).__name__}: {e}") from None
    instruct, eos = tokenizer.tokenizer.instruct_tokenizer, tokenizer.eos_token_id
    last_user = max((i for i, m in enumerate(request.messages) if m.role == "user"), default=-1)
    own = {i: instruct.encode_assistant_message(m, i < last_user)
           for i, m in enumerate(request.messages) if m.role == "assistant"}
    encoded = [i for i, tokens in own.items() if tokens]
    ends = [k + 1 for k, t in enumerate(ids) if t == eos]
    if len(ends) != len(encoded):
        raise MistralRowError(f"{origin}: mistral-common encoded {len(encoded)} assistant messages into {len(ends)} turns "
                     "(it merges consecutive assistant messages): their turns cannot be located; merge them in the "
                     "data")
    turns = {}
    for i, end in zip(encoded, ends):
        start = end - len(own[i])
        if start < 0 or ids[start:end] != own[i]:
            raise MistralRowError(f"{origin}: message {i} (assistant) is not encoded in the conversation as on its own "
                         "(mistral-common rewrote it); its turn cannot be located exactly")
        turns[i] = (start, end)
    return MistralChat(ids, turns, tuple(i for i in own if i not in turns))
