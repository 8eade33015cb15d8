"""Checks on the quickstart's committed data and tokenizer (fast, offline).

Covers ``examples/data/quickstart_{train,eval}.jsonl`` (made by ``python scripts/make_quickstart_data.py``)
and ``examples/tokenizer`` (made by ``python scripts/train_tokenizer.py``): the tokenizer's special tokens and
ChatML template with its prefix property, offsets and round trips; the data's row shape, correctness of
the synthetic answers, and that both scripts reproduce the committed files byte for byte.

Run: ``.venv/bin/python -m pytest -q tests/test_quickstart_assets.py``
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "examples" / "data"
TRAIN = DATA_DIR / "quickstart_train.jsonl"
EVAL = DATA_DIR / "quickstart_eval.jsonl"
TOKENIZER_DIR = REPO_ROOT / "examples" / "tokenizer"

ARITH = re.compile(r"^What is (\d+) ([-+*]) (\d+)\?$")


def _load_script(name: str) -> ModuleType:
    path = REPO_ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_quickstart_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _arith(prompt: str) -> int | None:
    """The answer to "What is a <op> b?", or None for other prompts."""
    m = ARITH.match(prompt)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _read(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def train_rows() -> list[dict[str, Any]]:
    return _read(TRAIN)


@pytest.fixture(scope="module")
def eval_rows() -> list[dict[str, Any]]:
    return _read(EVAL)


# ----------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens(tokenizer: Any) -> None:
    assert len(tokenizer) == 1024
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 2048
    # Plain encoding adds no special tokens, and special tokens in text map to their single ids.
    assert tokenizer("hi")["input_ids"] == tokenizer("hi", add_special_tokens=False)["input_ids"]
    assert tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == 1
    assert tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"][-1] == 2


def test_tokenizer_files_small() -> None:
    assert (TOKENIZER_DIR / "tokenizer.json").stat().st_size < 200 * 1024


def test_chat_template_renders_chatml(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Answer with only the result."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "What is 4 * 4?"},
        {"role": "assistant", "content": "16"},
    ]
    expected = (
        "<|im_start|>system\nAnswer with only the result.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
        "<|im_start|>user\nWhat is 4 * 4?<|im_end|>\n"
        "<|im_start|>assistant\n16<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    # No default system prompt; the generation prompt opens an assistant turn.
    assert tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_prefix_property(tokenizer: Any, train_rows: list[dict[str, Any]],
                                       eval_rows: list[dict[str, Any]]) -> None:
    for row in train_rows[:300] + eval_rows:
        messages = row["messages"]
        previous = ""
        for i, message in enumerate(messages):
            rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            assert rendered.startswith(previous)
            if message["role"] == "assistant":
                prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                assert rendered.startswith(prompt)
                assert rendered[len(prompt):] == message["content"] + "<|im_end|>\n"
            previous = rendered


def test_offsets_tile_text_and_round_trip(tokenizer: Any, eval_rows: list[dict[str, Any]]) -> None:
    for row in eval_rows[:50]:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        enc = tokenizer(text, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
        assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
        pieces = "".join(text[s:e] for s, e in offsets)
        assert pieces == text
        assert tokenizer.decode(enc["input_ids"]) == text
        # The assistant answer's characters map onto whole tokens.
        answer = row["messages"][-1]["content"]
        start = text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
        starts = {s for s, _ in offsets}
        ends = {e for _, e in offsets}
        assert start in starts and start + len(answer) in ends
    for s in ["What is 37 + 48?", "85", "1234567890", "  two  spaces  ", "a\n\nb\tc", "na\u00efve \u65e5\u672c"]:
        assert tokenizer.decode(tokenizer.encode(s, add_special_tokens=False)) == s


def _bpe_model(path: Path) -> tuple[dict[str, int], list[tuple[str, ...]], list[str]]:
    spec = json.loads(path.read_text(encoding="utf-8"))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    return spec["model"]["vocab"], merges, [t["content"] for t in spec["added_tokens"]]


def test_tokenizer_retrains_identically(tmp_path: Path) -> None:
    # The committed tokenizer is the one the script makes from the committed data. Compared as parsed
    # vocab/merges rather than bytes so that a tokenizers release that only reformats the file still passes.
    train_tokenizer = _load_script("train_tokenizer")
    train_tokenizer.main(["--data", str(TRAIN), "--out-dir", str(tmp_path)])
    assert _bpe_model(tmp_path / "tokenizer.json") == _bpe_model(TOKENIZER_DIR / "tokenizer.json")


# ----------------------------------------------------------------------------------------------- data


def _check_messages(messages: Any) -> None:
    assert isinstance(messages, list) and messages
    for m in messages:
        assert set(m) == {"role", "content"}
        assert isinstance(m["content"], str) and m["content"]
    roles = [m["role"] for m in messages]
    if roles[0] == "system":
        roles = roles[1:]
    assert roles and len(roles) % 2 == 0
    assert roles == ["user", "assistant"] * (len(roles) // 2)


@pytest.mark.parametrize("path", [TRAIN, EVAL], ids=["train", "eval"])
def test_data_rows_valid(path: Path) -> None:
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and b"\r" not in raw
    rows = _read(path)
    assert 150 <= len(rows) <= 4000
    for row in rows:
        assert set(row) == {"messages"}
        _check_messages(row["messages"])
        assert row["messages"][-1]["role"] == "assistant"


def test_data_mix(train_rows: list[dict[str, Any]]) -> None:
    n = len(train_rows)
    system = sum(r["messages"][0]["role"] == "system" for r in train_rows) / n
    multi = sum(sum(m["role"] == "user" for m in r["messages"]) > 1 for r in train_rows) / n
    assert 0.08 < system < 0.25 and 0.05 < multi < 0.2
    chars = sorted(sum(len(m["content"]) for m in r["messages"]) for r in train_rows)
    assert chars[n // 2] < 100 and chars[-1] > 600  # mostly short, with a long tail


def test_data_size_and_no_shared_rows() -> None:
    assert TRAIN.stat().st_size + EVAL.stat().st_size < 1.5 * 1024 * 1024
    train_lines = set(TRAIN.read_text(encoding="utf-8").splitlines())
    eval_lines = EVAL.read_text(encoding="utf-8").splitlines()
    assert not train_lines.intersection(eval_lines)


def test_data_regenerates_identically(tmp_path: Path) -> None:
    make_data = _load_script("make_quickstart_data")
    assert make_data.main(["--out-dir", str(tmp_path)]) == 0
    for path in (TRAIN, EVAL):
        assert (tmp_path / path.name).read_bytes() == path.read_bytes()


def test_answers_correct(train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]]) -> None:
    checked = {"arith": 0, "sort": 0, "reverse": 0, "upper": 0}
    for row in train_rows + eval_rows:
        messages = row["messages"]
        for user, assistant in zip(messages, messages[1:]):
            if user["role"] != "user":
                continue
            prompt, answer = user["content"], assistant["content"]
            expected = _arith(prompt)
            if expected is not None:
                assert answer == str(expected), prompt
                checked["arith"] += 1
            elif prompt.startswith("Sort the words alphabetically: "):
                words = prompt.split(": ", 1)[1].split(", ")
                assert answer.split(", ") == sorted(words)
                checked["sort"] += 1
            elif prompt.startswith("Reverse the words: "):
                words = prompt.split(": ", 1)[1].split(", ")
                assert answer.split(", ") == words[::-1]
                checked["reverse"] += 1
            elif prompt.startswith("Write in uppercase: "):
                assert answer == prompt.split(": ", 1)[1].upper()
                checked["upper"] += 1
    assert checked["arith"] > 500 and min(checked.values()) > 50, checked


def test_arith_checker_by_hand() -> None:
    assert _arith("What is 37 + 48?") == 85
    assert _arith("What is 91 - 26?") == 65
    assert _arith("What is 7 * 8?") == 56
    assert _arith("What is the first letter of cat?") is None
