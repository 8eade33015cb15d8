"""tokenize.encode calls the Rust tokenizer directly where that gives exactly what tokenizer(text) gives: the same
ids and offsets on every tokenizer family the chat tests know, and the plain call wherever it might not."""

from __future__ import annotations

import bisect
import random

import pytest
from chat_families import FRAGMENTS, USER_ONLY, _base_tokenizer
from conftest import TOKENIZER_DIR

from finetune.chat.token_ranges import EncodingOffsets
from finetune.data.sources import BadRow
from finetune.data.tokenize import _plain_backend, encode


def texts() -> list[str]:
    rng = random.Random(0)
    pieces = FRAGMENTS + USER_ONLY
    return ["", " ", *pieces, *("".join(rng.choices(pieces, k=rng.randint(2, 40))) for _ in range(40))]


def called(tokenizer, text: str, add_special_tokens: bool) -> dict:
    out = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return {"input_ids": out["input_ids"], "offset_mapping": out["offset_mapping"]}


@pytest.mark.parametrize("key", ["qwen2.5", "smollm2", "phi3.5", "gpt-oss"])
def test_direct_encode_equals_the_tokenizer_call(key):
    tokenizer = _base_tokenizer(key)
    assert _plain_backend(tokenizer) is not None  # the direct path is the one tested
    for text in texts():
        for special in (False, True):
            assert encode(tokenizer, "o", text, special, return_offsets_mapping=True) == \
                called(tokenizer, text, special), (key, text)


def test_the_plain_call_where_the_backend_is_set_otherwise():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))  # its own: this test changes its settings
    text = "Hello world, hello again " * 4
    expected = called(tokenizer, text, False)
    tokenizer._tokenizer.enable_truncation(5)  # what a tokenizer.json can ship with; tokenizer() turns it off
    assert _plain_backend(tokenizer) is None
    assert encode(tokenizer, "o", text, False, return_offsets_mapping=True) == expected
    tokenizer.split_special_tokens = True  # the call splits `<|im_end|>` into plain text then
    assert _plain_backend(tokenizer) is None
    assert encode(tokenizer, "o", "<|im_end|>", False)["input_ids"] == tokenizer("<|im_end|>",
                                                                                add_special_tokens=False)["input_ids"]

    class Reshaped(type(tokenizer)):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    assert _plain_backend(Reshaped.__new__(Reshaped)) is None  # a class of its own call is called


def test_text_the_backend_refuses_is_still_a_bad_row(tokenizer):
    with pytest.raises(BadRow, match="^o: the tokenizer cannot encode this row: the text holds a lone surrogate"):
        encode(tokenizer, "o", "a\ud800b", False)


@pytest.mark.parametrize("key", ["qwen2.5", "smollm2", "phi3.5", "gpt-oss"])
def test_offsets_read_token_by_token_find_the_tokens_that_bisection_over_all_offsets_finds(key):
    # EncodingOffsets.first_at starts at the token the Encoding says covers a character and walks: it must land
    # where bisect_left over every token's start does, at every character of every text (multi-byte characters
    # split into several tokens of one offset included), and at the end of the text.
    tokenizer = _base_tokenizer(key)
    for text in [*texts(), "héllo… 日本語 😀😀 <|im_end|>x"]:
        offsets = encode(tokenizer, "o", text, False, return_offsets_mapping=True)["offset_mapping"]
        assert isinstance(offsets, EncodingOffsets)
        starts = [a for a, _ in list(offsets)]
        assert [offsets[k] for k in range(len(offsets))] == list(offsets)
        for pos in range(len(text) + 2):
            assert offsets.first_at(pos) == bisect.bisect_left(starts, pos), (key, text, pos)
