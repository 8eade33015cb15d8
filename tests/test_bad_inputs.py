"""Bad input is handled: every kind of broken recipe, data row, path or output_dir gets exit code 2, one message
that names the key or the file:line, no traceback, and loses nothing the user already had.

One table (CASES) drives everything: each case writes a tiny recipe (the quickstart, shrunk to hidden 32 and 2
layers, one step; `extends:` the real quickstart so it stays in step with it), a few data rows, and an
output_dir that already holds a sentinel file and an earlier run's metrics.jsonl (with the earlier run's marker,
finetune-run.json, unless the case says the files are another tool's); then it runs the real CLI,
`python -m finetune train RECIPE ... --overwrite` (or `validate`). `--overwrite` is what gets a run past the
earlier run to the bad input, and it is exactly when losing that earlier run would hurt.

Two tests per case: `test_bad_input[kind]` (exit code, message, no traceback) and `test_nothing_lost[kind]`
(every file that was in the case folder before the run is still there, byte for byte).

docs/bad-inputs.md is generated from the same table and the real outputs (`python tests/test_bad_inputs.py
--regen`); `test_docs_table_is_current` fails when it drifts.

Speed: a fresh `python -m finetune train` spends seconds importing torch before it reaches the bad input. The
cases therefore run in processes forked from one server that has imported `finetune.train.loop` once: each case is
still its own process running `python -m finetune ARGS` (runpy), with its own cwd, stdout, stderr and exit
status. Set FINETUNE_TEST_PLAIN_CLI=1 to run every case as a plain subprocess instead (same results, slower).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_server import CliServer, forking
from conftest import QUICKSTART_YAML, REPO_ROOT, TOKENIZER_DIR, python_path
from vision_fixtures import bomb_png

from finetune.recipe import deep_merge

DOCS = REPO_ROOT / "docs" / "bad-inputs.md"
CASE_TIMEOUT_S = 120
# Offline: a hub dataset name must fail at once, never wait on the network.
# Its own FINETUNE_HOME: a `recipes` case must never touch the user's registry of recipe repositories.
CLI_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
           "FINETUNE_HOME": tempfile.mkdtemp(prefix="finetune-bad-inputs-home-")}


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


GOOD_ROWS = [chat(f"What is {i} + {i}?", str(2 * i)) for i in range(6)]


def jsonl(*rows: Any) -> str:
    """JSON lines; a str row is written verbatim (for malformed lines)."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD = jsonl(*GOOD_ROWS)
TOOL_ROW = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "content": "18 C"},
                         {"role": "assistant", "content": "18 C in Paris."}]}


def with_arguments(row: dict, arguments: Any) -> dict:
    """`row` with its first tool call's arguments replaced."""
    messages = [dict(m) for m in row["messages"]]
    messages[1]["tool_calls"] = [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]
    return {**row, "messages": messages}

IMAGE_ROW = {"messages": [{"role": "user", "content": [{"type": "image", "path": "cat.png"},
                                                      {"type": "text", "text": "What is this?"}]},
                          {"role": "assistant", "content": "A cat."}]}
# A 1x1 PNG: what a row's image part names, for a model that takes no images.
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415478"
                    "9c63f8cfc0000003010100c9fe92ef0000000049454e44ae426082")

# Rows whose images are in their `images` column (TRL's convention): image parts without a path take them in order.
COLUMN_ROW = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                           {"role": "assistant", "content": "A cat."}], "images": ["cat.png"]}
# A decompression bomb: 49 KB of PNG whose 400 million pixels would take gigabytes to decode.
BOMB_PNG = bomb_png(20000, 20000)
BOMB_ROW = {"messages": [COLUMN_ROW["messages"][0], {"role": "assistant", "content": [{"type": "text",
                                                                                     "text": "A cat."}]}],
            "images": [{"bytes": BOMB_PNG, "path": "cat.png"}]}
# Text-only rows in a parquet file beside BOMB_ROW (one column type: content as a list of parts).
PART_ROWS = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"What is {i} + {i}?"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": str(2 * i)}]}], "images": []}
             for i in range(6)]


# A tiny Llama's model directory as bytes, built without torch (a safetensors file is an 8-byte little-endian header
# length, a JSON header and the data: here zeros): the tests' tiny model (hidden 32, 2 layers, vocabulary 1024).
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "vocab_size": 1024, "tie_word_embeddings": True}
LLAMA_LAYER = {"input_layernorm.weight": [32], "post_attention_layernorm.weight": [32],
               "self_attn.q_proj.weight": [32, 32], "self_attn.k_proj.weight": [16, 32],
               "self_attn.v_proj.weight": [16, 32], "self_attn.o_proj.weight": [32, 32],
               "mlp.gate_proj.weight": [64, 32], "mlp.up_proj.weight": [64, 32], "mlp.down_proj.weight": [32, 64]}
TINY_LLAMA_SHAPES = {"model.embed_tokens.weight": [1024, 32], "model.norm.weight": [32],
                     **{f"model.layers.{i}.{name}": shape for i in range(2) for name, shape in LLAMA_LAYER.items()}}


def safetensors_bytes(shapes: dict[str, list[int]]) -> bytes:
    """A valid safetensors file of float32 zeros holding tensors of these names and shapes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset += 4 * math.prod(shape)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(offset)


TINY_WEIGHTS = safetensors_bytes(TINY_LLAMA_SHAPES)
PRETRAINED = {"model": {"init": "pretrained", "path": "{d}/model", "config": None}}


def tiny_model(weights: bytes) -> dict[str, str | bytes]:
    """A case's files: the tiny Llama's model directory at {d}/model, with these model.safetensors bytes."""
    return {"model/config.json": json.dumps(TINY_LLAMA), "model/model.safetensors": weights}


def parquet(*rows: dict) -> bytes:
    """A parquet file of `rows` (an image column's bytes, as parquet and hub datasets keep them)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(list(rows)), out)
    return out.getvalue()

# The billion laughs under model.config: nine levels of ten aliases each, 10^9 values in under 1 KB.
ALIAS_BOMB = "model:\n  config:\n    l0: &l0 [" + ", ".join(["lol"] * 10) + "]\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9))
JINJA_CONFIG = ("base_model: org/model\nchat_template: jinja\nchat_template_jinja: {}\n"
                "datasets:\n  - {{path: data.jsonl, type: chat_template}}\n")

# GRPO from prompt rows (generation: the bad row is found before any is generated), and from a replay file.
GRPO_PROMPTS = {"datasets": [{"path": "train.jsonl", "format": "prompt"}], "data": {"packing": False},
                "train": {"objective": "grpo"},
                "grpo": {"num_generations": 2, "max_new_tokens": 4, "rewards": [{"function": "exact_answer"}]}}
PROMPT_ROW = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}
GRPO_REPLAY = {"datasets": [], "data": {"packing": False}, "train": {"objective": "grpo"},
               "grpo": {"replay": "replay.jsonl", "num_generations": 2}}
GRPO_OWN_REWARD = deep_merge(GRPO_PROMPTS, {"grpo": {"rewards": [{"function": "my_rewards:score"}]}})
# A shared recipe (the user's recipe extends it) that names a standard-library callable and tries to allow it itself.
SHARED_CODE = (f"extends: {QUICKSTART_YAML}\nallow_code: true\ngrpo:\n  rewards: [{{function: 'pty:spawn'}}]\n")
ROLLOUT = {"group": 0, "prompt_ids": [5, 6], "completion_ids": [7, 2], "reward": 1.0}
ROLLOUT_1 = {**ROLLOUT, "group": 1, "reward": 0.0}

# A reward model (train.objective: reward) on preference pairs.
REWARD_MODEL = {"datasets": [{"path": "train.jsonl", "format": "preference"}], "train": {"objective": "reward"}}
PAIR_ROW = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5", "margin": 1.0}

# The quickstart, shrunk: every case starts from this (deep-merged with the case's patch; lists replaced).
DISTILL_OFFLINE = {"train": {"objective": "distill"}, "distill": {"teacher_logprobs": "teacher"}}


def stored_teacher(positions: int, values: tuple[float, ...]) -> list[list[dict]]:
    """A stored teacher field (Axolotl's first layout) of `positions` entries, each ids 5, 6, ... with `values`."""
    return [[{"token": f"token_id:{5 + i}", "logprob": v} for i, v in enumerate(values)]] * positions


STORED_ROWS = [{**row, "teacher": stored_teacher(10, (-0.5, -1.5))} for row in GOOD_ROWS]  # rows that fit


BASE: dict[str, Any] = {
    "extends": str(QUICKSTART_YAML),
    "output_dir": "{d}/out",
    "model": {"config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}},
    "datasets": [{"path": "train.jsonl", "format": "chat"}],
    "eval_datasets": [],
    "data": {"max_seq_len": 128, "packing_check": False},
    "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 1, "warmup_steps": 0},
    "eval": {"at_start": False, "every_steps": None},
}

@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    """What is wrong, in words (the docs table)."""
    stage: str
    """Where it is caught: recipe (before torch is imported), output_dir, data, model, checkpoint, train (at the
    start of training: a warning; while training: a streamed row), rollouts (making a GRPO step's rollouts),
    convert (`finetune convert axolotl`), recipes (`finetune recipes add`), runs (a command that reads a finished run: `finetune runs compare`)."""
    expect: tuple[str, ...]
    """Substrings of stderr ({d} is the case folder): the key or file:line, and the fix."""
    patch: dict[str, Any] = field(default_factory=dict)
    recipe_text: str | None = None
    """Verbatim recipe text instead of BASE + patch (YAML errors; {d} is the case folder)."""
    files: dict[str, str | bytes] = field(default_factory=dict)
    """Files in the case folder; train.jsonl holds GOOD rows unless given here."""
    args: tuple[str, ...] = ()
    command: str = "train"
    recipe_name: str = "recipe.yaml"
    overwrite: bool = True
    exit_code: int = 2
    stdout_expect: tuple[str, ...] = ()
    argv: tuple[str, ...] | None = None
    """The whole command line after `finetune` ({d} is the case folder), for commands that take no recipe."""
    marked: bool = True
    """The output_dir's earlier run carries finetune's marker (False: the files are another tool's)."""
    library_report: bool = False
    """A library's own report comes before the error (transformers' LOAD REPORT of a mismatched tensor): the error
    is then the last thing said, not the first."""


CASES = [
    # --- the recipe: caught by `finetune.recipe` before torch is imported --------------------------------
    Case("unknown_key", "unknown top-level key `trian`", "recipe",
         ("{d}/recipe.yaml: 1 problem in the recipe:", "trian: unknown key; did you mean 'train'?"),
         patch={"trian": {"lr": 0.1}}),
    Case("misspelt_nested_key", "misspelt nested key `data.max_seq_length`", "recipe",
         ("data.max_seq_length: unknown key; did you mean 'max_seq_len'?",),
         patch={"data": {"max_seq_length": 64}}),
    Case("misspelt_dataset_key", "misspelt key in a datasets entry (`fromat`)", "recipe",
         ("datasets.0.fromat: unknown key; did you mean 'format'?",),
         patch={"datasets": [{"path": "train.jsonl", "fromat": "chat"}]}),
    Case("mistral_common_with_template", "tokenizer.backend mistral_common with a Jinja chat template", "recipe",
         ("tokenizer.chat_template: not with tokenizer.backend: mistral_common, which encodes conversations itself",),
         patch={"tokenizer": {"backend": "mistral_common", "chat_template": "chatml"}}),
    Case("wrong_type", "a string where an integer goes", "recipe",
         ('train.micro_batch_size: got "four"; input should be a valid integer',),
         patch={"train": {"micro_batch_size": "four"}}),
    Case("bad_enum", "a value outside a fixed set", "recipe",
         ("train.lr_scheduler: got \"cosin\"; allowed: 'cosine', 'linear' or 'constant'",),
         patch={"train": {"lr_scheduler": "cosin"}}),
    Case("negative_lr", "negative learning rate", "recipe",
         ("train.lr: got -0.0001; input should be greater than 0",), patch={"train": {"lr": -1e-4}}),
    Case("several_problems", "three problems at once: all reported, counted", "recipe",
         ("{d}/recipe.yaml: 3 problems in the recipe:", "train.lrr: unknown key", "data.packing: got \"maybe\"",
          "model.dtype: got \"fp8\""),
         patch={"train": {"lrr": 1}, "data": {"packing": "maybe"}, "model": {"dtype": "fp8"}}),
    Case("missing_dataset_path", "a datasets entry without `path`", "recipe",
         ("datasets.0.path: required, but missing",), patch={"datasets": [{"format": "chat"}]}),
    Case("packing_without_max_seq_len", "packing on, max_seq_len null", "recipe",
         ("data.max_seq_len: packing needs a row length; set data.max_seq_len or data.packing: false",),
         patch={"data": {"max_seq_len": None}}),
    Case("yaml_syntax_error", "YAML syntax error (bad indentation)", "recipe",
         ("{d}/recipe.yaml:4:9: YAML syntax error: mapping values are not allowed here",
          "check the indentation of this line and the one above"),
         recipe_text="output_dir: out\ntrain:\n lr: 1\n  epochs: 2\n"),
    Case("yaml_tab", "a tab used for indentation", "recipe",
         ("{d}/recipe.yaml:2:1: YAML syntax error:", "indent with spaces, not tabs"),
         recipe_text="train:\n\tlr: 1\n"),
    Case("duplicate_key", "the same key twice (the second would silently win)", "recipe",
         ("{d}/recipe.yaml:3:1: YAML error: duplicate key 'train' (first written on line 1)",),
         recipe_text="train: {lr: 0.1}\nseed: 1\ntrain: {epochs: 2}\n"),
    Case("missing_recipe", "the recipe file does not exist", "recipe",
         ("recipe file not found: {d}/nope.yaml",), recipe_name="nope.yaml"),
    Case("extends_cycle", "`extends:` cycle a -> b -> a", "recipe",
         ("extends cycle: {d}/recipe.yaml -> {d}/b.yaml -> {d}/recipe.yaml",),
         patch={"extends": "b.yaml"}, files={"b.yaml": "extends: recipe.yaml\n"}),
    Case("missing_parent_recipe", "`extends:` names a missing file", "recipe",
         ("recipe file not found: {d}/base.yaml (extended from {d}/recipe.yaml)",),
         patch={"extends": "base.yaml"}),
    Case("resume_missing_checkpoint", "`resume:` points at a missing checkpoint", "recipe",
         ("resume: checkpoint '{d}/out/checkpoints/step-9' does not exist",),
         patch={"resume": "{d}/out/checkpoints/step-9"}),
    Case("bad_override_syntax", "an override without `=`", "recipe",
         ("override 'train.lr': expected key.path=value, e.g. train.lr=1e-4",), args=("train.lr",)),
    Case("bad_override_index", "an override indexing a missing datasets entry", "recipe",
         ("override 'datasets.3.path=x.jsonl': datasets.3 needs an index 0..0",), args=("datasets.3.path=x.jsonl",)),
    Case("validate_bad_recipe", "`finetune validate` of a bad recipe", "recipe",
         ("train.lrr: unknown key; did you mean 'lr'?",), patch={"train": {"lrr": 1}}, command="validate"),
    Case("streaming_without_max_steps", "`data.streaming` without train.max_steps", "recipe",
         ("train.max_steps: required with data.streaming: a streamed dataset's length is unknown until it has been "
          "read, so the run (and its learning-rate schedule) is max_steps optimizer steps long",),
         patch={"data": {"streaming": True}, "train": {"max_steps": None, "epochs": 1}}),
    Case("streaming_preference_data", "`data.streaming` with preference data (train.objective dpo)", "recipe",
         ("train.objective: dpo is not streamed (data.streaming trains sft on chat, alpaca or completion rows, packed "
          "as they come; preference pairs, prompts and teachers are preprocessed)",),
         patch={"data": {"streaming": True}, "train": {"objective": "dpo", "epochs": None},
                "datasets": [{"path": "train.jsonl", "format": "preference"}]},
         files={"train.jsonl": jsonl(PAIR_ROW)}),
    Case("streaming_with_val_fraction", "`data.streaming` with data.val_fraction", "recipe",
         ("data.val_fraction: a held-out split needs every row counted before training, which data.streaming never "
          "does; give eval_datasets instead",),
         patch={"data": {"streaming": True, "val_fraction": 0.1}, "train": {"epochs": None}}),
    Case("streaming_with_epochs", "`data.streaming` with train.epochs 2", "recipe",
         ("train.epochs: 2, and with data.streaming the run is train.max_steps steps long",),
         patch={"data": {"streaming": True}}),
    # --- the output directory --------------------------------------------------------------------------
    Case("output_dir_holds_a_run", "output_dir already holds a run (no resume, no --overwrite)", "output_dir",
         ("output_dir {d}/out already holds a run (metrics.jsonl)", "--overwrite"), overwrite=False),
    Case("output_dir_not_writable", "output_dir under a regular file", "output_dir",
         ("output_dir {d}/blocker/out is not writable",),
         patch={"output_dir": "{d}/blocker/out"}, files={"blocker": "a regular file\n"}),
    Case("output_dir_holds_foreign_files", "output_dir holds another tool's recipe.yaml and checkpoints/ "
         "(no marker), with --overwrite", "output_dir",
         ("output_dir {d}/out holds metrics.jsonl, recipe.yaml, checkpoints, which no finetune run there claims",
          "finetune never writes over or removes files that are not its own, with or without --overwrite"),
         patch={"checkpoint": {"every_steps": 1}}, marked=False,
         files={"out/recipe.yaml": "the user's own recipe\n", "out/checkpoints/step-1/weights.bin": b"\x00" * 64}),
    Case("resume_auto_nothing_to_resume", "resume: auto, and the run in output_dir has no checkpoint", "output_dir",
         ("resume: auto found nothing to resume in output_dir {d}/out: no checkpoint (the run stopped before "
          "writing its first one); it holds metrics.jsonl of run earlier-run. Nothing was deleted.",
          "add --overwrite", "choose a new output_dir"),
         patch={"resume": "auto"}, overwrite=False),
    Case("resume_auto_damaged_checkpoint", "resume: auto, and the only checkpoint fails its manifest", "checkpoint",
         ("resume: auto found nothing to resume in output_dir {d}/out: 1 checkpoint(s) in {d}/out/checkpoints "
          "(step-1), none of which verifies (each named above)",),
         patch={"resume": "auto", "checkpoint": {"every_steps": 1}}, overwrite=False,
         files={"out/checkpoints/step-1/COMPLETE": '{"step": 1, "manifest": "manifest.json"}',
                "out/checkpoints/step-1/trainer_state.json": "{}",
                "out/checkpoints/step-1/manifest.json": json.dumps({"format": 1, "files": {
                    "trainer_state.json": {"size": 10, "sha256": "0" * 64}}})},
         stdout_expect=("skipping checkpoint {d}/out/checkpoints/step-1: trainer_state.json is truncated or "
                        "unreadable (2 bytes; the manifest records 10)",)),
    # --- data files and rows ----------------------------------------------------------------------------
    Case("missing_data_file", "a data file that does not exist", "data",
         ("datasets.0.path: data file not found: missing.jsonl",),
         patch={"datasets": [{"path": "missing.jsonl"}]}),
    Case("hub_dataset_offline", "a hub dataset name, offline", "data",
         ("datasets.0.path: dataset 'no-such-org/no-such-dataset': not a local file",),
         patch={"datasets": [{"path": "no-such-org/no-such-dataset"}]}),
    Case("malformed_json_line", "a malformed JSON line", "data",
         ("{d}/train.jsonl:3: malformed JSON: Expecting value at column 15", "data.on_bad_row: skip"),
         files={"train.jsonl": jsonl(*GOOD_ROWS[:2], '{"messages": [', *GOOD_ROWS[2:])}),
    Case("json_line_not_object", "a JSON line that is a list, not an object", "data",
         ("{d}/train.jsonl:2: expected a JSON object, got list",),
         files={"train.jsonl": jsonl(GOOD_ROWS[0], [1, 2], *GOOD_ROWS[1:])}),
    Case("non_utf8_line", "non-UTF-8 bytes in a data line", "data",
         ("{d}/train.jsonl:2: not valid UTF-8",),
         files={"train.jsonl": GOOD.encode().replace(b"What is 1", b"What is \xff", 1)}),
    Case("json_line_too_deep", "a JSON line nested past Python's recursion limit", "data",
         ("{d}/train.jsonl:2: JSON nested too deeply to read (past Python's recursion limit)", "data.on_bad_row: skip"),
         files={"train.jsonl": jsonl(GOOD_ROWS[0], '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                     *GOOD_ROWS[1:])}),
    Case("missing_messages_field", "a chat row without `messages`", "data",
         ("{d}/train.jsonl:1: missing field 'messages' (fields present: conversation)",),
         files={"train.jsonl": jsonl({"conversation": GOOD_ROWS[0]["messages"]}, *GOOD_ROWS)}),
    Case("unknown_role", "a message with an unknown role", "data",
         ("{d}/train.jsonl:2: message 1 has unknown role 'bot'; allowed: system, user, assistant",),
         files={"train.jsonl": jsonl(GOOD_ROWS[0], {"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "bot", "content": "hello"}]})}),
    Case("distill_logprobs_missing", "offline distillation rows without the stored teacher", "data",
         ("{d}/train.jsonl:1: distill.teacher_logprobs: the field 'teacher' is missing",),
         patch=DISTILL_OFFLINE),
    Case("distill_logprobs_over_one", "stored teacher log-probabilities that sum to more than 1", "data",
         ("{d}/train.jsonl:1: teacher[", "its probabilities sum to 1.7", "over 1"), patch=DISTILL_OFFLINE,
         files={"train.jsonl": jsonl({**GOOD_ROWS[0], "teacher": stored_teacher(10, (-0.1, -0.2))}, *STORED_ROWS[1:])}),
    Case("distill_logprobs_short", "a trained token without a stored teacher entry", "data",
         ("{d}/train.jsonl:1: token ", "is trained, and teacher has no entry for it"), patch=DISTILL_OFFLINE,
         files={"train.jsonl": jsonl({**GOOD_ROWS[0], "teacher": stored_teacher(1, (-0.5, -1.5))}, *STORED_ROWS[1:])}),
    Case("sharegpt_row", "a ShareGPT row ({from, value}) read as chat", "data",
         ("{d}/train.jsonl:1: message 0 looks like ShareGPT",),
         files={"train.jsonl": jsonl({"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})}),
    Case("empty_conversation", "an empty conversation", "data",
         ("{d}/train.jsonl:4: empty conversation",),
         files={"train.jsonl": jsonl(*GOOD_ROWS[:3], {"messages": []})}),
    Case("no_assistant_turn", "a conversation with no assistant turn", "data",
         ("{d}/train.jsonl:1: no assistant turn, so nothing to train on",),
         files={"train.jsonl": jsonl({"messages": [{"role": "user", "content": "hi"}]}, *GOOD_ROWS)}),
    Case("content_not_string", "message content that is not a string", "data",
         ("{d}/train.jsonl:1: message 1 (assistant) needs a string 'content'",),
         files={"train.jsonl": jsonl({"messages": [{"role": "user", "content": "2+2"},
                                                   {"role": "assistant", "content": 4}]})}),
    Case("image_missing", "an image part whose file does not exist", "data",
         ("{d}/train.jsonl:1: message 0, part 0 (image): 'cat.png' is not a file",),
         files={"train.jsonl": jsonl(IMAGE_ROW, *GOOD_ROWS)}),
    Case("image_with_text_model", "a row with an image, for a text-only model", "data",
         ("{d}/train.jsonl:1: this row has images, and the model is not a vision-language model finetune trains",
          "docs/vision.md"),
         files={"train.jsonl": jsonl(IMAGE_ROW, *GOOD_ROWS), "cat.png": PNG}),
    Case("image_column_count", "more image parts than images in the row's `images` column", "data",
         ("{d}/train.jsonl:1: message 0, part 1 (image) has no path and the row's 'images' holds 1 images: more "
          "image parts than images",),
         files={"train.jsonl": jsonl({**COLUMN_ROW, "messages": [
             {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}, COLUMN_ROW["messages"][1]]},
             *GOOD_ROWS), "cat.png": PNG}),
    Case("image_column_unused", "an `images` column on a row without image parts", "data",
         ("{d}/train.jsonl:2: the row's 'images' holds 1 images and its messages have no image parts",),
         files={"train.jsonl": jsonl(GOOD_ROWS[0], {**GOOD_ROWS[1], "images": ["cat.png"]}), "cat.png": PNG}),
    Case("image_column_url", "an image URL in the `images` column", "data",
         ("{d}/train.jsonl:1: images[0] is 'https://example.com/cat.png': remote images are not supported; "
          "download them",),
         files={"train.jsonl": jsonl({**COLUMN_ROW, "images": ["https://example.com/cat.png"]}, *GOOD_ROWS)}),
    Case("image_column_not_image", "an `images` entry whose bytes are not an image (parquet)", "data",
         ("{d}/train.parquet[row 0]: images[0]: 9 bytes that are not an image PIL can read",),
         patch={"datasets": [{"path": "train.parquet", "format": "chat"}]},
         files={"train.parquet": parquet({"messages": [COLUMN_ROW["messages"][0], {"role": "assistant", "content": [
             {"type": "text", "text": "A cat."}]}], "images": [{"bytes": b"not a png", "path": "cat.png"}]})}),
    Case("image_decompression_bomb", "an image part naming a decompression bomb (a 49 KB PNG of 20000 x 20000 "
         "pixels)", "data",
         ("{d}/train.jsonl:1: message 0, part 0 (image): the image {d}/cat.png is 20000x20000 (400,000,000 "
          "pixels), over data.max_image_pixels (50,000,000); resize it, or raise data.max_image_pixels",),
         files={"train.jsonl": jsonl(IMAGE_ROW, *GOOD_ROWS), "cat.png": BOMB_PNG}),
    Case("image_bomb_parquet", "a decompression bomb as an `images` entry's bytes (parquet)", "data",
         ("{d}/train.parquet[row 0]: images[0]: the image is 20000x20000 (400,000,000 pixels), over "
          "data.max_image_pixels (50,000,000)",),
         patch={"datasets": [{"path": "train.parquet", "format": "chat"}]},
         files={"train.parquet": parquet(BOMB_ROW)}),
    Case("image_bomb_parquet_skipped", "a decompression bomb in a parquet `images` column with on_bad_row: skip: "
         "the run goes on", "data", (),
         patch={"datasets": [{"path": "train.parquet", "format": "chat"}], "data": {"on_bad_row": "skip"},
                "tokenizer": {"chat_template": "qwen2_vl"}, "output_dir": "{d}/fresh"},
         files={"train.parquet": parquet(PART_ROWS[0], BOMB_ROW, *PART_ROWS[1:])},
         exit_code=0, stdout_expect=("1 bad rows skipped", "done: {d}/fresh/final")),
    Case("images_on_alpaca", "an `images` column on an alpaca row", "data",
         ("{d}/train.jsonl:1: the row has 1 images in 'images'; images are read in chat rows (format: chat) only, "
          "and this dataset's format is alpaca",),
         patch={"datasets": [{"path": "train.jsonl", "format": "alpaca"}]},
         files={"train.jsonl": jsonl({"instruction": "Say hi", "output": "hi", "images": ["cat.png"]}),
                "cat.png": PNG}),
    Case("alpaca_missing_output", "an alpaca row without `output`", "data",
         ("{d}/train.jsonl:2: alpaca rows need a string 'output' (fields present: input, instruction)",),
         patch={"datasets": [{"path": "train.jsonl", "format": "alpaca"}]},
         files={"train.jsonl": jsonl({"instruction": "Say hi", "output": "hi"},
                                     {"instruction": "Add", "input": "2 and 3"})}),
    Case("completion_missing_text", "a completion row without `text`", "data",
         ("{d}/train.jsonl:1: completion rows need a non-empty string field 'text' (fields present: content)",),
         patch={"datasets": [{"path": "train.jsonl", "format": "completion"}]},
         files={"train.jsonl": jsonl({"content": "once upon a time"})}),
    Case("streamed_bad_row", "a malformed row in a streamed dataset, met as training reads it", "train",
         ("{d}/train.jsonl:4: malformed JSON", "Fix the row, or set data.on_bad_row: skip"),
         # Read once the run has started (data.streaming), which replaces an earlier one.
         patch={"data": {"streaming": True}, "train": {"epochs": None}, "output_dir": "{d}/fresh"},
         files={"train.jsonl": jsonl(*GOOD_ROWS[:3], '{"messages": [')}),
    Case("csv_missing_column", "a CSV without the needed column", "data",
         ("{d}/train.csv:2: alpaca rows need a string 'output' (fields present: instruction, response)",),
         patch={"datasets": [{"path": "train.csv", "format": "alpaca"}]},
         files={"train.csv": "instruction,response\nSay hi,hi\n"}),
    Case("csv_extra_values", "a CSV row with more values than the header", "data",
         ("{d}/train.csv:3: 1 more values than the header's 2 columns",),
         patch={"datasets": [{"path": "train.csv", "format": "alpaca"}]},
         files={"train.csv": "instruction,output\nSay hi,hi\nAdd 2, 3,5\n"}),
    Case("every_label_masked", "every answer truncated away: no target tokens", "data",
         ("datasets: the training data ({d}/train.jsonl) has no target tokens", "data.max_seq_len"),
         patch={"data": {"max_seq_len": 8}},
         files={"train.jsonl": jsonl(chat("word " * 30, "ok"), chat("more " * 30, "fine"))}),
    Case("all_rows_skipped", "on_bad_row: skip, and every row is bad", "data",
         ("datasets: no training samples in {d}/train.jsonl: 2 rows read, 2 bad rows skipped",),
         patch={"data": {"on_bad_row": "skip"}}, files={"train.jsonl": jsonl({"x": 1}, {"messages": []})}),
    Case("val_fraction_takes_everything", "val_fraction leaves no training rows", "data",
         ("data.val_fraction: 0.5 of 1 training rows leaves none to train on",),
         patch={"data": {"val_fraction": 0.5}}, files={"train.jsonl": jsonl(GOOD_ROWS[0])}),
    Case("batch_larger_than_data", "micro batch x accumulation > the data, with drop_last: true", "data",
         ("one optimizer step needs 16 rows but an epoch has only 6", "data.drop_last: false"),
         patch={"data": {"drop_last": True, "packing": False},
                "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 4}}),
    # --- rows that were dropped silently or killed the run (issue 22) ----------------------------------------
    Case("lone_surrogate", "a JSON-escaped lone surrogate (`\\ud800`) in a message", "data",
         ("{d}/train.jsonl:2: the tokenizer cannot encode this row: the text holds a lone surrogate '\\ud800'",
          "data.on_bad_row: skip"),
         files={"train.jsonl": jsonl(GOOD_ROWS[0], chat("half a pair: \ud800", "ok"), *GOOD_ROWS[1:])}),
    Case("lone_surrogate_skipped", "a lone surrogate with on_bad_row: skip: the run goes on", "data", (),
         patch={"data": {"on_bad_row": "skip"}, "output_dir": "{d}/fresh"},
         files={"train.jsonl": jsonl(GOOD_ROWS[0], chat("half a pair: \ud800", "ok"), *GOOD_ROWS[1:])},
         exit_code=0, stdout_expect=("1 bad rows skipped", "done: {d}/fresh/final")),
    Case("row_over_max_row_bytes", "a row larger than data.max_row_bytes", "data",
         ("{d}/train.jsonl:3: the row is 2,086 bytes, over data.max_row_bytes (1,000); it was not read",),
         patch={"data": {"max_row_bytes": 1000}},
         files={"train.jsonl": jsonl(*GOOD_ROWS[:2], chat("x" * 2000, "y"), *GOOD_ROWS[2:])}),
    Case("json_array_item_malformed", "a malformed item in a .json array (read as a stream)", "data",
         ("{d}/train.json:4: malformed JSON: Expecting ':' delimiter at column 6",),
         patch={"datasets": [{"path": "train.json"}]},
         files={"train.json": "[\n" + ",\n".join(json.dumps(r) for r in GOOD_ROWS[:2]) + ',\n{"a" 1}\n]\n'}),
    Case("json_array_item_too_large", "a .json array item of over 8 x data.max_row_bytes of JSON text", "data",
         ("{d}/train.json:2: an item of over 8,000 characters of JSON, over 8 x data.max_row_bytes (8,000)",
          "raise the limit"),
         patch={"datasets": [{"path": "train.json"}], "data": {"max_row_bytes": 1000}},
         files={"train.json": "[" + json.dumps(GOOD_ROWS[0]) + ',\n{"n": [' + "1," * 5000 + "1]}]"}),
    Case("json_data_key_twice", 'a second `data` key after the list of a .json {"data": [...]} file', "data",
         ("{d}/train.json:2: malformed JSON: a second 'data' key after the first one's list was read at column 2",),
         patch={"datasets": [{"path": "train.json"}]},
         files={"train.json": json.dumps({"data": GOOD_ROWS[:2]}).rstrip("}") + ',\n "data": []}'}),
    Case("unknown_message_field", "a message field finetune does not read", "data",
         ("{d}/train.jsonl:2: message 1 (assistant) has 'metadata', which finetune does not read",
          "data.ignore_message_fields"),
         files={"train.jsonl": jsonl(GOOD_ROWS[0], {"messages": [GOOD_ROWS[1]["messages"][0],
                                                                 {**GOOD_ROWS[1]["messages"][1], "metadata": "x"}]})}),
    Case("empty_assistant_message", "an empty trained assistant message", "data",
         ("{d}/train.jsonl:2: message 1 (assistant) is empty (no content, reasoning or tool_calls)",
          '"train": false'),
         files={"train.jsonl": jsonl(GOOD_ROWS[0], chat("Say nothing", ""), *GOOD_ROWS[1:])}),
    Case("tool_calls_not_rendered", "tool calls, with a template that does not render them", "data",
         ("{d}/train.jsonl:1: the chat template does not render the tool_calls of message 1",
          "tokenizer.chat_template"),
         files={"train.jsonl": jsonl(TOOL_ROW, *GOOD_ROWS)}),
    Case("tool_call_arguments_not_json", "tool call arguments that are text but not JSON", "data",
         ("{d}/train.jsonl:1: message 1 (assistant): tool call 0 (get_weather): 'arguments' is a string that is not "
          "JSON",), patch={"tokenizer": {"chat_template": "qwen2_5"}},
         files={"train.jsonl": jsonl(with_arguments(TOOL_ROW, "{city: Paris}"), *GOOD_ROWS)}),
    Case("tools_not_rendered", "a row's tools, with a template that does not render them", "data",
         ("{d}/train.jsonl:1: the chat template does not render the row's tools",),
         files={"train.jsonl": jsonl({**GOOD_ROWS[0], "tools": TOOL_ROW["tools"]}, *GOOD_ROWS)}),
    Case("tool_calls_trained", "tool calls and tool messages with a template that renders them: the run goes on",
         "data", (), patch={"tokenizer": {"chat_template": "qwen2_5"}, "data": {"max_seq_len": 512},
                            "output_dir": "{d}/fresh"},
         files={"train.jsonl": jsonl(TOOL_ROW, *GOOD_ROWS)}, exit_code=0, stdout_expect=("done: {d}/fresh/final",)),
    # --- model and tokenizer paths -----------------------------------------------------------------------
    Case("tokenizer_path_missing", "tokenizer.path, a local path, does not exist", "recipe",
         ("tokenizer.path: {d}/no-tokenizer does not exist (a local path: a relative one is looked up next to the "
          "recipe file, then in the current directory, {d}); a hub model is named ORG/NAME",),
         patch={"tokenizer": {"path": "{d}/no-tokenizer"}}),
    Case("model_path_missing", "model.path, a local path, does not exist", "recipe",
         ("model.path: {d}/no-model does not exist (a local path",),
         patch={"model": {"init": "pretrained", "path": "{d}/no-model"}}),
    Case("model_safetensors_truncated", "model.path's model.safetensors cut in half (an interrupted download or "
         "copy)", "model",
         ("model.path: {d}/model/model.safetensors is truncated: its header says the file holds 207,677 bytes, but "
          "it has 103,838. Re-download or re-save the model, or set model.path to another model directory.",),
         patch=PRETRAINED, files=tiny_model(TINY_WEIGHTS[:len(TINY_WEIGHTS) // 2])),
    Case("model_safetensors_not_safetensors", "model.path's model.safetensors is an HTML page (a download that "
         "saved an error page)", "model",
         ("model.path: {d}/model/model.safetensors is not a safetensors file: its first 8 bytes give a header length "
          "of 5,789,751,444,030,890,300 bytes (safetensors allows at most 100,000,000)",),
         patch=PRETRAINED, files=tiny_model(b"<!DOCTYPE html><html><body>Sign in to continue</body></html>\n")),
    Case("model_tensor_wrong_shape", "model.path's model.safetensors holds a tensor of another shape than its "
         "config.json makes it", "model",
         ("model.path: {d}/model/model.safetensors holds model.layers.0.self_attn.q_proj.weight of shape [32, 16], "
          "but {d}/model/config.json makes it [32, 32]",),
         patch=PRETRAINED,
         files=tiny_model(safetensors_bytes({**TINY_LLAMA_SHAPES, "model.layers.0.self_attn.q_proj.weight": [32, 16]})),
         library_report=True),
    Case("model_path_missing_relative", "model.path `runs/x/final` (two slashes: no hub id) does not exist", "recipe",
         ("model.path: runs/x/final does not exist (a local path",),
         patch={"model": {"init": "pretrained", "path": "runs/x/final"}}),
    Case("resume_not_a_checkpoint", "`resume:` points at a folder that is not a checkpoint", "checkpoint",
         ("resume: checkpoint {d}/out cannot be used",), patch={"resume": "{d}/out"}),
    # --- bad rows skipped on request: the run goes on --------------------------------------------------
    Case("bad_rows_skipped", "on_bad_row: skip with two bad rows: the run goes on", "data", (),
         patch={"data": {"on_bad_row": "skip"}, "output_dir": "{d}/fresh"},
         files={"train.jsonl": jsonl(*GOOD_ROWS[:3], '{"messages": [', {"messages": []}, *GOOD_ROWS[3:])},
         exit_code=0, stdout_expect=("2 bad rows skipped", "done: {d}/fresh/final")),
    # --- hostile or odd inputs ----------------------------------------------------------------------------
    Case("yaml_alias_bomb", "a YAML alias bomb: 1 KB standing for 10^9 values", "recipe",
         ("{d}/recipe.yaml:8:9: YAML error: aliases (*name) expand this value to more than 1,000,000 values "
          "(an alias bomb?); a recipe needs a few hundred: write them out, or use fewer aliases",),
         recipe_text=ALIAS_BOMB, command="validate"),
    Case("yaml_nested_too_deep", "YAML nested 5000 levels deep", "recipe",
         ("{d}/recipe.yaml:1:107: YAML error: nested more than 100 levels deep; a recipe needs a few",),
         recipe_text="train: " + "[" * 5000 + "]" * 5000 + "\n"),
    Case("lr_infinite", "`train.lr=1e400` (YAML reads it as infinity)", "recipe",
         ("train.lr: got inf; must be a finite number (YAML reads a number beyond 1.8e308, such as 1e400, as "
          "infinity)",), args=("train.lr=1e400",)),
    Case("float_not_a_number", "`.nan` for a number", "recipe",
         ("train.weight_decay: got nan; must be a finite number",), args=("train.weight_decay=.nan",)),
    Case("seed_too_large", "a seed beyond 2^32 - 1", "recipe",
         ("seed: got 99999999999999999999; input should be less than or equal to 4294967295",),
         patch={"seed": 99999999999999999999}),
    Case("output_dir_name_too_long", "an output_dir folder name of 313 characters", "recipe",
         ("output_dir: a folder name of 313 bytes (xxxxxxxxxxxxxxxxxxxx...); file systems take at most 255 bytes "
          "per name: use a shorter one",), patch={"output_dir": "{d}/" + "x" * 313}),
    Case("accumulation_too_large", "`gradient_accumulation_steps: 1e9`", "recipe",
         ("train.gradient_accumulation_steps: got 1000000000.0; input should be less than or equal to 65536",),
         patch={"train": {"gradient_accumulation_steps": 1e9}}),
    Case("model_path_with_init_random", "`model.path` in a recipe extending the quickstart (`init: random`)",
         "recipe", ("model.path: set, but model.init is random, which ignores it (random weights from model.config; "
                    "init: random may come from a recipe this one extends, such as the quickstart); to train the "
                    "model at model.path, set model.init: pretrained",),
         patch={"model": {"path": "my/model"}}),
    Case("config_override_unknown_key", "`model.config_overrides` names a key the model's config does not have "
         "(a typo)", "model",
         ("model.config_overrides.attention_dropot: LlamaConfig has no key 'attention_dropot'; did you mean "
          "attention_dropout, attention_bias, num_attention_heads?",),
         patch={"model": {**PRETRAINED["model"], "config_overrides": {"attention_dropot": 0.1}}},
         files=tiny_model(TINY_WEIGHTS)),
    Case("config_overrides_with_init_random", "`model.config_overrides` with `init: random` (the quickstart's)",
         "recipe", ("model.config_overrides: only with init: pretrained; with init: random, model.config is the whole "
                    "config: write the keys there",),
         patch={"model": {"config_overrides": {"attention_dropout": 0.1}}}),
    Case("qat_fp4_in_float32", "`qat.weight_dtype: nvfp4` with float32 weights and no FP4 activations", "recipe",
         ("qat.activation_dtype: weight_dtype nvfp4 needs activation_dtype nvfp4, got null: torchao trains nvfp4 "
          "activations and weights together", "model.dtype: qat.weight_dtype nvfp4 computes in bfloat16"),
         patch={"qat": {"weight_dtype": "nvfp4"}}),
    Case("qat_group_size", "`qat.group_size` that does not divide the model's layers' input features", "model",
         ("qat.group_size: 48 does not divide the input features of 14 linear layer(s), e.g. "
          "layers.0.self_attn.q_proj (32); the layers' input sizes are 32, 64: use a group size that divides each, "
          "e.g. 32",),
         patch={"qat": {"weight_dtype": "int4", "group_size": 48}}),
    Case("deduplicate_with_grpo", "`data.deduplicate: exact` with train.objective grpo", "recipe",
         ("data.deduplicate: not with train.objective grpo (its prompt datasets are read as they are); remove "
          "duplicate prompts from the data",),
         patch=deep_merge(GRPO_PROMPTS, {"data": {"deduplicate": "exact"}}), files={"train.jsonl": jsonl(PROMPT_ROW)}),
    Case("step_larger_than_epoch", "one optimizer step takes more rows than an epoch has: a warning", "train", (),
         patch={"data": {"packing": False}, "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 4},
                "output_dir": "{d}/fresh"},
         exit_code=0, stdout_expect=("warning: one optimizer step takes 16 rows (train.micro_batch_size 4 x "
                                     "gradient_accumulation_steps 4) but an epoch has only 6 rows: each epoch is one "
                                     "step of 6 rows. gradient_accumulation_steps 1 or less fills every step",
                                     "done: {d}/fresh/final")),
    Case("convert_template_outside", "`convert axolotl` with `chat_template_jinja: /proc/self/environ`", "convert",
         ("{d}/config.yml: 1 problem converting the Axolotl config:", "chat_template_jinja: /proc/self/environ: a "
          "file outside the config's folder ({d}); its text would be copied into the recipe, so only files inside "
          "that folder are read. Copy the template next to the config, or pass --allow-template-path"),
         files={"config.yml": JINJA_CONFIG.format("/proc/self/environ")},
         argv=("convert", "axolotl", "{d}/config.yml", "-o", "{d}/converted.yaml")),
    Case("convert_template_binary", "`convert axolotl` with a binary `chat_template_jinja` file", "convert",
         ("chat_template_jinja: bin.jinja ({d}/bin.jinja): not UTF-8 text (byte 4 is 0xff): a binary file; "
          "chat_template_jinja takes Jinja text or a template file",),
         files={"config.yml": JINJA_CONFIG.format("bin.jinja"), "bin.jinja": b"\x7fELF\xff\x00"},
         argv=("convert", "axolotl", "{d}/config.yml", "-o", "{d}/converted.yaml")),
    Case("recipes_add_dash_url", "`recipes add` with a URL that git would read as an option", "recipes",
         ("URL_OR_DIR '--upload-pack=touch {d}/pwned;://x' starts with '-', which git would read as an option",),
         argv=("recipes", "add", "team", "--", "--upload-pack=touch {d}/pwned;://x")),
    # --- GRPO's prompt rows and replay lines, a run directory's recipe (issue 22) -----------------------------
    Case("grpo_prompt_lone_surrogate", "GRPO: a lone surrogate (`\\ud800`) in a prompt row", "data",
         ("{d}/train.jsonl:2: the tokenizer cannot encode this row: the text holds a lone surrogate '\\ud800'",
          "data.on_bad_row: skip"),
         patch=GRPO_PROMPTS, files={"train.jsonl": jsonl(PROMPT_ROW, {**PROMPT_ROW, "prompt": "half: \ud800"},
                                                         PROMPT_ROW)}),
    Case("grpo_prompt_over_max_row_bytes", "GRPO: a prompt row larger than data.max_row_bytes", "data",
         ("{d}/train.jsonl:3: the row is 2,029 bytes, over data.max_row_bytes (1,000); it was not read",),
         patch=deep_merge(GRPO_PROMPTS, {"data": {"max_row_bytes": 1000}}),
         files={"train.jsonl": jsonl(PROMPT_ROW, PROMPT_ROW, {**PROMPT_ROW, "prompt": "x" * 2000})}),
    Case("grpo_replay_id_outside_vocabulary", "GRPO replay: a completion id outside the vocabulary", "data",
         ("{d}/replay.jsonl:4: completion_ids holds id 4096, outside the tokenizer's vocabulary of 1024",),
         patch=GRPO_REPLAY, files={"replay.jsonl": jsonl(ROLLOUT, ROLLOUT, ROLLOUT_1,
                                                         {**ROLLOUT_1, "completion_ids": [7, 4096]})}),
    Case("grpo_replay_group_split", "GRPO replay: a group's lines not consecutive", "data",
         ("{d}/replay.jsonl:5: group 0 appears again after other groups; a group's lines are consecutive",),
         patch=GRPO_REPLAY, files={"replay.jsonl": jsonl(ROLLOUT, ROLLOUT, ROLLOUT_1, ROLLOUT_1, ROLLOUT, ROLLOUT)}),
    Case("grpo_replay_reward_not_finite", "GRPO replay: a reward that is NaN", "data",
         ("{d}/replay.jsonl:2: reward 'reward' is nan; rewards are finite numbers or null",),
         patch=GRPO_REPLAY, files={"replay.jsonl": jsonl(ROLLOUT, {**ROLLOUT, "reward": float("nan")})}),
    # --- code in recipes, GRPO's rewards and replay lines, odd values (issue 40) -------------------------------
    Case("reward_code_without_consent", "a recipe it extends names `pty:spawn` as a reward function (and sets "
         "`allow_code: true` itself): not run without the user's `--allow-code`", "recipe",
         ("this recipe names code that finetune would import and run, and running it has not been allowed:",
          "grpo.rewards.0.function: pty:spawn (from {d}/shared.yaml, extended by {d}/recipe.yaml)",
          "allow_code in {d}/shared.yaml was not counted", "pass --allow-code"),
         patch={**GRPO_PROMPTS, "grpo": {"num_generations": 2, "max_new_tokens": 4}, "extends": "shared.yaml"},
         files={"shared.yaml": SHARED_CODE, "train.jsonl": jsonl(PROMPT_ROW, PROMPT_ROW)}),
    Case("reward_reference_malformed", "a reward function `.rewards:score` (not module.path:function)", "recipe",
         ("grpo.rewards.0.function: got \".rewards:score\"; '.rewards:score' is not module.path:function (a relative "
          "module name (a leading '.'): give the module's full dotted name)",),
         patch=deep_merge(GRPO_PROMPTS, {"grpo": {"rewards": [{"function": ".rewards:score"}]}})),
    Case("reward_args_misspelt", "a built-in reward's misspelt argument (`length` with `targt`)", "recipe",
         ("grpo.rewards.0.args.targt: unknown key; did you mean 'target'?",),
         patch=deep_merge(GRPO_PROMPTS, {"grpo": {"rewards": [{"function": "length", "args": {"targt": 3}}]}})),
    Case("reward_model_path_missing", "the built-in `reward_model` reward naming a model that is not there",
         "recipe", ("grpo.rewards.0.args.path: {d}/no-such-run does not exist (a reward model run or model directory",),
         patch=deep_merge(GRPO_PROMPTS, {"grpo": {"rewards": [{"function": "reward_model",
                                                              "args": {"path": "{d}/no-such-run"}}]}})),
    Case("reward_objective_on_chat_data", "`train.objective: reward` on chat rows", "recipe",
         ("datasets.0.format: train.objective reward trains on pairs; use format: preference (prompt, chosen, "
          "rejected), not chat",),
         patch={"train": {"objective": "reward"}}),
    Case("reward_margin_not_a_number", "a preference row whose `margin` is not a number", "data",
         ("{d}/train.jsonl:2: 'margin' must be a finite number (a reward model's margin for the pair), got 'high'",),
         patch=REWARD_MODEL, files={"train.jsonl": jsonl(PAIR_ROW, {**PAIR_ROW, "margin": "high"})}),
    Case("reward_head_frozen", "`train.trainable_parameters` that leave a reward model's score head frozen", "model",
         ("train.trainable_parameters leaves the reward model's score head frozen; it must train (add a pattern "
          "matching it, e.g. '^score')",),
         patch=deep_merge(REWARD_MODEL, {"train": {"trainable_parameters": ["^model\\."]}}),
         files={"train.jsonl": jsonl(PAIR_ROW)}),
    Case("reward_module_syntax_error", "a reward module that does not parse, with `--allow-code`", "recipe",
         ("grpo.rewards.0.function: importing 'my_rewards' for 'my_rewards:score' raised SyntaxError: ",
          "({d}/my_rewards.py:1)"),
         patch=GRPO_OWN_REWARD, files={"my_rewards.py": "def score(:\n"}, args=("--allow-code",)),
    Case("reward_returns_a_string", "a reward function returning a string, not a list of numbers", "rollouts",
         ("reward function 'score' returned 'abc' (a str); expected a list of 2 numbers (one per completion; None "
          "for no opinion)",),
         patch={**GRPO_OWN_REWARD, "output_dir": "{d}/fresh"},  # a run that starts replaces an earlier one
         files={"my_rewards.py": "def score(prompts, completions, **kw):\n    return 'abc'\n",
                "train.jsonl": jsonl(PROMPT_ROW, PROMPT_ROW)}, args=("--allow-code",)),
    Case("grpo_prompt_unknown_role", "GRPO: a prompt message with an unknown role (as in SFT data)", "data",
         ("{d}/train.jsonl:2: message 0 has unknown role 'wizard'; allowed: system, user, assistant, tool "
          "(datasets[].role_map names other roles)",),
         patch=GRPO_PROMPTS, files={"train.jsonl": jsonl(PROMPT_ROW, {**PROMPT_ROW, "prompt": [
             {"role": "wizard", "content": "hi"}]})}),
    Case("grpo_replay_line_too_deep", "GRPO replay: a line nested 100,000 levels deep", "data",
         ("{d}/replay.jsonl:2: JSON nested too deeply to read (past Python's recursion limit)",),
         patch=GRPO_REPLAY, files={"replay.jsonl": jsonl(ROLLOUT, "[" * 100_000 + "]" * 100_000)}),
    Case("grpo_replay_rollout_too_long", "GRPO replay: a rollout longer than data.max_seq_len", "data",
         ("{d}/replay.jsonl:4: the rollout is 202 tokens (prompt 2 + completion 200), over data.max_seq_len (128)",
          "data.on_bad_row: skip"),
         patch=deep_merge(GRPO_REPLAY, {"grpo": {"max_new_tokens": 256}}),
         files={"replay.jsonl": jsonl(ROLLOUT, ROLLOUT, ROLLOUT_1, {**ROLLOUT_1, "completion_ids": [7] * 200})}),
    Case("tools_with_replay", "GRPO: `grpo.tools` with a replay file (whose rollouts are recorded already)", "recipe",
         ("grpo.tools / grpo.environment: they act in generated rollouts; a replay file's are recorded already",),
         patch=deep_merge(GRPO_REPLAY, {"grpo": {"tools": ["calc:multiply"]}}),
         files={"replay.jsonl": jsonl(ROLLOUT, ROLLOUT)}),
    Case("tool_without_docstring", "GRPO: a tool without the docstring its schema is made from, with `--allow-code`",
         "rollouts", ("grpo.tools.0: 'multiply' cannot be offered as a tool: DocstringParsingException",
                      "a tool needs type hints and a docstring with an Args: section"),
         patch=deep_merge(GRPO_PROMPTS, {"grpo": {"tools": ["calc:multiply"], "tool_call_format": "hermes"},
                                         "output_dir": "{d}/fresh"}),
         files={"calc.py": "def multiply(a: int, b: int) -> int:\n    return a * b\n",
                "train.jsonl": jsonl(PROMPT_ROW, PROMPT_ROW)}, args=("--allow-code",)),
    Case("environment_reset_fails", "GRPO: an environment whose reset() raises, with `--allow-code`", "rollouts",
         ("grpo.environment 'env:Broken' failed to start an episode for {d}/train.jsonl:",
          "KeyError: 'no task'"),
         patch=deep_merge(GRPO_PROMPTS, {"grpo": {"environment": "env:Broken", "tool_call_format": "hermes"},
                                         "output_dir": "{d}/fresh"}),
         files={"env.py": "class Broken:\n    def reset(self, **row):\n        raise KeyError('no task')\n",
                "train.jsonl": jsonl(PROMPT_ROW, PROMPT_ROW)}, args=("--allow-code",)),
    Case("output_dir_root", "`output_dir: /`, the file system's root", "recipe",
         ("output_dir: / is the file system's root (/); a run writes recipe.yaml, metrics.jsonl, checkpoints/ and "
          "final/ into its output_dir: give it a folder of its own",), patch={"output_dir": "/"}),
    Case("override_not_utf8", "an override whose value holds bytes that are not UTF-8", "recipe",
         ("override 'output_dir={d}/\\xff': it holds bytes that are not UTF-8 text; recipe values are UTF-8 (YAML), so "
          "quoting cannot help",), args=(os.fsdecode(b"output_dir={d}/\xff"),)),
    Case("run_recipe_alias_bomb", "`runs compare` of a run whose recipe.yaml is a YAML alias bomb", "runs",
         ("{d}/runa/recipe.yaml:8:9: cannot read the run's recipe (aliases (*name) expand this value to more than "
          "1,000,000 values (an alias bomb?)",),
         files={"runa/recipe.yaml": ALIAS_BOMB, "runa/metrics.jsonl": '{"step": 1, "loss": 2.0}\n',
                "runb/recipe.yaml": "train:\n  lr: 0.001\n", "runb/metrics.jsonl": '{"step": 1, "loss": 2.0}\n'},
         argv=("runs", "compare", "{d}/runa", "{d}/runb")),
]


def fill(value: Any, d: Path) -> Any:
    """Replace {d} with the case folder in every string of a nested value."""
    if isinstance(value, str):
        return value.replace("{d}", str(d))
    if isinstance(value, dict):
        return {k: fill(v, d) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, d) for v in value]
    return value


def prepare(case: Case, d: Path) -> list[str]:
    """Write the case folder: recipe, data, and an output_dir holding a sentinel and an earlier run."""
    (d / "out").mkdir(parents=True)
    (d / "out" / "sentinel.txt").write_text("the user's own file: must survive\n")
    (d / "out" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5, "note": "an earlier run"}\n')
    if case.marked:
        (d / "out" / "finetune-run.json").write_text(json.dumps({
            "finetune_run": 1, "run_id": "earlier-run", "created": "2025-01-01 00:00:00 +0000",
            "files": ["recipe.yaml", "versions.json", "metrics.jsonl", "final", "checkpoints"]}))
    files = {"train.jsonl": GOOD, **case.files}
    for name, content in files.items():
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    recipe = fill(case.recipe_text, d) if case.recipe_text is not None else \
        yaml.safe_dump(fill(deep_merge(BASE, case.patch), d), sort_keys=False)
    (d / "recipe.yaml").write_text(recipe)
    if case.argv is not None:
        return fill(list(case.argv), d)
    argv = [case.command, str(d / case.recipe_name), *fill(list(case.args), d)]
    if case.command == "train" and case.overwrite:
        argv.append("--overwrite")
    return argv


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# --- running the CLI ------------------------------------------------------------------------------------

@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    seconds: float


class ForkingCli:
    """Runs `python -m finetune ARGS` in processes forked from a server that imported the trainer once
    (cli_server.py)."""

    def __init__(self) -> None:
        self.server = CliServer(REPO_ROOT, TOKENIZER_DIR, {**os.environ, **CLI_ENV})

    def run(self, args: list[str], cwd: Path) -> Result:
        start = time.perf_counter()
        rc, out, err = self.server.run(args, cwd, {}, CASE_TIMEOUT_S)
        return Result(rc, out, err, time.perf_counter() - start)

    def close(self) -> None:
        self.server.close()


class PlainCli:
    """Runs `python -m finetune ARGS` as a plain subprocess (where fork is unavailable, or when asked)."""

    def run(self, args: list[str], cwd: Path) -> Result:
        start = time.perf_counter()
        # The checkout first, then the inherited PYTHONPATH: where the libraries live only there (a GPU machine's
        # /tmp/site), replacing it made every case an ImportError (exit 1).
        done = subprocess.run([sys.executable, "-m", "finetune", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=CASE_TIMEOUT_S, env={**os.environ, **CLI_ENV,
                                                           "PYTHONPATH": python_path(REPO_ROOT)})
        return Result(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)

    def close(self) -> None:
        pass


def make_cli() -> ForkingCli | PlainCli:
    return ForkingCli() if forking() else PlainCli()


@dataclass
class Outcome:
    case: Case
    d: Path
    result: Result
    lost: list[str]
    """Files that were in the case folder before the run and are gone or changed after it."""

    def text(self, s: str) -> str:
        return fill(s, self.d)


def run_case(case: Case, cli: ForkingCli | PlainCli, root: Path) -> Outcome:
    d = root / case.id
    argv = prepare(case, d)
    before = snapshot(d)
    # The case folder is the cwd: a stray relative path would land there, not in the repository.
    result = cli.run(argv, d)
    after = snapshot(d)
    lost = [name for name, data in before.items() if after.get(name) != data]
    return Outcome(case, d, result, lost)


_OUTCOMES: dict[str, Outcome] = {}


@pytest.fixture(scope="module")
def outcome_of(tmp_path_factory):
    cli = make_cli()
    root = tmp_path_factory.mktemp("bad-inputs")

    def get(case: Case) -> Outcome:
        if case.id not in _OUTCOMES:
            _OUTCOMES[case.id] = run_case(case, cli, root)
        return _OUTCOMES[case.id]

    yield get
    cli.close()


# --- the tests ------------------------------------------------------------------------------------------

def test_case_ids_are_unique_and_enough():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len([c for c in CASES if c.exit_code == 2]) >= 22


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, outcome_of):
    o = outcome_of(case)
    r = o.result
    assert r.rc == case.exit_code, f"exit {r.rc}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    for expected in case.expect:
        assert o.text(expected) in r.stderr, f"{o.text(expected)!r} not in stderr:\n{r.stderr}"
    for expected in case.stdout_expect:
        assert o.text(expected) in r.stdout, f"{o.text(expected)!r} not in stdout:\n{r.stdout}"
    if case.exit_code == 2:  # notes (what a recipe's loading should say) may come first
        lines = _without_notes(r.stderr)
        if case.library_report:
            lines = lines[next(i for i, line in enumerate(lines) if line.startswith("error: ")):]
        assert lines[0].startswith("error: "), r.stderr
    if case.stage == "recipe":
        assert r.stdout == ""  # nothing half-printed for a bad recipe


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_nothing_lost(case: Case, outcome_of):
    o = outcome_of(case)
    assert o.lost == [], f"{case.id}: lost or changed {o.lost}"


def test_bad_rows_skipped_run_writes_a_run(outcome_of):
    case = next(c for c in CASES if c.id == "bad_rows_skipped")
    o = outcome_of(case)
    assert o.result.rc == 0, o.result.stderr
    lines = [json.loads(x) for x in (o.d / "fresh" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [1]


def test_recipe_errors_are_caught_before_torch_is_imported(outcome_of):
    """Recipe problems are caught before torch is imported (what makes them fast: a plain `python -X importtime`
    subprocess lists every module it imported, and torch is not among them)."""
    case = next(c for c in CASES if c.id == "unknown_key")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        argv = prepare(case, d)
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "finetune", *argv], cwd=d,
                              capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
                              env={**os.environ, **CLI_ENV, "PYTHONPATH": python_path(REPO_ROOT)})
    assert done.returncode == 2 and "trian: unknown key" in done.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "finetune.recipe" in imported and not [m for m in imported if m.split(".")[0] == "torch"]


def test_docs_table_is_current(outcome_of):
    outcomes = [outcome_of(c) for c in CASES]
    expected = render_docs(outcomes)
    actual = DOCS.read_text(encoding="utf-8") if DOCS.exists() else ""
    assert actual == expected, "docs/bad-inputs.md is stale: run `.venv/bin/python tests/test_bad_inputs.py --regen`"


# --- docs/bad-inputs.md ---------------------------------------------------------------------------------

def _without_notes(stderr: str) -> list[str]:
    """stderr's non-empty lines after the `note:` lines a recipe's loading prints before anything else."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    while lines and lines[0].startswith("note: "):
        lines.pop(0)
    return lines or [""]


def message_of(o: Outcome) -> str:
    """The message as the docs show it: stderr's first line (plus the first listed problem under a header),
    with the case folder written as <tmp>."""
    lines = _without_notes(o.result.stderr)
    if o.case.library_report:
        lines = [line for line in lines if line.startswith("error: ")]
    if o.case.exit_code == 0:  # the line the case is about: what it expects on stdout, else the data summary
        out = o.result.stdout.splitlines()
        if o.case.stdout_expect:
            lines = [next(line for line in out if o.text(o.case.stdout_expect[0]) in line)]
        else:
            lines = [next((line for line in out if "bad rows skipped" in line),
                          next((line for line in out if line.startswith("data:")), ""))]
    shown = lines[0] if lines else ""
    if shown.endswith(":") and len(lines) > 1:
        shown += " " + lines[1].strip()
    shown = shown.replace(str(o.d), "<tmp>").replace(str(REPO_ROOT), "<repo>")
    # A library's own wording after our message (in parentheses) may change with its version: cut it.
    return re.sub(r" \((OSError|ValueError|HFValidationError|\w+Error): .*", " (...)", shown)


def _cell(text: str) -> str:
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render_docs(outcomes: list[Outcome]) -> str:
    rows = []
    for i, o in enumerate(outcomes, start=1):
        kept = "kept" if not o.lost else "**lost** (known trainer bug, see below)"
        rows.append(f"| {i} | `{o.case.id}`: {o.case.kind} | {o.case.stage} | {o.result.rc} | "
                    f"{_cell(message_of(o))} | {kept} |")
    return "\n".join([
        "# Bad input: what each kind gets",
        "",
        "<!-- Generated by `.venv/bin/python tests/test_bad_inputs.py --regen` from the table in",
        "     tests/test_bad_inputs.py, which also asserts every row. Do not edit by hand. -->",
        "",
        "Every row is a real run of `python -m finetune train RECIPE --overwrite` (or `finetune validate`,",
        "`finetune convert axolotl`, `finetune recipes add`) on a tiny recipe whose output_dir already holds a",
        "user's file and an earlier run's `metrics.jsonl` (marked as finetune's by its `finetune-run.json`,",
        "except where the row says the files are another tool's).",
        "A user error always exits with status 2 and one message naming the recipe key or the `file:line`,",
        "never a traceback (`--debug` shows one). `<tmp>` is the folder the case ran in.",
        "",
        "*Caught at*: `recipe` = while reading the recipe, before torch is imported (also what `finetune",
        "validate` reports); `output_dir`, `data`, `model`, `checkpoint` = at that step of `finetune train`;",
        "`train` = a warning at the start of training (the run goes on), or a streamed dataset's row, read while",
        "training (`data.streaming`); `rollouts` = while a GRPO step's",
        "rollouts are made (generated and scored); `convert` = by `finetune convert",
        "axolotl`, before anything is written; `recipes` = by `finetune recipes add`, before git runs; `runs` =",
        "by a command that reads a run directory (`finetune runs compare`, `plot`, `generate`, `merge`).",
        "*Earlier run*: whether every file that was there before (the sentinel and the earlier",
        "`metrics.jsonl`) is still there, byte for byte, after the failed run.",
        "",
        "| # | kind | caught at | exit | message (first line) | earlier run |",
        "|---|------|-----------|------|----------------------|-------------|",
        *rows,
        "",
        "Bad rows can be skipped instead of stopping the run with `data.on_bad_row: skip`: they are counted",
        "and the count is printed (`bad_rows_skipped` above). The data line then reads, e.g.,",
        "`data: 6 samples, ... ; 2 bad rows skipped`.",
        "",
        "With `--overwrite`, the earlier run is removed only after the tokenizer, the data and the model have",
        "loaded: a run that fails on bad input leaves the earlier run as it was (a streamed dataset's rows are read",
        "while training, after that: a bad one among them is met once the run has replaced the earlier one). Only",
        "what the earlier run's",
        "`finetune-run.json` lists is ever removed, and `resume: auto` removes nothing (README, \"The run",
        "directory\").",
        "",
    ])


def regen() -> int:
    cli = make_cli()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            outcomes = [run_case(c, cli, Path(tmp)) for c in CASES]
            DOCS.parent.mkdir(exist_ok=True)
            DOCS.write_text(render_docs(outcomes), encoding="utf-8")
    finally:
        cli.close()
    bad = [o.case.id for o in outcomes if o.result.rc != o.case.exit_code or "Traceback" in o.result.stderr]
    print(f"wrote {DOCS} ({len(outcomes)} cases){'; check: ' + ', '.join(bad) if bad else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: python tests/test_bad_inputs.py --regen   (rewrites docs/bad-inputs.md)")
    sys.exit(regen())
