"""Checkpoints are trusted by their content, and a failed write leaves nothing behind.

In process, with the faults injected where they happen: bytes damaged inside a written checkpoint (the manifest
names the file; resume takes the next older one), a disk that fills during a save (RLIMIT_FSIZE: safetensors
raises SafetensorError, torch.save a RuntimeError, open() an OSError), and a small disk budget at the start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO_ROOT, TOKENIZER_DIR, tiny_recipe
from helpers import QUICKSTART, TINY, file_size_limit, run_cli
from rich.console import Console
from safetensors.torch import load_file

from finetune.dist import World
from finetune.errors import UserError
from finetune.recipe import Recipe
from finetune.run import checkpoint, manifest, startup
from finetune.run.directory import RunDir


def _training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))  # 18,720 bytes of weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(3, 64)).pow(2).sum().backward()
    optimizer.step()  # AdamW moments exist: optimizer.pt is about twice the weights
    return model, optimizer, scheduler


def _save(out: Path, step: int, keep_last: int = 3) -> Path:
    model, optimizer, scheduler = _training(step)
    return checkpoint.save(out, step, model, optimizer, scheduler, {"step": step, "tokens_seen": 0}, keep_last)


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    path = _save(tmp_path, 3)
    entries = json.loads((path / manifest.MANIFEST).read_text())["files"]
    names = sorted(p.name for p in path.iterdir() if p.name != manifest.MANIFEST)
    assert sorted(entries) == names == ["COMPLETE", "model.safetensors", "optimizer.pt", "state.pt",
                                        "trainer_state.json"]
    for name, entry in entries.items():
        assert entry == {"size": (path / name).stat().st_size, "sha256": manifest.sha256(path / name)}
    assert json.loads((path / checkpoint.MARKER).read_text()) == {"step": 3, "manifest": "manifest.json"}
    assert checkpoint.verify(path) is None


def _flip(path: Path, offset: int, length: int) -> None:
    """Overwrite `length` bytes at `offset` with zeros (their inverse where they already were zeros)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + length):
        data[i] = 0 if data[i] else 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "state.pt", "trainer_state.json"])
def test_damage_inside_any_file_is_named_and_the_next_older_checkpoint_is_used(tmp_path, name):
    """Same size, other bytes: 1 KB zeroed in the middle of the weights (which still load, as other weights: the
    old check resumed from them), or a few bytes of the optimizer, the RNG state or the trainer state."""
    older = _save(tmp_path, 3)
    newer = _save(tmp_path, 6)
    file = newer / name
    size = file.stat().st_size
    if name == "model.safetensors":
        header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
        _flip(file, header + 4096, 1024)
        assert load_file(str(file)).keys() == load_file(str(older / name)).keys()  # still loads
    else:
        _flip(file, size // 2, 4)
    assert file.stat().st_size == size
    messages: list[str] = []
    assert checkpoint.find_latest(tmp_path, warn=messages.append) == older
    assert messages == [f"skipping checkpoint {newer}: {name} is damaged: its sha256 differs from the manifest's "
                        "(changed after it was written)"]


def test_truncated_and_missing_files_are_named(tmp_path):
    path = _save(tmp_path, 3)
    optimizer_pt = path / "optimizer.pt"
    data = optimizer_pt.read_bytes()
    optimizer_pt.write_bytes(data[:100])
    assert checkpoint.verify(path) == f"optimizer.pt is truncated or unreadable (100 bytes; the manifest records {len(data)})"
    optimizer_pt.write_bytes(data)
    assert checkpoint.verify(path) is None
    (path / "state.pt").unlink()
    assert checkpoint.verify(path, deep=False) == "state.pt is missing"
    (path / manifest.MANIFEST).unlink()  # its COMPLETE promises one: not taken for an old checkpoint
    assert checkpoint.verify(path) == "manifest.json is missing"


def test_a_checkpoint_from_before_manifests_is_verified_by_loading(tmp_path):
    """An old checkpoint (COMPLETE holds the step, no manifest): its files are loaded, so a garbled optimizer.pt
    is skipped; an intact one resumes, with a warning that damage inside a tensor cannot be seen."""
    older, newer = _save(tmp_path, 3), _save(tmp_path, 6)
    for path, step in ((older, 3), (newer, 6)):
        (path / manifest.MANIFEST).unlink()
        (path / checkpoint.MARKER).write_text(str(step))
    _flip(newer / "optimizer.pt", 40, 64)
    messages: list[str] = []
    assert checkpoint.find_latest(tmp_path, warn=messages.append) == older
    assert len(messages) == 2 and messages[0].startswith(f"skipping checkpoint {newer}: unreadable (")
    assert messages[1] == (f"checkpoint {older} has no manifest.json (written by an older finetune): checked by "
                           "loading its files, which cannot see a changed byte inside a tensor")


def test_a_newer_leftover_does_not_get_the_new_checkpoint_pruned(tmp_path):
    """Resumed from step 3 because step 9 failed its check: saving step 4 with keep_last 1 keeps step 4 (and the
    leftover step 9, which the run rewrites when it gets there); the old pruning deleted step 4 itself."""
    _save(tmp_path, 3)
    leftover = _save(tmp_path, 9)
    _flip(leftover / "state.pt", 100, 4)
    saved = _save(tmp_path, 4, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-4", "step-9"]
    assert checkpoint.find_latest(tmp_path, warn=lambda m: None) == saved


@pytest.mark.parametrize(("limit", "error"), [(8_000, "SafetensorError"), (25_000, "RuntimeError")])
def test_a_full_disk_during_a_save_removes_its_temporary_directory(tmp_path, limit, error):
    """The weights (18.7 KB) or the optimizer (37 KB) cannot be written: whatever the library raises, one
    UserError names the checkpoint, the cause and the free space, and no .tmp-step-6 is left on the full disk
    (the old code let SafetensorError and RuntimeError escape its `except OSError`)."""
    good = _save(tmp_path, 3)
    model, optimizer, scheduler = _training(6)
    with file_size_limit(limit), pytest.raises(UserError) as failed:
        checkpoint.save(tmp_path, 6, model, optimizer, scheduler, {"step": 6}, keep_last=2)
    message = str(failed.value)
    target = tmp_path / "checkpoints" / "step-6"
    assert message.startswith(f"writing {target} failed ({error}: ")
    assert f"free on the disk of {tmp_path / 'checkpoints'}; the previous checkpoints are intact and the " \
           "unfinished .tmp-step-6 was removed. Free disk space or fix permissions, then resume with resume: " \
           "auto" in message
    assert "\n" not in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-3"]
    assert checkpoint.find_latest(tmp_path, warn=lambda m: None) == good


def test_an_oserror_during_a_save_says_the_same(tmp_path):
    """The temporary directory cannot be made (a file of someone else's is in the way: it stays)."""
    model, optimizer, scheduler = _training()
    blocker = tmp_path / "checkpoints" / ".tmp-step-6"
    blocker.parent.mkdir()
    blocker.write_text("a file where the temporary directory must go")
    with pytest.raises(UserError) as failed:
        checkpoint.save(tmp_path, 6, model, optimizer, scheduler, {"step": 6}, keep_last=2)
    assert str(failed.value).startswith(f"writing {tmp_path / 'checkpoints' / 'step-6'} failed (FileExistsError: "
                                        f"[Errno 17] File exists: '{blocker}'); ")
    assert sorted(p.name for p in blocker.parent.iterdir()) == [".tmp-step-6"]


def _tiny_lm():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config), AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def test_final_save_is_atomic_and_a_full_disk_leaves_the_previous_final_intact(tmp_path):
    """The trainer's final save (loop._save_final) on a disk that fills after config.json: one UserError naming
    final/ and the free space; final/ is the previous one, byte for byte, and no .tmp-final is left. (The old
    save wrote into final/ directly: a 0-byte or new config.json beside the old weights, and a traceback.)"""
    from finetune.train.loop import _save_final

    lm, tokenizer = _tiny_lm()
    closed: list[bool] = []
    run = SimpleNamespace(net=lm, lm=lm, tokenizer=tokenizer, world=World(), out=RunDir(tmp_path),
                          logger=SimpleNamespace(close=lambda: closed.append(True)), console=Console(quiet=True),
                          recipe=Recipe.model_validate(tiny_recipe(tmp_path)), qat_unsharded=None)
    _save_final(run)
    before = {p.name: p.read_bytes() for p in (tmp_path / "final").iterdir()}
    assert "model.safetensors" in before and closed == [True]
    with torch.no_grad():
        lm.model.embed_tokens.weight.add_(1.0)
    with file_size_limit(16_000), pytest.raises(UserError) as failed:
        _save_final(run)
    message = str(failed.value)
    assert message.startswith(f"writing {tmp_path / 'final'} failed (SafetensorError: ")
    assert f"free on the disk of {tmp_path}; nothing was half-written: final/ is as it was before this save. " \
           "Free disk space, then run again" in message
    assert {p.name: p.read_bytes() for p in (tmp_path / "final").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert closed == [True]  # the run is not reported finished


def test_start_of_run_budget_is_keep_last_plus_one_checkpoints_and_final(tmp_path):
    """A model of 4,680 float32 weights, all trainable: final 18,720 bytes, a checkpoint 18,720 + 8 x 4,680 =
    56,160. keep_last 2 budgets 3 checkpoints: 18,720 + 168,480 = 187,200 bytes, x 1.1 = 205,920."""
    model, _, _ = _training()
    assert startup.final_bytes(model) == 18_720 and startup.checkpoint_bytes(model) == 56_160
    assert startup.checkpoint_copies(keep_last=2, on_disk=0) == 3
    assert startup.checkpoint_copies(keep_last=2, on_disk=2) == 1  # a resume: two are on disk already
    assert startup.checkpoint_copies(keep_last=2, on_disk=5) == 1
    startup.check_disk_room(tmp_path, model, checkpoints=3, free=205_920)
    with pytest.raises(UserError) as refused:
        startup.check_disk_room(tmp_path, model, checkpoints=3, free=205_919)
    assert str(refused.value) == (
        f"output_dir {tmp_path}: 201.1 KiB free, but the final model and 3 checkpoint(s) (keep_last + 1 coexist "
        "while the newest is written) need about 201.1 KiB. Free disk space, lower checkpoint.keep_last, or choose "
        "another output_dir.")
    # --overwrite frees the previous run first: its bytes count as free.
    startup.check_disk_room(tmp_path, model, checkpoints=3, free=100_000, reclaim=105_920)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "b.txt").write_bytes(b"y" * 24)
    assert startup.tree_bytes(tmp_path, ["old", "b.txt", "missing"]) == 1024


def test_interrupted_saves_leave_nothing_the_next_run_keeps(tmp_path):
    """What a kill -9 mid-save leaves (.tmp-step-N, .tmp-final) is ours to remove once we hold the lock; a
    user's own dot-file is not."""
    from finetune.run import atomic

    (tmp_path / "checkpoints" / ".tmp-step-4").mkdir(parents=True)
    (tmp_path / ".tmp-final").mkdir()
    (tmp_path / ".tmp-notes").write_text("mine")
    assert atomic.remove_temporaries(tmp_path / "checkpoints", checkpoint.PREFIX) == [".tmp-step-4"]
    assert atomic.remove_temporaries(tmp_path, "final") == [".tmp-final"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == [".tmp-notes", "checkpoints"]


def test_copy_of_a_checkpoint_verifies_and_a_swapped_file_does_not(tmp_path):
    a, b = _save(tmp_path, 3), _save(tmp_path, 6)
    shutil.copy2(a / "optimizer.pt", b / "optimizer.pt")  # a whole, valid file of another step
    assert checkpoint.verify(b).startswith("optimizer.pt is ")
    moved = tmp_path / "elsewhere"
    shutil.copytree(a, moved)
    assert checkpoint.verify(moved) is None


# --- replacing final/ (or a checkpoint) never loses both copies -------------------------------------------------

def _old_final(out: Path) -> dict[str, bytes]:
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"old weights" * 100)
    (out / "final" / "config.json").write_text('{"old": true}')
    return _files(out / "final")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _write_new(tmp: Path) -> None:
    (tmp / "model.safetensors").write_bytes(b"new weights" * 100)
    (tmp / "config.json").write_text('{"new": true}')


def test_a_failed_swap_puts_the_previous_final_back(tmp_path, monkeypatch):
    """The rename of the new final/ into place fails once (after the old one went aside): the old one is put back,
    byte for byte, and the message says final/ is as it was. Nothing else is left in the run folder."""
    from finetune.run import atomic

    before = _old_final(tmp_path)
    real = atomic.os.replace

    def replace(src, dst):
        if Path(src).name == ".tmp-final":
            monkeypatch.setattr(atomic.os, "replace", real)  # once
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(UserError, match="final/ is as it was"):
        atomic.write_dir(tmp_path / "final", _write_new, "final/ is as it was before this save")
    assert _files(tmp_path / "final") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    atomic.write_dir(tmp_path / "final", _write_new, "")  # and the next save replaces it whole
    assert _files(tmp_path / "final")["config.json"] == b'{"new": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
from finetune.run import atomic

out, when = Path(sys.argv[1]), sys.argv[2]
real = os.replace

def replace(src, dst):  # kill -9 just before, or just after, the new final/ is renamed into place
    if Path(src).name == ".tmp-final" and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
    if Path(dst).name == "final" and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
def write(tmp):
    (tmp / "model.safetensors").write_bytes(b"new weights" * 100)
    (tmp / "config.json").write_text('{"new": true}')
atomic.write_dir(out / "final", write, "")
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_kill_during_the_final_swap_leaves_a_complete_final(tmp_path, when):
    """A process killed (-9) between the steps of replacing final/: before the new one is renamed into place (the
    old rmtree-then-rename lost both copies there: final/ gone, and the next start removed .tmp-final), or after
    it. The next start (atomic.restore_displaced, then the removal of temporaries, as the trainer does under the
    run lock) leaves one complete final/: the old one, or the new one, byte for byte, and no debris."""
    from finetune.run import atomic

    before = _old_final(tmp_path)
    done = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path), when], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    restored = atomic.restore_displaced(tmp_path, "final")
    atomic.remove_temporaries(tmp_path, "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    if when == "before":
        assert restored == ["put .old-final back as final (a save was interrupted while replacing it)"]
        assert _files(tmp_path / "final") == before
    else:
        assert restored == ["removed .old-final (the older copy of final, replaced)"]
        assert _files(tmp_path / "final") == {"config.json": b'{"new": true}', "model.safetensors": b"new weights" * 100}


def test_restore_touches_only_our_asides(tmp_path):
    from finetune.run import atomic

    (tmp_path / ".old-final").write_text("a user's file, not a directory we renamed aside")
    (tmp_path / ".old-notes").mkdir()
    assert atomic.restore_displaced(tmp_path, "final") == []
    assert atomic.restore_displaced(tmp_path / "missing", "final") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-final", ".old-notes"]


def test_the_next_run_puts_a_final_killed_mid_swap_back_before_it_reads_the_directory(tmp_path):
    """The trainer's start, under the run lock: a finished run whose final/ was renamed aside when a later final save
    was killed (final/ missing, .old-final complete, a .tmp-final half-written). `resume: auto` puts .old-final back
    (and says so) before it looks at the run, removes the half-written one, and ends with one final/."""
    out = tmp_path / "run"
    args = [*TINY, f"output_dir={out}", "train.max_steps=1", "checkpoint.every_steps=1", "resume=auto"]
    first = run_cli("train", str(QUICKSTART), *args)
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "final").rename(out / ".old-final")
    (out / ".tmp-final").mkdir()
    (out / ".tmp-final" / "config.json").write_text("")
    second = run_cli("train", str(QUICKSTART), *args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"{out}: put .old-final back as final (a save was interrupted while replacing it)" in second.stdout
    assert not (out / ".old-final").exists() and not (out / ".tmp-final").exists()
    assert (out / "final" / "model.safetensors").is_file()


def test_a_run_whose_final_is_aside_says_where_it_is(tmp_path):
    from finetune.run.directory import finished_run

    (tmp_path / "recipe.yaml").write_text("train:\n  lr: 0.001\n")
    (tmp_path / ".old-final").mkdir()
    with pytest.raises(UserError) as refused:
        finished_run(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path} has no final/ directory, but .old-final: a final save was killed while replacing final/, and "
        f"that is the previous one. The next `finetune train` of this output_dir puts it back; or rename "
        f"{tmp_path / '.old-final'} to final")


def test_the_trainer_refuses_to_start_without_room_for_keep_last_plus_one_checkpoints_and_final(tmp_path, monkeypatch):
    """Through the trainer (loop.train, in process), with the disk's free space faked: the tests' tiny model has
    51,360 float32 weights (embeddings 1024 x 32, tied; 2 layers of 9,280; the final norm 32), all trainable: final/
    205,440 bytes, a checkpoint 205,440 + 8 x 51,360 = 616,320. keep_last 2 budgets 3 checkpoints:
    (205,440 + 3 x 616,320) x 1.1 = 2,259,840 bytes, 2.2 MiB. 1.5 MiB free would hold final/ and one checkpoint
    (0.9 MiB): the run is refused before its first step, naming the free and the needed space."""
    from finetune.recipe import load_recipe
    from finetune.train.loop import train

    out = tmp_path / "run"
    recipe = load_recipe(QUICKSTART, [*TINY, f"output_dir={out}", "train.max_steps=2", "checkpoint.every_steps=1",
                                      "checkpoint.keep_last=2"])
    real = startup.shutil.disk_usage
    monkeypatch.setattr(startup.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=3 * 2**19) if Path(path) == out else real(path))
    with pytest.raises(UserError) as refused:
        train(recipe, console=Console(quiet=True))
    assert str(refused.value) == (
        f"output_dir {out}: 1.5 MiB free, but the final model and 3 checkpoint(s) (keep_last + 1 coexist while the "
        "newest is written) need about 2.2 MiB. Free disk space, lower checkpoint.keep_last, or choose another "
        "output_dir.")
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
