"""The data pipeline with the real example tokenizer: formats, label masking, truncation, the validation split,
padding, how a step's rows are dealt to ranks, and reading each kind of source with its `file:line` origins.

Label masking is checked by decoding exactly the labelled tokens and comparing text, so a mask that is off by
one token (the header's newline, the turn's trailing newline) shows up as a readable difference.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, tiny_recipe

from finetune.data import (
    DataStats,
    build_samples,
    collate,
    epoch_rows,
    load_examples,
    rank_micro_batches,
    steps_in,
    tokenize_examples,
)
from finetune.data.collate import collate_padded
from finetune.data.formats import Example, to_example
from finetune.data.sources import BadRow, RawRow, read_rows
from finetune.data.tokenize import IGNORE_INDEX, tokenize_example
from finetune.errors import UserError
from finetune.recipe import DataConfig, DatasetConfig, validate

CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is 2 + 2?"},
                     {"role": "assistant", "content": "4"}]}
MULTI = {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                      {"role": "assistant", "content": "It is 4."},
                      {"role": "user", "content": "And 3 + 3?"},
                      {"role": "assistant", "content": "It is 6."}]}


def sample_of(data: dict, tokenizer, fmt: str = "chat", train_on_inputs: bool = False) -> dict:
    return tokenize_example(to_example(RawRow(data, "t.jsonl:1"), fmt, train_on_inputs=train_on_inputs), tokenizer)


def labelled_text(sample: dict, tokenizer) -> str:
    return tokenizer.decode([t for t, lab in zip(sample["input_ids"], sample["labels"]) if lab != IGNORE_INDEX])


def unlabelled_text(sample: dict, tokenizer) -> str:
    return tokenizer.decode([t for t, lab in zip(sample["input_ids"], sample["labels"]) if lab == IGNORE_INDEX])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_row(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i}"}]}


# --- formats and label masking ---------------------------------------------------------------------------

def test_example_tokenizer_facts(tokenizer):
    assert tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_chat_trains_only_the_assistant_content_and_end_token(tokenizer):
    sample = sample_of(CHAT, tokenizer)
    assert labelled_text(sample, tokenizer) == "4<|im_end|>"
    rendered = tokenizer.decode(sample["input_ids"])
    assert rendered == tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    # Every system/user token (and the assistant header, and the newline after <|im_end|>) is masked.
    assert unlabelled_text(sample, tokenizer) == rendered.replace("4<|im_end|>", "")
    assert len(sample["input_ids"]) == len(sample["labels"])


def test_multi_turn_trains_both_assistant_turns(tokenizer):
    sample = sample_of(MULTI, tokenizer)
    assert labelled_text(sample, tokenizer) == "It is 4.<|im_end|>It is 6.<|im_end|>"
    assert "What is 2 + 2?" in unlabelled_text(sample, tokenizer)
    assert "And 3 + 3?" in unlabelled_text(sample, tokenizer)


def test_a_conversation_opening_with_the_assistant_masks_its_header(tokenizer):
    data = {"messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Bye."}]}
    assert labelled_text(sample_of(data, tokenizer), tokenizer) == "Hello.<|im_end|>Bye.<|im_end|>"


def test_train_on_inputs_trains_every_token_but_the_first(tokenizer):
    sample = sample_of(MULTI, tokenizer, train_on_inputs=True)
    assert sample["labels"][0] == IGNORE_INDEX
    assert sample["labels"][1:] == sample["input_ids"][1:]


def test_alpaca_masks_the_prompt(tokenizer):
    row = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    sample = sample_of(row, tokenizer, "alpaca")
    assert labelled_text(sample, tokenizer) == "5<|im_end|>"
    assert tokenizer.decode(sample["input_ids"]).startswith("<|im_start|>user\nAdd the numbers.\n\n2 and 3<|im_end|>")


def test_alpaca_without_input(tokenizer):
    for row in ({"instruction": "Say hi.", "output": "hi"}, {"instruction": "Say hi.", "input": "", "output": "hi"}):
        sample = sample_of(row, tokenizer, "alpaca")
        assert labelled_text(sample, tokenizer) == "hi<|im_end|>"
        assert tokenizer.decode(sample["input_ids"]).startswith("<|im_start|>user\nSay hi.<|im_end|>")


def test_alpaca_system_field_becomes_a_system_turn(tokenizer):
    sample = sample_of({"system": "Be terse.", "instruction": "Say hi.", "output": "hi"}, tokenizer, "alpaca")
    assert tokenizer.decode(sample["input_ids"]).startswith("<|im_start|>system\nBe terse.<|im_end|>")
    assert labelled_text(sample, tokenizer) == "hi<|im_end|>"


def test_completion_trains_all_tokens_and_appends_eos(tokenizer):
    sample = sample_of({"text": "the cat sat"}, tokenizer, "completion")
    assert sample["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(sample["input_ids"]) == "the cat sat<|im_end|>"
    assert sample["labels"][0] == IGNORE_INDEX and sample["labels"][1:] == sample["input_ids"][1:]


def test_completion_does_not_double_an_eos_already_there(tokenizer):
    sample = sample_of({"text": "done<|im_end|>"}, tokenizer, "completion")
    assert sample["input_ids"].count(tokenizer.eos_token_id) == 1


@pytest.mark.parametrize(("data", "fmt"), [(CHAT, "chat"), (MULTI, "chat"), ({"text": "abc"}, "completion"),
                                           ({"instruction": "a", "output": "b"}, "alpaca")])
def test_the_first_label_is_always_ignored(tokenizer, data, fmt):
    for train_on_inputs in (False, True):
        assert sample_of(data, tokenizer, fmt, train_on_inputs)["labels"][0] == IGNORE_INDEX


@pytest.mark.parametrize(("data", "fmt", "message"), [
    ({"conversation": []}, "chat", "t.jsonl:1: missing field 'messages' (fields present: conversation)"),
    ({"messages": "hi"}, "chat", "t.jsonl:1: 'messages' must be a list of {role, content}, got str"),
    ({"messages": []}, "chat", "t.jsonl:1: empty conversation"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "chat", "t.jsonl:1: message 0 has unknown role 'bot'; "
                                                             "allowed: system, user, assistant"),
    ({"messages": [{"from": "human", "value": "x"}]}, "chat", "t.jsonl:1: message 0 looks like ShareGPT"),
    ({"messages": [{"role": "user", "content": "x"}]}, "chat", "t.jsonl:1: no assistant turn"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "chat", "t.jsonl:1: message 0 (assistant) needs a string"),
    ({"messages": ["hi"]}, "chat", "t.jsonl:1: message 0 is not an object"),
    ({"instruction": "x"}, "alpaca", "t.jsonl:1: alpaca rows need a string 'output' (fields present: instruction)"),
    ({"instruction": "x", "input": ["a"], "output": "y"}, "alpaca", "t.jsonl:1: alpaca 'input' must be a string"),
    ({"content": "x"}, "completion", "t.jsonl:1: completion rows need a non-empty string field 'text'"),
    ({"text": ""}, "completion", "t.jsonl:1: completion rows need a non-empty string field 'text'"),
])
def test_bad_rows_name_their_origin(data, fmt, message):
    with pytest.raises(BadRow) as info:
        to_example(RawRow(data, "t.jsonl:1"), fmt)
    assert str(info.value).startswith(message)


def test_custom_fields(tokenizer):
    example = to_example(RawRow({"conv": MULTI["messages"]}, "x"), "chat", messages_field="conv")
    assert len(example.messages) == 4
    example = to_example(RawRow({"body": "abc"}, "x"), "completion", text_field="body")
    assert example.text == "abc"


# --- truncation and the validation split -----------------------------------------------------------------

def examples_of(rows: list[dict], fmt: str = "chat") -> list[Example]:
    return [to_example(RawRow(r, f"t:{i}"), fmt) for i, r in enumerate(rows)]


def test_truncation_counts(tokenizer):
    long = {"text": " ".join(["word"] * 50)}
    short = {"text": "hi"}
    examples = examples_of([long, short, long], "completion")
    stats = DataStats()
    samples = tokenize_examples(examples, tokenizer, DataConfig(max_seq_len=16), stats)
    assert [len(s["input_ids"]) for s in samples] == [16, len(samples[1]["input_ids"]), 16]
    assert stats.truncated == 2 and stats.dropped_too_long == 0 and stats.samples == 3
    assert stats.tokens == sum(len(s["input_ids"]) for s in samples)
    assert stats.target_tokens == sum(len(s["input_ids"]) - 1 for s in samples)

    stats = DataStats()
    samples = tokenize_examples(examples, tokenizer, DataConfig(max_seq_len=16, truncation="drop"), stats)
    assert len(samples) == 1 and stats.dropped_too_long == 2 and stats.truncated == 0 and stats.samples == 1
    # Named by their rows, as bad rows are (the report and the run log print these).
    n = stats.dropped_tokens // 2
    assert stats.dropped_examples == [f"t:{i}: {n} tokens, over data.max_seq_len 16 (data.truncation: drop)"
                                      for i in (0, 2)]


def split_recipe(tmp_path: Path, val_fraction: float, seed: int = 0):
    data = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(20)])
    raw = tiny_recipe(tmp_path / "out", data)
    raw["data"]["val_fraction"] = val_fraction
    raw["seed"] = seed
    return validate(raw)


def test_val_fraction_split_is_deterministic_and_disjoint(tmp_path, tokenizer):
    recipe = split_recipe(tmp_path, 0.25)
    train, evals, train_stats, eval_stats = build_samples(recipe, tokenizer)
    again_train, again_evals, _, _ = build_samples(recipe, tokenizer)
    assert len(train) == 15 and len(evals) == 5
    assert train == again_train and evals == again_evals
    as_keys = lambda samples: {tuple(s["input_ids"]) for s in samples}  # noqa: E731
    assert not as_keys(train) & as_keys(evals)
    assert len(as_keys(train) | as_keys(evals)) == 20
    other_train, _, _, _ = build_samples(split_recipe(tmp_path, 0.25, seed=1), tokenizer)
    assert as_keys(other_train) != as_keys(train)  # the seed picks the held-out rows


def test_val_fraction_that_leaves_nothing_to_train(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "train.jsonl", [chat_row(1)])
    raw = tiny_recipe(tmp_path / "out", data)
    raw["data"]["val_fraction"] = 0.5
    with pytest.raises(UserError, match="data.val_fraction: 0.5 of 1 training rows leaves none to train on"):
        build_samples(validate(raw), tokenizer)


def test_no_target_tokens_is_an_error(tmp_path, tokenizer):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}
    data = write_jsonl(tmp_path / "train.jsonl", [long_prompt])
    raw = tiny_recipe(tmp_path / "out", data)
    raw["data"]["max_seq_len"] = 8
    with pytest.raises(UserError, match="has no target tokens"):
        build_samples(validate(raw), tokenizer)


# --- collation -------------------------------------------------------------------------------------------

def test_collate_padded_right_pads_with_ignored_labels():
    samples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [-100]}]
    batch = collate_padded(samples, pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.labels.tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.seq_tokens == 4 and batch.padded_tokens == 6


def test_collate_padded_to_a_multiple():
    samples = [{"input_ids": list(range(1, 6)), "labels": list(range(1, 6))}, {"input_ids": [1], "labels": [1]}]
    batch = collate_padded(samples, pad_token_id=0, pad_to_multiple_of=4)
    assert batch.input_ids.shape == (2, 8)
    assert batch.seq_tokens == 6 and batch.padded_tokens == 16
    assert (batch.labels[batch.attention_mask == 0] == IGNORE_INDEX).all()
    assert batch.input_ids.dtype == torch.long


def test_collate_dispatches_on_packing():
    samples = [{"input_ids": [5, 6], "labels": [-100, 6]}]
    padded = collate(samples, DataConfig(packing=False), pad_token_id=0)
    assert padded.attention_mask is not None and not padded.packed
    packed = collate([{**samples[0], "position_ids": [0, 1]}], DataConfig(packing=True), pad_token_id=0)
    assert packed.attention_mask is None and packed.packed


# --- steps and ranks -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("n_rows", "batch", "drop_last", "steps"),
                         [(10, 4, False, 3), (10, 4, True, 2), (8, 4, False, 2), (8, 4, True, 2),
                          (3, 4, False, 1), (3, 4, True, 0)])
def test_steps_in(n_rows, batch, drop_last, steps):
    assert steps_in(n_rows, batch, drop_last) == steps


def rows_of(lengths: list[int]) -> list[dict]:
    return [{"input_ids": [i + 1] * n, "labels": [i + 1] * n} for i, n in enumerate(lengths)]


def test_rank_micro_batches_round_robin():
    rows = rows_of([1, 2, 3, 4, 5, 6, 7, 8])
    rank0 = rank_micro_batches(rows, micro_batch_size=2, world_size=2, rank=0)
    rank1 = rank_micro_batches(rows, micro_batch_size=2, world_size=2, rank=1)
    assert rank0 == [rows[0:2], rows[4:6]] and rank1 == [rows[2:4], rows[6:8]]
    assert rank_micro_batches(rows, 2, 1, 0) == [rows[0:2], rows[2:4], rows[4:6], rows[6:8]]


def test_short_last_step_gives_a_filler_with_no_targets():
    rows = rows_of([3, 4, 5])  # 3 rows, micro 1, world 2: rank 0 gets two micro-batches, rank 1 one
    rank0 = rank_micro_batches(rows, 1, 2, 0)
    rank1 = rank_micro_batches(rows, 1, 2, 1)
    assert rank0 == [[rows[0]], [rows[2]]]
    assert len(rank1) == 2 and rank1[0] == [rows[1]]
    filler = rank1[1]
    assert all(lab == IGNORE_INDEX for row in filler for lab in row["labels"])
    batch = collate_padded(filler, pad_token_id=0)
    assert int((batch.labels != IGNORE_INDEX).sum()) == 0


def test_one_row_on_two_ranks():
    rows = rows_of([4])
    assert rank_micro_batches(rows, 2, 2, 0) == [rows]
    (filler,) = rank_micro_batches(rows, 2, 2, 1)
    assert all(lab == IGNORE_INDEX for lab in filler[0]["labels"])


def test_group_by_length_keeps_the_steps_rows():
    rows = rows_of([3, 9, 1, 7, 5, 2])
    key = lambda r: (r["input_ids"][0], len(r["input_ids"]))  # noqa: E731
    dealt = [row for rank in range(2) for micro in rank_micro_batches(rows, 2, 2, rank, group_by_length=True)
             for row in micro if any(lab != IGNORE_INDEX for lab in row["labels"])]  # fillers aside
    assert sorted(map(key, dealt)) == sorted(map(key, rows))
    rank0 = rank_micro_batches(rows, 2, 2, 0, group_by_length=True)
    assert [len(r["input_ids"]) for r in rank0[0]] == [9, 7]  # longest rows share a micro-batch


def test_epoch_rows_unpacked_shuffle_is_deterministic_per_epoch():
    rows = rows_of(list(range(1, 21)))
    cfg = DataConfig(packing=False, shuffle=True)
    e0, e0_again, e1 = epoch_rows(rows, cfg, 0, 0), epoch_rows(rows, cfg, 0, 0), epoch_rows(rows, cfg, 0, 1)
    first_id = lambda r: r["input_ids"][0]  # noqa: E731
    assert e0 == e0_again and e0 != e1 and sorted(e0, key=first_id) == rows
    assert epoch_rows(rows, DataConfig(packing=False, shuffle=False), 0, 3) == rows


# --- sources ---------------------------------------------------------------------------------------------

def test_jsonl_rows_and_origins(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"a": \n[1]\n{"a": "\xff"}\n')
    rows = list(read_rows(str(path)))
    assert [(r.origin, r.data, r.error) for r in rows[:2]] == [(f"{path}:1", {"a": 1}, None),
                                                              (f"{path}:3", {"a": 2}, None)]
    assert rows[2].origin == f"{path}:4" and rows[2].error.startswith("malformed JSON")
    assert rows[3].origin == f"{path}:5" and rows[3].error == "expected a JSON object, got list"
    assert rows[4].origin == f"{path}:6" and rows[4].error.startswith("not valid UTF-8")


def test_jsonl_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    assert [r.data for r in read_rows(str(path))] == [{"a": 1}, {"a": 2}]


def test_json_list_origins_are_lines(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"a": 1},\n  {"a": [1,\n 2]},\n  {"a": 3}\n]\n')
    rows = list(read_rows(str(path)))
    assert [(r.origin, r.data["a"]) for r in rows] == [(f"{path}:2", 1), (f"{path}:3", [1, 2]), (f"{path}:5", 3)]


def test_json_data_wrapper_and_errors(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"data": [{"a": 1}, 5]}))
    rows = list(read_rows(str(path)))
    assert rows[0].data == {"a": 1} and rows[0].origin == f"{path}[data][0]"
    assert rows[1].error == "expected a JSON object"
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"a": 1},\n{"a": }\n]')
    with pytest.raises(UserError, match=f"{broken}:3: malformed JSON"):
        list(read_rows(str(broken)))


def test_csv_rows_and_origins(tmp_path):
    path = tmp_path / "d.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerows([["instruction", "output"], ["Say hi", "hi"], ["Add, please", "5"]])
    with path.open("a", encoding="utf-8") as handle:
        handle.write("a,b,c\n")
    rows = list(read_rows(str(path)))
    assert [(r.origin, r.data) for r in rows[:2]] == [
        (f"{path}:2", {"instruction": "Say hi", "output": "hi"}),
        (f"{path}:3", {"instruction": "Add, please", "output": "5"})]
    assert rows[2].origin == f"{path}:4" and rows[2].error.startswith("1 more values than the header's 2 columns")


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", "two"], "n": [1, 2]}), path)
    rows = list(read_rows(str(path)))
    assert [r.data for r in rows] == [{"text": "one", "n": 1}, {"text": "two", "n": 2}]
    assert [r.origin for r in rows] == [f"{path}[row 0]", f"{path}[row 1]"]
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(UserError, match="cannot read parquet"):
        list(read_rows(str(broken)))


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(UserError, match="data file not found: .*nope.jsonl"):
        list(read_rows(str(tmp_path / "nope.jsonl")))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="unsupported data file type '.txt'"):
        list(read_rows(str(tmp_path / "notes.txt")))
    with pytest.raises(UserError, match="is a directory"):
        list(read_rows(str(tmp_path)))


def test_load_examples_names_the_recipe_key_for_a_missing_file(tmp_path):
    configs = [DatasetConfig(path=str(write_jsonl(tmp_path / "ok.jsonl", [chat_row(1)]))),
               DatasetConfig(path=str(tmp_path / "gone.jsonl"))]
    with pytest.raises(UserError) as info:
        load_examples(configs, "error", DataStats(), key="eval_datasets")
    assert str(info.value).startswith(f"eval_datasets.1.path: data file not found: {tmp_path / 'gone.jsonl'}")


def test_load_examples_skips_and_counts_bad_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat_row(1), {"messages": []}, chat_row(2), {"x": 1}, chat_row(3)])
    stats = DataStats()
    examples = load_examples([DatasetConfig(path=str(path))], "skip", stats)
    assert len(examples) == 3 and stats.rows_read == 5 and stats.bad_rows_skipped == 2
    assert stats.bad_row_examples[0] == f"{path}:2: empty conversation"
    with pytest.raises(UserError) as info:
        load_examples([DatasetConfig(path=str(path))], "error", DataStats())
    assert str(info.value).startswith(f"{path}:2: empty conversation\n  Fix the row, or set data.on_bad_row: skip")


def test_max_rows_counts_good_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat_row(i) for i in range(10)])
    stats = DataStats()
    assert len(load_examples([DatasetConfig(path=str(path), max_rows=4)], "error", stats)) == 4
    assert stats.rows_read == 4


def test_hub_dataset_offline_is_a_clear_user_error(monkeypatch):
    # A subprocess: huggingface_hub and datasets read these variables when they are first imported.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = ("from finetune.data.sources import read_rows\nfrom finetune.errors import UserError\n"
              "try:\n    list(read_rows('no-such-org/no-such-dataset'))\n"
              "except UserError as e:\n    print('USERERROR', e)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("USERERROR dataset 'no-such-org/no-such-dataset': not a local file, and "
                                    "loading it from the Hugging Face hub failed"), result.stdout
    assert "check the path (relative to the recipe file)" in result.stdout


# --- rows too large, text the tokenizer cannot encode ---------------------------------------------------------

def test_a_jsonl_line_over_max_row_bytes_is_a_bad_row_never_read_whole(tmp_path):
    path = tmp_path / "d.jsonl"
    row = json.dumps(chat_row(1)).encode()  # 81 bytes
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 3_000_000}]}).encode()
    path.write_bytes(row + b"\n" + big + b"\r\n" + row[:-1] + b" }\r\n" + row)  # the last line ends without newline
    limit = len(row) + 1
    rows = list(read_rows(str(path), max_row_bytes=limit))
    assert [r.origin for r in rows] == [f"{path}:{n}" for n in (1, 2, 3, 4)]
    assert rows[1].error == (f"the row is {len(big):,} bytes, over data.max_row_bytes ({limit:,}); it was not read "
                             "(raise the limit to read it)")
    assert [r.data for r in rows if r.error is None] == [chat_row(1)] * 3  # a line of exactly the limit is read
    assert list(read_rows(str(path), max_row_bytes=len(row) - 1))[0].error.startswith(f"the row is {len(row)} bytes")


def test_rows_of_other_formats_over_max_row_bytes_are_bad_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = "é" * 600  # 1,200 bytes in UTF-8
    (tmp_path / "d.json").write_text(json.dumps([{"text": "short"}, {"text": text}]), encoding="utf-8")
    pq.write_table(pa.table({"text": ["short", text]}), tmp_path / "d.parquet")
    with (tmp_path / "d.csv").open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["text", "more"], ["short", "x"], [text[:400], text[:400]]])
    for name, second in (("d.json", "d.json:1"), ("d.parquet", "d.parquet[row 1]"), ("d.csv", "d.csv:3")):
        rows = list(read_rows(str(tmp_path / name), max_row_bytes=1000))
        assert rows[0].error is None and rows[1].origin == str(tmp_path / second), name
        size = 1608 if name == "d.csv" else 1204  # the UTF-8 bytes of every string, keys included
        assert rows[1].error == (f"the row is {size:,} bytes, over data.max_row_bytes (1,000); it was not read "
                                 "(raise the limit to read it)"), name


def test_a_csv_field_over_max_row_bytes_stops_with_its_line(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("text\nshort\n" + "x" * 200_000 + "\nshort\n", encoding="utf-8")
    assert len(list(read_rows(str(path)))) == 3  # over csv's own 128 KiB field limit, under the default 8 MiB
    with pytest.raises(UserError, match=re.escape(f"{path}:3: a CSV field over data.max_row_bytes (100,000 "
                                                  "characters)")):
        list(read_rows(str(path), max_row_bytes=100_000))
    assert csv.field_size_limit() == 131072  # the process-wide setting is put back


def test_max_row_bytes_reaches_the_rows_from_the_recipe(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "train.jsonl", [chat_row(1), chat_row(2 * 10**400)])
    raw = tiny_recipe(tmp_path / "run", data)
    raw["data"].update(max_row_bytes=200, on_bad_row="skip")
    train, _, stats, _ = build_samples(validate(raw), tokenizer)
    assert len(train) == 1 and stats.bad_rows_skipped == 1
    assert stats.bad_row_examples[0].startswith(f"{data}:2: the row is 8")


@pytest.mark.parametrize("fmt,row", [
    ("chat", '{"messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", "content": "ok"}]}'),
    ("completion", '{"text": "lone \\udfff surrogate"}'),
    ("alpaca", '{"instruction": "x", "output": "\\ud83d"}'),
])
def test_text_the_tokenizer_cannot_encode_is_a_bad_row(tmp_path, tokenizer, fmt, row):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(chat_row(1) if fmt == "chat" else {"text": "fine", "instruction": "a", "output": "b"})
                    + "\n" + row + "\n", encoding="utf-8")
    raw = tiny_recipe(tmp_path / "run", data, fmt)
    raw["data"]["on_bad_row"] = "skip"
    train, _, stats, _ = build_samples(validate(raw), tokenizer)
    assert len(train) == 1 and stats.bad_rows_skipped == 1
    why = stats.bad_row_examples[0]
    assert why.startswith(f"{data}:2: the tokenizer cannot encode this row: the text holds a lone surrogate '\\")
    assert why.encode("utf-8")  # printable
    raw["data"]["on_bad_row"] = "error"
    with pytest.raises(BadRow, match=re.escape(f"{data}:2: the tokenizer cannot encode this row")):
        build_samples(validate(raw), tokenizer)


def test_a_huge_jsonl_line_costs_memory_up_to_the_limit_only(tmp_path):
    # A 40 MB line under the default 8 MiB limit: read in pieces and dropped, never held whole, decoded or parsed
    # (10 MiB at peak here; held whole, decoded and parsed as before, 153 MiB).
    import tracemalloc

    path = tmp_path / "d.jsonl"
    with path.open("wb") as handle:
        handle.write(json.dumps(chat_row(1)).encode() + b"\n" + b'{"text": "' + b"x" * 40_000_000 + b'"}\n')
    tracemalloc.start()
    try:
        rows = list(read_rows(str(path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows[1].error.startswith("the row is 40,000,012 bytes, over data.max_row_bytes (8,388,608)")
    assert peak < 12 * 2**20, f"{peak / 2**20:.1f} MiB"


def test_drop_system_message_leaves_out_the_leading_system_turn():
    """datasets[].drop_system_message: the leading system message (or system_field's) is left out, with its flag; a
    later one stays; a row of nothing but a system message is a bad row; other formats refuse the key."""
    from finetune.data.messages import MessageFields

    drop = MessageFields(system="system", drop_system=True)
    row = {"system": "From the field.", "messages": [{"role": "system", "content": "Be terse.", "train": False},
                                                     *MULTI["messages"]]}
    example = to_example(RawRow(row, "t:1"), "chat", fields=drop)
    assert example.messages == tuple(MULTI["messages"])
    assert len(example.trained) == len(MULTI["messages"])
    kept = to_example(RawRow(row, "t:1"), "chat", fields=MessageFields(system="system"))
    assert kept.messages[0] == {"role": "system", "content": "Be terse."}
    with pytest.raises(BadRow, match="only a system message"):
        to_example(RawRow({"messages": [{"role": "system", "content": "x"}]}, "t:2"), "chat", fields=drop)
    with pytest.raises(UserError, match="drop_system_message: only for format chat, not completion"):
        validate({**tiny_recipe("out"), "datasets": [{"path": "t.jsonl", "format": "completion",
                                                      "drop_system_message": True}]})


def test_data_files_pick_files_of_a_hub_dataset(monkeypatch, tmp_path):
    """datasets[].data_files reach datasets.load_dataset (the hub is out of reach here: the call is recorded and
    answered with a small dataset), and the rows read are that dataset's; a local file refuses the key."""
    import datasets

    calls = []

    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.Dataset.from_list([{"text": "one"}, {"text": "two"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows = list(read_rows("org/corpus", split="train", data_files=["pretrain/a.jsonl.zst"]))
    assert [r.data["text"] for r in rows] == ["one", "two"] and rows[0].origin == "org/corpus[train][0]"
    assert calls == [("org/corpus", None, {"split": "train", "data_files": ["pretrain/a.jsonl.zst"]})]
    recipe = tiny_recipe(tmp_path)
    recipe["datasets"][0].update(path=str(tmp_path / "t.jsonl"), data_files=["a.jsonl"])
    with pytest.raises(UserError, match="data_files: only for a hub dataset;"):
        validate(recipe)
