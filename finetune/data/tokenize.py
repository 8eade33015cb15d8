"""Examples -> token ids and labels, with -100 on every token that is not trained.

A chat example is rendered once with the tokenizer's chat template (and the recipe's
tokenizer.chat_template_kwargs, and the row's `tools`) and that text is tokenized. chat/spans.py finds the character span of every
trained message in it; a token is trained when its first character lies in one. For an assistant turn the span
is what follows the assistant header up to and including the end-of-turn marker (ChatML: the content plus
`<|im_end|>`, not the newline the template writes between turns: the model stops at `<|im_end|>`). Which
messages are trained was decided by formats.py (roles_to_train, per-message `train` flags). An assistant
message's tool calls are part of its turn (the template decides how they look), so they are trained with it;
a tool message is an input, like a user message. A template that leaves out a message's tool calls, or the row's
tools, makes the row a bad row.
`train_on_inputs: true` trains every token (but the first, which nothing predicts), except the turns of
messages marked `train: false`. Image parts (finetune/data/images.py) become their image tokens here, and no
image or vision token is ever trained.

Text in a message that spells one of the tokenizer's added tokens (`<|im_end|>` typed into a user message)
becomes that token, as it does when the same text is rendered and tokenized at inference (transformers splits
added tokens out of any text); masking stays exact by character. Such rows are counted (`notes`), so
`finetune preprocess` can say how many there are.

Whatever the template or the tokenizer refuses in a row (a conversation the template rejects, text the tokenizer
cannot encode, such as a lone surrogate from a JSON `\ud800` escape without its pair) is a bad row naming the
row's origin, so `data.on_bad_row: skip` skips it.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from finetune.chat.mistral import MistralRowError, is_mistral_common, mistral_chat
from finetune.chat.spans import (
    REASONING_FIELDS,
    ChatLayout,
    TemplateFacts,
    TemplateNotLocal,
    chat_layout,
    render_chat,
    render_chats,
    skip_holds,
    skipped_layout,
    template_facts,
)
from finetune.chat.token_ranges import EncodingOffsets, trained_tokens
from finetune.data.formats import Example
from finetune.data.images import finish, layout_for, moved_turns, part_texts, place
from finetune.data.sources import BadRow
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX

# The `notes` a chat example can add to (DataStats counters of the same names).
NOTE_SPECIAL_TEXT = "rows_with_special_token_text"
NOTE_UNRENDERED = "turns_not_rendered"
NOTE_ALTERED = "turns_text_changed"


def tokenize_example(example: Example, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None,
                     notes: Counter[str] | None = None, rendered: str | ChatLayout | None = None,
                     facts: TemplateFacts | None = None) -> dict[str, list[int]]:
    """Token ids and labels (unshifted) for one example.

    The first token's label is always IGNORE_INDEX: nothing predicts it, and a packed row then never trains
    one document's last token to predict the next document's first. `notes`, when given, counts what the
    template did to the example's trained turns (NOTE_* keys). `rendered`: a chat example's rendering, when made
    already (render_ahead); `facts`: chat.spans.template_facts(tokenizer, template_kwargs), when kept for many
    examples.
    """
    if example.completion is not None:
        ids, labels = _tokenize_prompted(example, tokenizer)
    elif example.text is not None:
        ids = encode(tokenizer, example.origin, example.text, add_special_tokens=True)["input_ids"]
        # The eos teaches the model where a document ends; some tokenizers' post-processors add it already.
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = [*ids, tokenizer.eos_token_id]
        labels = list(ids)
    elif is_mistral_common(tokenizer):
        ids, labels = _tokenize_mistral(example, tokenizer, notes if notes is not None else Counter())
    else:
        ids, labels, images = _tokenize_chat(example, tokenizer, template_kwargs,
                                             notes if notes is not None else Counter(), rendered, facts)
        if labels:
            labels[0] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, **({"images": images} if images else {})}
    if labels:
        labels[0] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def encode(tokenizer: Any, origin: str, text: str, add_special_tokens: bool,
           return_offsets_mapping: bool = False) -> dict[str, Any]:
    """tokenizer(text)'s input_ids (and offset_mapping); what it cannot encode is a bad row (the tokenizer's own
    message is cryptic)."""
    try:
        backend = _plain_backend(tokenizer)
        if backend is not None:
            encoding = backend.encode(text, add_special_tokens=add_special_tokens)
            ids, offsets = encoding.ids, EncodingOffsets(encoding) if return_offsets_mapping else None
        else:
            called = tokenizer(text, add_special_tokens=add_special_tokens,
                               return_offsets_mapping=return_offsets_mapping)
            ids, offsets = called["input_ids"], called.get("offset_mapping")
    except Exception as e:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as u:
            why = (f"the text holds a lone surrogate {text[u.start]!r} (half of a UTF-16 pair: a JSON "
                   "\\ud800-style escape without its other half), which is not Unicode text")
        else:
            why = f"{type(e).__name__}: {e}"
        raise BadRow(f"{origin}: the tokenizer cannot encode this row: {why}") from None
    return {"input_ids": ids, "offset_mapping": offsets} if return_offsets_mapping else {"input_ids": ids}


_PLAIN_CLASSES: dict[type, bool] = {}


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind `tokenizer`, when calling it gives exactly what tokenizer(text) gives, else None.

    tokenizer(text) spends about a third of its time (25 us a row here) outside the Rust encode: keyword handling,
    BatchEncoding. Exact when the class runs transformers' own call and encode (no subclass reshapes them) and the
    backend has no truncation or padding set and splits special tokens as the tokenizer says (what the call would
    set before encoding; a tokenizer called with other settings gets the plain call).
    """
    kind = type(tokenizer)
    plain = _PLAIN_CLASSES.get(kind)
    if plain is None:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        plain = (issubclass(kind, TokenizersBackend) and kind.__call__ is PreTrainedTokenizerBase.__call__
                 and kind._encode_plus is TokenizersBackend._encode_plus)
        _PLAIN_CLASSES[kind] = plain
    if not plain:
        return None
    backend = tokenizer._tokenizer
    if backend.truncation is not None or backend.padding is not None or \
            backend.encode_special_tokens != bool(tokenizer.split_special_tokens):
        return None
    return backend


def _tokenize_prompted(example: Example, tokenizer: Any) -> tuple[list[int], list[int]]:
    """A fixed prompt and its completion, tokenized apart as Axolotl's alpaca does: the prompt with the tokenizer's
    special tokens (its bos), the completion without a leading bos and with the eos appended unless it ends with
    one. The completion and that eos are trained (and the prompt too with train_on_inputs)."""
    prompt = list(encode(tokenizer, example.origin, example.prompt, add_special_tokens=True)["input_ids"])
    completion = list(encode(tokenizer, example.origin, example.completion, add_special_tokens=True)["input_ids"])
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    if eos is not None and (not completion or completion[-1] != eos):
        completion.append(eos)
    if completion and bos is not None and completion[0] == bos:
        completion = completion[1:]
    prompt_labels = list(prompt) if example.train_on_inputs else [IGNORE_INDEX] * len(prompt)
    return prompt + completion, prompt_labels + completion


def render_ahead(examples: Sequence[Any], tokenizer: Any, template_kwargs: Mapping[str, Any] | None,
                 facts: TemplateFacts | None = None) -> list[str | ChatLayout | None]:
    """Each chat example's rendering, made for all of them in one call where they have no tools of their own (None
    for the others, and for all when the template refuses one: each is then rendered by itself); with `facts`,
    the layout itself where the template need not render it (spans.skipped_layout)."""
    ahead: list[str | ChatLayout | None] = [None] * len(examples)
    if not getattr(tokenizer, "chat_template", None):
        return ahead
    chats, skipped = [], []
    for i, e in enumerate(examples):
        if type(e) is Example and e.messages and e.text is None and e.completion is None and not e.tools:
            layout = skipped_layout(facts, e.messages, _wanted(e)) if facts is not None and not e.images else None
            (skipped if layout is not None else chats).append(i)
            ahead[i] = layout
    # One skipped row a chunk is rendered all the same and compared: a template the proof got wrong is then caught
    # and rendered from there on, these rows too (spans.skip_holds).
    if skipped and not skip_holds(tokenizer, facts, examples[skipped[0]].messages, template_kwargs, ahead[skipped[0]]):
        for i in skipped:
            ahead[i] = None
        chats = sorted(chats + skipped)
    rendered = render_chats(tokenizer, [examples[i].messages for i in chats], template_kwargs)
    for i, text in zip(chats, rendered or ()):
        ahead[i] = text
    return ahead


def _tokenize_chat(example: Example, tokenizer: Any, template_kwargs: Mapping[str, Any] | None,
                   notes: Counter[str], rendered: str | ChatLayout | None = None, facts: TemplateFacts | None = None
                   ) -> tuple[list[int], list[int], dict[str, Any] | None]:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the tokenizer has no chat template; set tokenizer.chat_template in the recipe "
                        "(or use format: completion)")
    vision = layout_for(tokenizer)
    if example.images and vision is None:
        raise UserError(f"{example.origin}: this row has images, and the model is not a vision-language model "
                        "finetune trains (docs/vision.md); set model.path to one, or remove the image parts")
    messages = list(example.messages)
    facts = facts or template_facts(tokenizer, template_kwargs)
    try:
        layout = rendered if isinstance(rendered, ChatLayout) else \
            chat_layout(tokenizer, messages, _wanted(example), template_kwargs, example.tools, rendered, facts)
    except TemplateNotLocal as e:
        raise UserError(f"{example.origin}: {e}") from None
    except Exception as e:  # jinja raises for conversations the template refuses (e.g. role order)
        parts = any(isinstance(m.get("content"), list) for m in messages)
        hint = "; its content parts need a template that renders them (e.g. qwen2_vl)" if parts else ""
        raise BadRow(f"{example.origin}: the chat template refused this conversation: {e}{hint}") from None
    _check_tools_rendered(example, tokenizer, template_kwargs, layout)
    text, turns, placed = layout.text, layout.turns, None
    if example.images:  # each image's placeholder becomes its tokens, the trained spans move with them
        placed = place(example.origin, text, example.images, vision)
        text, turns = placed.text, moved_turns(turns, placed)
    encoded = encode(tokenizer, example.origin, text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]  # the Encoding's own new list, or the call's
    ids = ids if type(ids) is list else list(ids)
    labels = _labels(ids, trained_tokens(encoded["offset_mapping"], turns), example.train_on_inputs)
    images = None
    if vision is not None:  # image and vision tokens are never trained, whatever train_on_inputs says
        images = finish(example.origin, ids, labels, encoded["offset_mapping"], example.images, placed, vision)
    _take_notes(notes, facts.specials, messages, layout, example.train_on_inputs)
    return ids, labels, images


def _tokenize_mistral(example: Example, tokenizer: Any, notes: Counter[str]) -> tuple[list[int], list[int]]:
    """A chat example encoded by mistral-common (tokenizer.backend: mistral_common; chat/mistral.py), which locates
    assistant turns only: a row that marks another role's turn to train (or, with train_on_inputs, to leave out) is a
    bad row."""
    if example.images:
        raise UserError(f"{example.origin}: images with tokenizer.backend: mistral_common are not supported; use "
                        "the model's transformers processor (tokenizer.backend: hf)")
    messages = list(example.messages)
    trained = example.trained or tuple(m["role"] == "assistant" for m in messages)
    wanted = [i for i, t in enumerate(trained) if t != example.train_on_inputs]
    other = next((i for i in wanted if messages[i]["role"] != "assistant"), None)
    if other is not None:
        marked = "left out of training" if example.train_on_inputs else "trained"
        raise BadRow(f"{example.origin}: message {other} ({messages[other]['role']}) is to be {marked}; with "
                     "tokenizer.backend: mistral_common only assistant turns can be located")
    try:
        chat = mistral_chat(tokenizer, example.origin, messages, example.tools)
    except MistralRowError as e:
        raise BadRow(str(e)) from None
    unrendered = sum(i in chat.unrendered for i in wanted)
    if unrendered:
        notes[NOTE_UNRENDERED] += unrendered
    return chat.ids, _labels(chat.ids, [chat.turns[i] for i in wanted if i in chat.turns], example.train_on_inputs)


def _trained(example: Example) -> tuple[bool, ...]:
    """Which messages train: the row's flags, else the assistant's."""
    return example.trained or tuple(m["role"] == "assistant" for m in example.messages)


def _wanted(example: Example) -> list[int]:
    """The messages to locate: train_on_inputs trains everything, so then only those marked train: false, to be
    masked; else those that train."""
    return [i for i, t in enumerate(_trained(example)) if t != example.train_on_inputs]


def _labels(ids: list[int], spans: Sequence[tuple[int, int]], train_on_inputs: bool) -> list[int]:
    """The ids inside the turns' token ranges and IGNORE_INDEX elsewhere; with train_on_inputs the other way round
    (the turns are then the messages marked train: false)."""
    if train_on_inputs:
        labels = list(ids)
        for a, b in spans:
            labels[a:b] = [IGNORE_INDEX] * (b - a)
        return labels
    labels = [IGNORE_INDEX] * len(ids)
    for a, b in spans:
        labels[a:b] = ids[a:b]
    return labels


def _check_tools_rendered(example: Example, tokenizer: Any, template_kwargs: Mapping[str, Any] | None,
                          layout: ChatLayout) -> None:
    """Tool calls and tools the template leaves out would be data dropped unseen: a bad row."""
    if layout.calls_not_rendered:
        i = layout.calls_not_rendered[0]
        raise BadRow(f"{example.origin}: the chat template does not render the tool_calls of message {i} (all of "
                     "them, or all but some: a template without tool support, or one that takes one call per "
                     "message); use a template that renders them (tokenizer.chat_template)")
    if example.tools:
        # On a lone user turn, with and without the tools: rendering the whole row again would cost as much as the
        # whole (gpt-oss's template is quadratic in the number of calls).
        probe = [{"role": "user", "content": "Hi"}]
        try:
            rendered = render_chat(tokenizer, probe, template_kwargs, tools=example.tools)
            without = render_chat(tokenizer, probe, template_kwargs)
        except Exception:  # refused either way: the tools make a difference
            return
        if without == rendered:
            raise BadRow(f"{example.origin}: the chat template does not render the row's tools, so the model would "
                         "learn to call functions it is never shown; use a template that renders them "
                         "(tokenizer.chat_template)")


def _take_notes(notes: Counter[str], specials: tuple[str, ...], messages: list[dict[str, Any]], layout: ChatLayout,
                train_on_inputs: bool) -> None:
    """Count what the template did to the trained turns, and text that spells a special token."""
    if layout.unrendered:
        notes[NOTE_UNRENDERED] += len(layout.unrendered)
    if not train_on_inputs and not layout.verbatim:  # verbatim: each turn holds its content as written
        for turn in layout.turns:
            message = messages[turn.message_index]
            rendered = layout.text[turn.start:turn.end]
            texts = [*part_texts(message.get("content")), *(message.get(k) or "" for k in REASONING_FIELDS)]
            if any(t.strip() and t.strip() not in rendered for t in texts):
                notes[NOTE_ALTERED] += 1  # e.g. reasoning the template drops from earlier turns (Qwen3, R1)
    pattern = _specials_pattern(specials)
    if pattern is None:
        return
    texts = [v for m in messages for k, v in m.items() if k != "role" and isinstance(v, str)]
    texts += [t for m in messages if isinstance(m.get("content"), list) for t in part_texts(m["content"])]
    # One search over the texts joined by NUL, which no special token holds, so that no match spans two texts.
    if texts and (any(pattern.search(t) for t in texts) if "\0" in pattern.pattern else
                  pattern.search("\0".join(texts))):
        notes[NOTE_SPECIAL_TEXT] += 1


@functools.lru_cache(maxsize=16)
def _specials_pattern(specials: tuple[str, ...]) -> re.Pattern[str] | None:
    """One search for any special token's text (a test per token and text cost more than the rest of the notes)."""
    return re.compile("|".join(re.escape(s) for s in specials)) if specials else None
