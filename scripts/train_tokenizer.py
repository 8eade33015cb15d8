"""Train the quickstart's small byte-level BPE tokenizer.

Reads the message contents (and role names) of ``examples/data/quickstart_train.jsonl`` in file order,
trains a byte-level BPE with the HF ``tokenizers`` library (ByteLevel pre-tokenizer and decoder,
``add_prefix_space=False``, vocabulary of 1024 including the special tokens) and saves it with
``transformers.PreTrainedTokenizerFast.save_pretrained`` into ``examples/tokenizer``, so that
``AutoTokenizer.from_pretrained("examples/tokenizer")`` loads it offline.

Special tokens: ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (id 1), ``<|im_end|>`` (id 2, eos); no bos.
The chat template is ChatML without a default system prompt: each message renders as
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` and ``add_generation_prompt`` appends
``<|im_start|>assistant\\n``. After saving, the script reloads the tokenizer, checks the template's prefix
property, offsets and round trips, and prints tokens per train row. Training is deterministic: the same
input gives a byte-identical ``tokenizer.json``.

Command (from the repository root, after ``python scripts/make_quickstart_data.py``)::

    python scripts/train_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT / "examples" / "data" / "quickstart_train.jsonl"
DEFAULT_OUT_DIR = REPO_ROOT / "examples" / "tokenizer"

VOCAB_SIZE = 1024
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
MODEL_MAX_LENGTH = 2048

# ChatML. {% generation %} marks the assistant reply (content and <|im_end|>) for
# return_assistant_tokens_mask; it does not change the rendered text.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a chat JSONL file, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def training_texts(rows: list[dict[str, Any]]) -> Iterator[str]:
    """One ``role\\ncontent`` string per message, as it appears between ChatML special tokens."""
    for row in rows:
        for message in row["messages"]:
            yield f"{message['role']}\n{message['content']}"


def build_tokenizer(texts: Iterator[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE over ``texts`` (deterministic for a given input order)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets of "Ġword" tokens keep their leading space, so they tile the text.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok: Tokenizer) -> Any:
    """The transformers fast tokenizer around ``tok`` with the quickstart's special tokens and template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def check_tokenizer(tokenizer: Any, rows: list[dict[str, Any]]) -> None:
    """Assert the properties the trainer relies on; raises AssertionError on the first failure."""
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == i, (token, i)
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2 and tokenizer.bos_token is None
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)

    for row in rows:
        messages = row["messages"]
        for i in range(len(messages)):
            shorter = tokenizer.apply_chat_template(messages[:i], tokenize=False) if i else ""
            longer = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            assert longer.startswith(shorter), (shorter, longer)
            if messages[i]["role"] == "assistant":
                prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                assert longer.startswith(prompt), (prompt, longer)
                assert longer[len(prompt):].startswith(messages[i]["content"] + IM_END)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        expected = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        assert text == expected, (text, expected)

        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        offsets = enc["offset_mapping"]
        assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
        for (_, end), (start, _) in zip(offsets, offsets[1:]):
            assert end == start, "offsets must tile the text"
        for token_id, (start, end) in zip(enc["input_ids"], offsets):
            if token_id in (0, 1, 2):
                assert text[start:end] == tokenizer.convert_ids_to_tokens(token_id)
        assert tokenizer.decode(enc["input_ids"]) == text

    samples = ["What is 37 + 48?", "85", "  two  spaces ", "0123456789 1000000", "a\n\nb\t c",
               "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c", "x" * 50, " leading", "trailing "]
    for s in samples:
        ids = tokenizer.encode(s, add_special_tokens=False)
        assert tokenizer.decode(ids) == s, (s, tokenizer.decode(ids))


def token_stats(tokenizer: Any, rows: list[dict[str, Any]]) -> str:
    """Tokens per row with the chat template: min/median/p90/max and total."""
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    counts = sorted(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    p90 = counts[min(len(counts) - 1, int(0.9 * len(counts)))]
    return (f"tokens/row min={counts[0]} median={statistics.median(counts):g} p90={p90} "
            f"max={counts[-1]} total={sum(counts)} rows={len(counts)}")


def train_and_save(data: Path, out_dir: Path) -> Any:
    """Train on ``data``, save into ``out_dir``, reload with AutoTokenizer, check it and return it."""
    from transformers import AutoTokenizer

    rows = read_rows(data)
    tok = build_tokenizer(training_texts(rows))
    out_dir.mkdir(parents=True, exist_ok=True)
    wrap(tok).save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    check_tokenizer(tokenizer, rows)
    size_kib = (out_dir / "tokenizer.json").stat().st_size / 1024
    print(f"saved {out_dir}: vocab={len(tokenizer)} tokenizer.json={size_kib:.0f} KiB")
    print(token_stats(tokenizer, rows))
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python scripts/train_tokenizer.py [--data FILE] [--out-dir DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="chat JSONL to train on")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where to save the tokenizer")
    args = parser.parse_args(argv)
    train_and_save(args.data, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
