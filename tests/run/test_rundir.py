"""The run directory is the run's own: a marker says which entries are its, a lock keeps a second run out, and
nothing that is not ours is ever removed: not by --overwrite, and nothing at all by `resume: auto`.

The lock is tested against a real holder in another process (held, then killed with -9), on both the flock path
and the O_EXCL path of a filesystem without flock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, tiny_recipe
from helpers import QUICKSTART, TINY, run_cli, train_lines

from finetune.errors import UserError
from finetune.recipe import validate
from finetune.run import lock, startup
from finetune.run.directory import RUN_FILES

HOLDER = """
import sys
from pathlib import Path
from finetune.run.lock import acquire
held = acquire(Path(sys.argv[1]), use_flock=sys.argv[2] == "flock")
print("held", flush=True)
sys.stdin.read()
"""


def _holder(out: Path, mode: str = "flock") -> subprocess.Popen:
    """Another process that holds out's run lock until its stdin closes or it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), mode], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("mode", ["flock", "exclusive"])
def test_a_held_lock_refuses_with_the_holders_pid_and_a_killed_holders_lock_is_taken_over(tmp_path, mode):
    out = tmp_path / "run"
    proc = _holder(out, mode)
    try:
        with pytest.raises(UserError) as refused:
            lock.acquire(out, use_flock=mode == "flock")
        message = str(refused.value)
        assert message.startswith(f"output_dir {out} is in use by another finetune run (pid {proc.pid} on ")
        assert message.endswith(f"; lock file {out / lock.LOCK_NAME}). Wait for that run to end, or choose "
                                "another output_dir.")
        if mode == "flock":  # the CLI's look before it hands over to torchrun (--nproc)
            from finetune.cli import _preflight_output_dir

            with pytest.raises(UserError, match=f"is in use by another finetune run \\(pid {proc.pid} on "):
                _preflight_output_dir(validate(tiny_recipe(out)), overwrite=True)
    finally:
        _kill(proc)  # kill -9: the holder never releases; its note stays in the lock file
    assert json.loads((out / lock.LOCK_NAME).read_text())["pid"] == proc.pid
    notes: list[str] = []
    with lock.acquire(out, notes.append, use_flock=mode == "flock") as held:
        assert json.loads(held.path.read_text())["pid"] == os.getpid()
        assert len(notes) == 1 and f"left by pid {proc.pid}" in notes[0], notes
    assert not (out / lock.LOCK_NAME).exists()  # released: the next run finds no lock and says nothing
    notes.clear()
    lock.acquire(out, notes.append, use_flock=mode == "flock").release()
    assert notes == []


def test_second_run_on_one_output_dir_is_refused_and_runs_after_the_holder_is_killed(tmp_path):
    """The CLI end to end: a run refused while another process holds the lock (exit 2, the holder's pid, nothing
    written), then, after kill -9 of the holder, a run that takes the stale lock over and finishes."""
    out = tmp_path / "run"
    proc = _holder(out)
    try:
        r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "train.max_steps=1")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"error: output_dir {out} is in use by another finetune run (pid {proc.pid} on " in r.stderr
        assert sorted(p.name for p in out.iterdir()) == [lock.LOCK_NAME]
    finally:
        _kill(proc)
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "train.max_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"took over the lock of output_dir {out} left by pid {proc.pid}" in r.stdout
    assert [x["step"] for x in train_lines(out)] == [1]
    assert not (out / lock.LOCK_NAME).exists()


def test_only_rank_0_takes_the_lock(tmp_path):
    from rich.console import Console

    from finetune.dist import World
    from finetune.train.loop import _run_lock

    recipe = validate(tiny_recipe(tmp_path / "run"))
    with _run_lock(recipe, World(rank=1, size=2), Console(quiet=True)):
        assert not (tmp_path / "run").exists()
    with _run_lock(recipe, World(rank=0, size=2), Console(quiet=True)):
        assert (tmp_path / "run" / lock.LOCK_NAME).is_file()
    assert not (tmp_path / "run" / lock.LOCK_NAME).exists()


# --- the marker: what --overwrite may remove -----------------------------------------------------------------

def _recipe(tmp_path: Path, **patch):
    return validate({**tiny_recipe(tmp_path / "run"), **patch})


def _fill(out: Path, names) -> None:
    for name in names:
        path = out / name
        if "." in name:
            path.write_text(f"{name} of someone\n")
        else:
            (path / "inner").mkdir(parents=True)
            (path / "inner" / "file.txt").write_text("x\n")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_files_no_marker_claims_are_never_written_over_or_removed(tmp_path):
    """A folder with another tool's recipe.yaml, checkpoints/ and wandb/, and no marker: a fresh run is refused
    with and without --overwrite, resume: auto too; nothing is touched."""
    recipe = _recipe(tmp_path, checkpoint={"every_steps": 1}, logging={"wandb": True})
    out = Path(recipe.output_dir)
    out.mkdir()
    _fill(out, ["recipe.yaml", "checkpoints", "wandb", "notes.txt"])
    before = _snapshot(out)
    for overwrite in (False, True):
        for resume in (None, "auto"):
            with pytest.raises(UserError) as refused:
                startup.check_output_dir(out, recipe.model_copy(update={"resume": resume}), resume_from=None,
                                         overwrite=overwrite)
            assert str(refused.value) == (
                f"output_dir {out} holds recipe.yaml, checkpoints, wandb, which no finetune run there claims (no "
                "finetune-run.json lists them): another tool's files, or a run of a finetune older than the "
                "marker. finetune never writes over or removes files that are not its own, with or without "
                "--overwrite: move them away or choose another output_dir.")
    assert _snapshot(out) == before


def test_overwrite_removes_only_what_the_marker_lists(tmp_path):
    """--overwrite over our own run returns (and removes) exactly the marker's entries; another tool's wandb/
    that the recipe does not write, and the user's own files, stay."""
    recipe = _recipe(tmp_path, checkpoint={"every_steps": 1})
    out = Path(recipe.output_dir)
    out.mkdir()
    marker = startup.claim(out, recipe, fresh=True)
    assert marker.files == ("recipe.yaml", "versions.json", "metrics.jsonl", "final", "checkpoints")
    _fill(out, ["recipe.yaml", "metrics.jsonl", "checkpoints", "wandb", "notes.txt"])
    with pytest.raises(UserError, match=r"already holds a run \(metrics.jsonl, recipe.yaml, checkpoints\)"):
        startup.check_output_dir(out, recipe, resume_from=None, overwrite=False)
    replaced = startup.check_output_dir(out, recipe, resume_from=None, overwrite=True)
    assert replaced == ["metrics.jsonl", "recipe.yaml", "checkpoints"]
    kept = {k: v for k, v in _snapshot(out).items() if k.startswith(("wandb", "notes.txt"))}
    startup.remove_previous_run(out, replaced)
    assert sorted(p.name for p in out.iterdir()) == ["finetune-run.json", "notes.txt", "wandb"]
    assert {k: v for k, v in _snapshot(out).items() if k != "finetune-run.json"} == kept
    again = startup.claim(out, recipe, fresh=True)
    assert again.run_id != marker.run_id
    resumed = startup.claim(out, recipe.model_copy(update={"logging": recipe.logging.model_copy(
        update={"tensorboard": True, "wandb": True})}), fresh=False)
    # A resume keeps the run's id and claims what its recipe adds, but not the wandb/ someone else wrote.
    assert resumed.run_id == again.run_id and resumed.files == (*again.files, "tensorboard")


def test_an_unreadable_marker_removes_nothing(tmp_path):
    recipe = _recipe(tmp_path)
    out = Path(recipe.output_dir)
    out.mkdir()
    _fill(out, ["metrics.jsonl"])
    (out / "finetune-run.json").write_text("{not json")
    with pytest.raises(UserError, match=r"finetune-run.json is unreadable \(JSONDecodeError: .*\): finetune cannot "
                                        r"tell which files in output_dir are its run's, so it removes none"):
        startup.check_output_dir(out, recipe, resume_from=None, overwrite=True)


def test_resume_auto_with_nothing_resumable_refuses_and_deletes_nothing(tmp_path):
    """Every checkpoint's trainer_state.json damaged: resume: auto names each one, refuses with what it found and
    the two ways out, and every file is still there, byte for byte (the old trainer deleted the whole run).
    --overwrite then starts over."""
    out = tmp_path / "run"
    args = [*TINY, "train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=2"]
    assert run_cli("train", str(QUICKSTART), f"output_dir={out}", *args).returncode == 0
    shutil.rmtree(out / "final")
    (out / "notes.txt").write_text("the user's notes\n")
    for step in (2, 4):
        state = out / "checkpoints" / f"step-{step}" / "trainer_state.json"
        state.write_bytes(state.read_bytes().replace(b'"step"', b'"stop"'))
    before = _snapshot(out)
    run_id = json.loads((out / "finetune-run.json").read_text())["run_id"]
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *args, "resume=auto")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for step in (4, 2):
        assert (f"skipping checkpoint {out}/checkpoints/step-{step}: trainer_state.json is damaged: its sha256 "
                "differs from the manifest's") in r.stdout
    assert r.stderr == (
        f"error: resume: auto found nothing to resume in output_dir {out}: 2 checkpoint(s) in {out}/checkpoints "
        f"(step-2, step-4), none of which verifies (each named above); it holds metrics.jsonl, recipe.yaml, "
        f"versions.json, checkpoints of run {run_id}. Nothing was deleted. To start over, add --overwrite (it "
        "removes that run's files); to keep them, choose a new output_dir.\n")
    assert _snapshot(out) == before
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *args, "resume=auto", "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in train_lines(out)] == [1, 2, 3, 4]
    assert (out / "notes.txt").read_text() == "the user's notes\n"
    assert json.loads((out / "finetune-run.json").read_text())["run_id"] != run_id


def test_overwrite_over_our_own_run_twice_keeps_the_users_files(tmp_path):
    """What `make quickstart` does, run after run: --overwrite replaces our previous run (new run id, one run's
    metrics), and a file of the user's in output_dir survives."""
    out = tmp_path / "run"
    ids = []
    for _ in range(2):
        r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "train.max_steps=2", "--overwrite")
        assert r.returncode == 0, r.stderr[-3000:]
        (out / "notes.txt").write_text("mine\n")
        ids.append(json.loads((out / "finetune-run.json").read_text())["run_id"])
        assert f"run {ids[-1]} in {out}" in r.stdout
    assert ids[0] != ids[1]
    assert [x["step"] for x in train_lines(out)] == [1, 2]
    assert sorted(p.name for p in out.iterdir()) == ["final", "finetune-run.json", "metrics.jsonl", "notes.txt",
                                                     "recipe.yaml", "versions.json"]


def test_every_run_file_name_is_known():
    """What a recipe can make a run write is among RUN_FILES (the names checked for another owner)."""
    recipe = validate({**tiny_recipe("out"), "checkpoint": {"every_steps": 1},
                       "logging": {"tensorboard": True, "wandb": True, "mlflow": True}})
    assert set(startup.run_files(recipe)) == set(RUN_FILES)


def test_the_check_before_torchrun_names_what_it_skipped_when_it_refuses(tmp_path, capsys):
    """`finetune train --nproc N` checks output_dir before torchrun starts (checkpoint sizes only): a truncated
    checkpoint is named on stderr before the refusal, so the refusal's "each named above" holds there too."""
    import torch

    from finetune.cli import _preflight_output_dir
    from finetune.run import checkpoint

    recipe = _recipe(tmp_path, checkpoint={"every_steps": 1}, resume="auto")
    out = Path(recipe.output_dir)
    out.mkdir()
    startup.claim(out, recipe, fresh=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    saved = checkpoint.save(out, 1, model, optimizer, scheduler, {"step": 1}, keep_last=2)
    (saved / "state.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"^resume: auto found nothing to resume in output_dir .*: 1 checkpoint\(s\)"):
        _preflight_output_dir(recipe, overwrite=False)
    assert capsys.readouterr().err.startswith(f"skipping checkpoint {saved}: state.pt is truncated or unreadable "
                                              "(0 bytes; the manifest records ")


# The billion laughs (as tests/test_bad_inputs.py's recipe case): nine levels of ten aliases, 10^9 values in 1 KB.
ALIAS_BOMB = "train:\n  lr: 0.001\nmodel:\n  config:\n    l0: &l0 [" + ", ".join(["lol"] * 10) + "]\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9))


def test_an_alias_bomb_in_a_runs_recipe_is_refused_quickly(tmp_path):
    """A run directory's recipe.yaml is read with the recipe loader's bounds (`runs compare`, plot, generate, merge
    read it): a 1 KB alias bomb placed there is an error naming the file:line, within seconds, not an hours-long
    walk of 10^9 values."""
    runs = []
    for name, recipe in (("a", ALIAS_BOMB), ("b", "train:\n  lr: 0.002\n")):
        run = tmp_path / name
        run.mkdir()
        (run / "recipe.yaml").write_text(recipe)
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
        runs.append(str(run))
    r = run_cli("runs", "compare", *runs, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith(f"error: {runs[0]}/recipe.yaml:10:9: cannot read the run's recipe (aliases (*name) "
                               "expand this value to more than 1,000,000 values"), r.stderr
