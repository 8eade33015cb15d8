"""A damaged model file is a user error: exit 2, one message naming the file, what is wrong with it and what to do,
never a traceback (finetune/model/files.py).

The tests' tiny Llama is saved and then damaged the ways files go bad (cut in half, random bytes, empty, a header
length past any file, a tensor of another shape than config.json makes it, an unreadable config.json, a sharded
model's missing or truncated shard), each reached through the real CLI: every kind through `finetune train` with
model.path (the cheapest route: it fails before any step), and one kind each through `finetune generate` of a run's
full final/, `finetune eval` of a run's LoRA adapter, and a GRPO and a DPO run's separate reference.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from grpo_files import grpo_args, tiny_lm, write_replay
from helpers import QUICKSTART, ROOT, TINY, run_cli
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
SHARD = "model-00002-of-00002.safetensors"
SMALL = ["datasets.0.max_rows=16", "eval_datasets.0.max_rows=4", "data.packing_check=false", "train.max_steps=1",
         "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama (vocabulary 1024, the example tokenizer's) saved whole and in two shards."""
    root = tmp_path_factory.mktemp("model-files")
    lm = tiny_lm()
    lm.save_pretrained(root / "whole")
    lm.save_pretrained(root / "sharded", max_shard_size="100KB")
    assert (root / "sharded" / SHARD).is_file()
    return {"whole": root / "whole", "sharded": root / "sharded"}


def _cut_in_half(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _random_bytes(file: Path) -> None:
    file.write_bytes(os.urandom(file.stat().st_size))


def _huge_header_length(file: Path) -> None:
    """The first 8 bytes (the header's length) say 1 TiB; the rest is the real file."""
    data = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _wrong_shape(file: Path) -> None:
    """A valid safetensors file whose first layer's q_proj is half as wide as config.json makes it."""
    weights = load_file(str(file))
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name][:, :16].contiguous()
    save_file(weights, str(file), metadata={"format": "pt"})


# kind -> (model saved whole or sharded, the file damaged, the damage, what the message says of that file)
DAMAGE: dict[str, tuple[str, str, Callable[[Path], None], str]] = {
    "truncated": ("whole", WEIGHTS, _cut_in_half, "is truncated: its header says the file holds "),
    "random_bytes": ("whole", WEIGHTS, _random_bytes, "is not a safetensors file: its first 8 bytes give a header"),
    "empty": ("whole", WEIGHTS, lambda f: f.write_bytes(b""), "is empty (0 bytes)"),
    "huge_header_length": ("whole", WEIGHTS, _huge_header_length,
                           "is not a safetensors file: its first 8 bytes give a header length of 1,099,511,627,776 "
                           "bytes (safetensors allows at most 100,000,000)"),
    "wrong_shape": ("whole", WEIGHTS, _wrong_shape, "holds model.layers.0.self_attn.q_proj.weight of shape [32, 16], "
                                                    "but "),
    "config_not_json": ("whole", "config.json", lambda f: f.write_text('{"model_type": "llama",'),
                        "is not valid JSON (Expecting property name enclosed in double quotes"),
    "shard_truncated": ("sharded", SHARD, _cut_in_half, "is truncated"),
    "shard_missing": ("sharded", "model.safetensors.index.json", lambda f: (f.parent / SHARD).unlink(),
                      f"lists {SHARD}, which is missing"),
}


def _damaged(saved: dict[str, Path], tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    """(a damaged copy of the saved model, its bad file, what the message says of it)."""
    which, name, damage, said = DAMAGE[kind]
    folder = shutil.copytree(saved[which], tmp_path / f"{kind}-model")
    damage(folder / name)
    return folder, folder / name, said


def _assert_user_error(result, *expected: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for text in expected:
        assert text in result.stderr, (text, result.stderr[-3000:])


def _train_from(model_dir: Path, out: Path, *extra: str):
    return run_cli("train", str(QUICKSTART), "model.init=pretrained", "model.config=null", f"model.path={model_dir}",
                   f"output_dir={out}", *SMALL, *extra)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_train_names_the_bad_file_of_model_path(saved, tmp_path, kind):
    """`finetune train` from a damaged model.path: exit 2 naming the file, what is wrong and the fix; nothing
    written to output_dir."""
    folder, bad, said = _damaged(saved, tmp_path, kind)
    result = _train_from(folder, tmp_path / "run")
    _assert_user_error(result, f"model.path: {bad} {said}",
                       "Re-download or re-save the model, or set model.path to another model directory.")
    assert not (tmp_path / "run" / "final").exists()


def test_the_undamaged_model_trains(saved, tmp_path):
    """The check passes what it should: the same model, whole and sharded, trains from model.path."""
    for which in ("whole", "sharded"):
        result = _train_from(saved[which], tmp_path / which)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / which / "final" / WEIGHTS).is_file()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two finished one-step runs of the tiny model: a full fine-tune and a LoRA adapter."""
    root = tmp_path_factory.mktemp("model-files-runs")
    out = {}
    for name, extra in (("full", []), ("lora", ["adapter.type=lora", "adapter.r=4"])):
        out[name] = root / name
        result = run_cli("train", str(QUICKSTART), *TINY, *SMALL, f"output_dir={out[name]}", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_generate_names_a_truncated_final_model(runs, tmp_path):
    run = shutil.copytree(runs["full"], tmp_path / "run")
    _cut_in_half(run / "final" / WEIGHTS)
    result = run_cli("generate", str(run), "--prompt", "hi", "--max-new-tokens", "2")
    _assert_user_error(result, f"the run's final model: {run / 'final' / WEIGHTS} is truncated: its header says",
                       "Restore final/ from a copy, or train the run again.")


def test_eval_names_a_garbage_adapter_file(runs, tmp_path):
    run = shutil.copytree(runs["lora"], tmp_path / "run")
    adapter = run / "final" / "adapter_model.safetensors"
    assert adapter.is_file() and not (run / "final" / WEIGHTS).exists()
    _random_bytes(adapter)
    result = run_cli("eval", str(run))
    _assert_user_error(result, f"the run's final model: {adapter} is not a safetensors file")


def test_grpo_names_the_bad_file_of_its_reference(saved, tmp_path):
    """grpo.reference: PATH (beta > 0) loaded after the policy: a tensor of the wrong shape there is named with
    grpo.reference, not model.path (the key reaches the load's own shape check)."""
    reference, bad, said = _damaged(saved, tmp_path, "wrong_shape")
    replay = write_replay(tmp_path / "replay.jsonl")
    result = run_cli("train", str(QUICKSTART), *grpo_args(replay, "grpo.beta=0.04", f"grpo.reference={reference}",
                                                          f"output_dir={tmp_path / 'run'}", "train.max_steps=1"))
    _assert_user_error(result, f"grpo.reference: {bad} {said}{reference / 'config.json'} makes it [32, 32]",
                       "set grpo.reference to another model directory.")


def test_dpo_names_the_bad_file_of_its_reference(saved, tmp_path):
    reference, bad, said = _damaged(saved, tmp_path, "empty")
    data = ROOT / "examples" / "data"
    result = run_cli("train", str(QUICKSTART), *TINY, *SMALL, f"output_dir={tmp_path / 'run'}",
                     "train.objective=dpo", f"dpo.reference={reference}",
                     f"datasets.0.path={data / 'quickstart_pref_train.jsonl'}", "datasets.0.format=preference",
                     f"eval_datasets.0.path={data / 'quickstart_pref_eval.jsonl'}", "eval_datasets.0.format=preference")
    _assert_user_error(result, f"dpo.reference: {bad} {said}", "set dpo.reference to another model directory.")


def test_a_config_that_is_no_object_and_an_index_without_a_map(saved, tmp_path):
    """The JSON files a loader reads first: valid JSON of the wrong kind is named too (the check, called as load_model
    calls it)."""
    from finetune.errors import UserError
    from finetune.model.files import check_model_dir

    folder = shutil.copytree(saved["sharded"], tmp_path / "model")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(UserError, match=re.escape(f"model.path: {index} has no weight_map")):
        check_model_dir(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=re.escape(f"{folder / 'config.json'} is not a JSON object")):
        check_model_dir(folder, "grpo.reference")
