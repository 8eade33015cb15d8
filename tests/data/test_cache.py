"""The preprocessed-data cache and `finetune preprocess`.

The cache is only worth having if it is never stale: every input the samples depend on must change the key
(data content, tokenizer files, chat template override, format options, max_seq_len, truncation, the split,
DATA_VERSION), while keys that only change what happens after tokenization (train.lr, packing) must reuse it.
Cached samples must equal freshly tokenized ones, a damaged entry must be rebuilt (and said so), and parallel
tokenization must give exactly the serial result.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO_ROOT, TOKENIZER_DIR, tiny_recipe
from helpers import TEST_ENV, run_cli, run_process

from finetune.data import PARALLEL_MIN_EXAMPLES, DataStats, build_samples, load_examples, tokenize_examples
from finetune.data import cache as data_cache
from finetune.data.cache import cache_inputs, cache_key, load_entry, prepare, save_entry
from finetune.data.report import histogram_lines, pack_epoch0, token_accounting
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import Recipe, validate

QUICKSTART_TRAIN = REPO_ROOT / "examples" / "data" / "quickstart_train.jsonl"


def chat_rows(n: int, offset: int = 0) -> list[dict]:
    """Conversations of varied length (1-3 turns, words repeated), so truncation and packing have work."""
    rows = []
    for i in range(offset, offset + n):
        turns = []
        for t in range(1 + i % 3):
            turns += [{"role": "user", "content": f"Repeat {i}: " + "word " * (i % 7 + t)},
                      {"role": "assistant", "content": f"ok {i} " + "word " * (i % 11)}]
        rows.append({"messages": turns})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(root))
    return root


@pytest.fixture
def base(tmp_path: Path) -> dict[str, Any]:
    """A raw recipe over 40 chat rows with a separate eval file."""
    raw = tiny_recipe(tmp_path / "out", write_jsonl(tmp_path / "train.jsonl", chat_rows(40)))
    raw["eval_datasets"] = [{"path": str(write_jsonl(tmp_path / "eval.jsonl", chat_rows(6, 100))), "format": "chat"}]
    return raw


def recipe_of(raw: dict[str, Any]) -> Recipe:
    return validate(json.loads(json.dumps(raw)))  # a deep copy: tests mutate their raw dicts freely


def key_of(raw: dict[str, Any]) -> str:
    recipe = recipe_of(raw)
    return cache_key(cache_inputs(recipe, load_tokenizer(recipe.tokenizer, recipe.model)))


def prepared(raw: dict[str, Any], **kwargs: Any) -> data_cache.Prepared:
    recipe = recipe_of(raw)
    return prepare(recipe, load_tokenizer(recipe.tokenizer, recipe.model), **kwargs)


# --- the key: every input changes it, nothing else does ----------------------------------------------------

def _edit_tokenizer_json(raw: dict, tmp: Path) -> None:
    """A copy of the example tokenizer with one BPE merge fewer ("ne" + "w"): it tokenizes "new" differently."""
    copy = tmp / "tok"
    shutil.copytree(TOKENIZER_DIR, copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    raw["tokenizer"]["path"] = str(copy)


def _edit_template_file(raw: dict, tmp: Path) -> None:
    copy = tmp / "tok"
    shutil.copytree(TOKENIZER_DIR, copy)
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("'\\n'", "'\\n\\n'"))
    raw["tokenizer"]["path"] = str(copy)


def _edit_data(raw: dict, tmp: Path) -> None:
    path = Path(raw["datasets"][0]["path"])
    path.write_text(path.read_text().replace("Repeat 3:", "Repeat 3 :"))  # same size class, other bytes


def _edit_eval_data(raw: dict, tmp: Path) -> None:
    path = Path(raw["eval_datasets"][0]["path"])
    path.write_text(path.read_text() + json.dumps(chat_rows(1, 500)[0]) + "\n")


def _set(section: str, key: str, value: Any):
    def edit(raw: dict, tmp: Path) -> None:
        target = raw[section][0] if section in ("datasets", "eval_datasets") else raw.setdefault(section, {})
        target[key] = value
    return edit


CHANGES = {
    "data file content": _edit_data,
    "eval data file content": _edit_eval_data,
    "tokenizer.json": _edit_tokenizer_json,
    "chat template file of the tokenizer": _edit_template_file,
    "chat template override": _set("tokenizer", "chat_template", "{% for m in messages %}{{ m['content'] }}"
                                   "{% endfor %}"),
    "format": _set("datasets", "format", "alpaca"),
    "messages_field": _set("datasets", "messages_field", "conversation"),
    "train_on_inputs": _set("datasets", "train_on_inputs", True),
    "roles_to_train": _set("datasets", "roles_to_train", ["user", "assistant"]),
    "chat template kwargs": _set("tokenizer", "chat_template_kwargs", {"enable_thinking": False}),
    "max_rows": _set("datasets", "max_rows", 10),
    "eval format option": _set("eval_datasets", "train_on_inputs", True),
    "max_seq_len": _set("data", "max_seq_len", 64),
    "truncation": _set("data", "truncation", "drop"),
    "on_bad_row": _set("data", "on_bad_row", "skip"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_any_input_change_gives_a_new_key(change, base, tmp_path, cache_dir):
    before = key_of(base)
    CHANGES[change](base, tmp_path)
    assert key_of(base) != before


def test_val_fraction_and_its_seed_change_the_key_only_when_they_split(base, cache_dir):
    own_eval = key_of(base)
    base["data"]["val_fraction"] = 0.25  # eval_datasets are given: no split, same samples, same key
    base["seed"] = 7
    assert key_of(base) == own_eval
    del base["eval_datasets"]
    split = key_of(base)
    base["seed"] = 8
    assert key_of(base) != split  # the seed picks the held-out rows
    base["data"]["val_fraction"] = 0.5
    assert len({split, key_of(base)}) == 2


def test_data_version_changes_the_key(base, cache_dir, monkeypatch):
    before = key_of(base)
    monkeypatch.setattr(data_cache, "DATA_VERSION", data_cache.DATA_VERSION + 1)
    assert key_of(base) != before


def test_harmless_changes_keep_the_key(base, tmp_path, cache_dir):
    before = key_of(base)
    data_file = Path(base["datasets"][0]["path"])
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(data_file, moved)  # same content at another path and mtime: content, not names, is the key
    base["datasets"][0]["path"] = str(moved)
    base["train"].update(lr=5e-4, micro_batch_size=3, max_steps=7)
    base["data"].update(packing=False, shuffle=False, num_proc=2, drop_last=True)
    base["output_dir"] = str(tmp_path / "other-run")
    base["model"]["config"]["hidden_size"] = 64
    base["seed"] = 3  # no val_fraction: the seed only shuffles and packs, after the cache
    assert key_of(base) == before


# --- reuse, equality with fresh samples, damaged entries ---------------------------------------------------

def test_second_prepare_reuses_the_entry_and_equals_fresh_samples(base, cache_dir):
    base["data"]["max_seq_len"] = 48  # some samples get truncated: the labels mask is cut with them
    first = prepared(base)
    assert not first.hit and "cached at" in first.note and first.path.parent == cache_dir
    again = prepared(base)
    assert again.hit and again.note.startswith(f"using cached preprocessed data from {first.path}")
    recipe = recipe_of(base)
    train, evals, train_stats, eval_stats = build_samples(recipe, load_tokenizer(recipe.tokenizer, recipe.model))
    assert train_stats.truncated > 0
    assert (again.train, again.evals, again.train_stats, again.eval_stats) == (train, evals, train_stats, eval_stats)
    base["train"]["lr"] = 1e-4
    assert prepared(base).hit  # a training key is no reason to tokenize again


def test_completion_split_and_drop_round_trip(tmp_path, cache_dir):
    texts = [{"text": "word " * (3 + i % 40)} for i in range(30)]
    raw = tiny_recipe(tmp_path / "out", write_jsonl(tmp_path / "c.jsonl", texts), fmt="completion")
    raw["data"].update(max_seq_len=32, truncation="drop", val_fraction=0.2)
    first, again = prepared(raw), prepared(raw)
    assert again.hit and first.train_stats.dropped_too_long > 0 and first.evals
    assert (again.train, again.evals, again.train_stats, again.eval_stats) == \
        (first.train, first.evals, first.train_stats, first.eval_stats)
    # The dropped samples are named by their file:line, and the names come back from the cache with the counts.
    named = again.train_stats.dropped_examples
    assert named and len(named) == min(5, again.train_stats.dropped_too_long)
    assert all(e.startswith(f"{tmp_path / 'c.jsonl'}:") and "over data.max_seq_len 32" in e for e in named), named


def test_labels_that_are_not_a_mask_are_stored_in_full(tmp_path):
    samples = [{"input_ids": [5, 6, 7], "labels": [-100, 9, 7]}, {"input_ids": [8, 3], "labels": [-100, 3]}]
    entry = save_entry(tmp_path, "k", {}, {"train": (samples, DataStats(samples=2)), "eval": ([], DataStats())})
    loaded = load_entry(entry, "k")
    assert loaded["train"] == (samples, DataStats(samples=2)) and loaded["eval"] == ([], DataStats())
    assert np.load(entry / "train.labels.npy").dtype == np.int32  # not the uint8 mask


def _flip_a_byte(entry: Path) -> None:
    path = entry / "train.ids.npy"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte in the token ids": _flip_a_byte,
    "truncated offsets": lambda e: (e / "train.offsets.npy").write_bytes((e / "train.offsets.npy").read_bytes()[:90]),
    "missing labels": lambda e: (e / "eval.labels.npy").unlink(),
    "garbage meta.json": lambda e: (e / "meta.json").write_text("{not json"),
    "missing meta.json": lambda e: (e / "meta.json").unlink(),
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_a_damaged_entry_is_ignored_and_rebuilt(damage, base, cache_dir):
    fresh = prepared(base)
    CORRUPTIONS[damage](fresh.path)
    rebuilt = prepared(base)
    assert not rebuilt.hit and rebuilt.note.startswith(f"ignoring the cached data at {fresh.path}: ")
    assert "tokenizing again" in rebuilt.note and "cached at" in rebuilt.note
    assert (rebuilt.train, rebuilt.evals, rebuilt.train_stats) == (fresh.train, fresh.evals, fresh.train_stats)
    healed = prepared(base)
    assert healed.hit and healed.train == fresh.train
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # no temporary or trash left


def test_unwritable_cache_root_warns_and_trains_on(base, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(blocker / "cache"))
    result = prepared(base)
    assert result.train and result.path is None and "could not write the data cache" in result.note


def test_same_key_written_twice_keeps_one_entry(tmp_path):
    samples = [{"input_ids": [1, 2], "labels": [-100, 2]}]
    splits = {"train": (samples, DataStats(samples=1)), "eval": ([], DataStats())}
    first = save_entry(tmp_path, "k", {}, splits)
    second = save_entry(tmp_path, "k", {}, splits)  # as a second rank finishing later would
    assert first == second and load_entry(first, "k")["train"][0] == samples
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


def test_rebuild_replaces_the_entry(base, cache_dir):
    first = prepared(base)
    again = prepared(base, rebuild=True)
    assert not again.hit and again.path == first.path and prepared(base).hit


# --- parallel tokenization ----------------------------------------------------------------------------------

def test_num_proc_2_gives_identical_samples_and_stats(tokenizer, monkeypatch):
    recipe = validate({**tiny_recipe("unused", QUICKSTART_TRAIN), "data": {"max_seq_len": 64}})
    examples = load_examples(recipe.datasets, "error", DataStats())
    assert len(examples) >= 2 * PARALLEL_MIN_EXAMPLES
    serial_stats, parallel_stats = DataStats(), DataStats()
    serial = tokenize_examples(examples, tokenizer, recipe.data, serial_stats)
    import finetune.data.samples as data_module

    calls = []
    real = data_module._tokenize_parallel
    monkeypatch.setattr(data_module, "_tokenize_parallel", lambda *a: calls.append(1) or real(*a))
    parallel = tokenize_examples(examples, tokenizer, recipe.data.model_copy(update={"num_proc": 2}), parallel_stats)
    assert calls, "num_proc 2 did not take the parallel path"
    assert parallel_stats.truncated > 0  # the merged counts include truncation
    assert parallel == serial and parallel_stats == serial_stats


# --- statistics ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_token_accounting_balances_through_packing(truncation, base, cache_dir):
    base["data"].update(max_seq_len=40, truncation=truncation)
    result = prepared(base)
    stats = result.train_stats
    assert stats.input_tokens == stats.tokens + stats.truncated_tokens + stats.dropped_tokens
    assert (stats.truncated_tokens if truncation == "truncate" else stats.dropped_tokens) > 0
    rows, pack = pack_epoch0(result.train, recipe_of(base))
    assert pack.tokens == stats.tokens == sum(len(r["input_ids"]) for r in rows)  # packing adds or loses none
    tokens_in, kept, truncated, dropped = token_accounting(stats, pack)
    assert tokens_in == kept + truncated + dropped


def test_histogram_bins_and_bars():
    lines = histogram_lines([1, 2, 3, 10, 11, 95], bins=10, width=10)
    assert lines[0].split()[:3] == ["0-9", "3", "50.0%"] and lines[0].endswith("#" * 10)
    assert lines[1].split()[:2] == ["10-19", "2"] and lines[-1].split()[0] == "90-99"
    assert all(line.split()[1] != "0" or line.endswith("% ") for line in lines)  # empty bins: no bar
    assert histogram_lines([]) == []


# --- the CLI --------------------------------------------------------------------------------------------------

def test_preprocess_cli_prints_statistics_and_train_reuses_the_cache(base, write_recipe, tmp_path):
    base["data"]["max_seq_len"] = 48
    recipe = write_recipe(base)
    env = {"FINETUNE_CACHE_DIR": str(tmp_path / "cache")}
    first = run_cli("preprocess", str(recipe), "--show", "2", env=env)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    for expected in ("rows read", "target tokens", "truncated tokens", "bad rows skipped", "dropped samples",
                     "training sample lengths in tokens", "packed (48)", "padded", "efficiency", "steps",
                     "token accounting (train):", "balanced", "--- sample 0:", "--- sample 1:"):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    assert "--- sample 2:" not in out
    # Piped, not a terminal: trained text in [[...]]; the prompt around it stays unmarked.
    assert "[[ok 0 <|im_end|>]]" in out and "<|im_start|>user\nRepeat 0:" in out
    entry = next(p for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))

    again = run_cli("preprocess", str(recipe), "train.lr=1e-4", env=env)
    assert again.returncode == 0, again.stderr
    assert f"using cached preprocessed data from {entry}" in again.stdout

    train = run_cli("train", str(recipe), env=env)
    assert train.returncode == 0, train.stderr
    assert f"using cached preprocessed data from {entry}" in train.stdout


def test_preprocess_imports_no_torch_dynamo():
    # What `finetune preprocess` imports (cli.cmd_preprocess): the tokenizer's loader without the model's, whose
    # attention code imports torch._dynamo (torch.compiler.disable), a second and a half of every run's start-up.
    code = ("import sys; import finetune.cli; from finetune.data.report import preprocess; "
            "from finetune.model.tokenizer import load_tokenizer; print('torch._dynamo' in sys.modules)")
    result = run_process([sys.executable, "-c", code], env=TEST_ENV, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_preprocess_cli_user_errors_exit_2(write_recipe, tmp_path):
    raw = tiny_recipe(tmp_path / "out", tmp_path / "missing.jsonl")
    result = run_cli("preprocess", str(write_recipe(raw)), env={"FINETUNE_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "missing.jsonl" in result.stderr
