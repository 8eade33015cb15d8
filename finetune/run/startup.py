"""Starting a run in a directory: whose files are there, what a new run may replace, and room on the disk.

A run directory is ours only if it says so. A run writes output_dir/finetune-run.json (the marker) when it starts
writing: its run id and the entries it owns (recipe.yaml, metrics.jsonl, checkpoints/, final/, and the tracker
folders its recipe turns on). Only what the marker lists is ever removed, and only under `--overwrite`. A file
with a run's name (recipe.yaml, checkpoints/, wandb/, ...) that no marker claims belongs to someone else: a fresh
run refuses to write over it, with or without --overwrite. `resume: auto` never removes anything: with nothing
resumable in a directory that holds a run, it refuses and says what it found and the two ways out.

Rank 0 alone runs this, holding the run lock (finetune/run/lock.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import UserError, first_line
from finetune.recipe import Recipe
from finetune.run.atomic import size_text
from finetune.run.directory import MARKER_NAME, RUN_FILES, RunDir

MARKER_FORMAT = 1


@dataclass(frozen=True)
class Marker:
    """What finetune-run.json says: the run's id, when it started, and the entries of output_dir it owns."""

    run_id: str
    created: str
    files: tuple[str, ...]


def run_files(recipe: Recipe) -> tuple[str, ...]:
    """The entries of output_dir a run of `recipe` writes (and so owns)."""
    names = ["recipe.yaml", "versions.json", "metrics.jsonl", "final"]
    if recipe.checkpoint.every_steps or recipe.checkpoint.every_epochs:
        names.append("checkpoints")
    if recipe.logging.tensorboard:
        names.append("tensorboard")
    if recipe.logging.wandb:
        names.append("wandb")
    if recipe.logging.mlflow:
        names += ["mlflow.db", "mlartifacts", "mlruns"]
    return tuple(names)


def read_marker(out: Path) -> Marker | None:
    """The marker of output_dir `out`; None when there is none; a UserError when it cannot be read (then no one can
    tell which files are the run's, so nothing may be removed)."""
    path = RunDir(out).marker
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        marker = Marker(str(data["run_id"]), str(data.get("created", "")), tuple(str(f) for f in data["files"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}: {first_line(e)}): finetune cannot tell which "
                        "files in output_dir are its run's, so it removes none. Delete or fix that file, or "
                        "choose another output_dir.") from None
    return marker


def check_output_dir(out: Path, recipe: Recipe, *, resume_from: Path | None, overwrite: bool) -> list[str]:
    """Whether a run may start in `out` (a new run, or a resume of `resume_from`), or a UserError saying why not
    and what to do. Returns the previous run's entries --overwrite will remove: only what its marker lists. They
    are removed (`remove_previous_run`) only after the tokenizer, the data and the model have loaded, so a bad
    input never costs the user the run they already had."""
    present = [name for name in RUN_FILES if (out / name).exists()]
    if resume_from is not None and _inside(resume_from, out):
        present = []  # resuming this directory's own run (its marker may predate markers): its files are its own
    marker = read_marker(out) if present else None
    ours = [name for name in present if marker is not None and name in marker.files]
    foreign = [name for name in present if name not in ours and name in run_files(recipe)]
    if foreign:
        raise UserError(
            f"output_dir {out} holds {', '.join(foreign)}, which no finetune run there claims (no "
            f"{MARKER_NAME} lists {'it' if len(foreign) == 1 else 'them'}): another tool's files, or a run of a "
            "finetune older than the marker. finetune never writes over or removes files that are not its own, "
            "with or without --overwrite: move them away or choose another output_dir.")
    if resume_from is None and ours and not overwrite:
        if recipe.resume == "auto":
            raise _nothing_to_resume(out, ours, marker)
        raise UserError(f"output_dir {out} already holds a run ({', '.join(ours)}). Use resume: auto to "
                        "continue it, another output_dir, or --overwrite to replace it.")
    _check_writable(out)
    return ours if resume_from is None and overwrite else []


def _inside(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output_dir {out} is not writable ({e})") from None


def _nothing_to_resume(out: Path, ours: list[str], marker: Marker | None) -> UserError:
    root = RunDir(out).checkpoints
    tried = sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) if root.is_dir() else []
    if tried:
        found = f"{len(tried)} checkpoint(s) in {root} ({', '.join(tried)}), none of which verifies (each named above)"
    elif "final" in ours:
        found = "no checkpoint (the run finished, with final/, without writing checkpoints)"
    else:
        found = "no checkpoint (the run stopped before writing its first one)"
    run = f" of run {marker.run_id}" if marker else ""
    return UserError(f"resume: auto found nothing to resume in output_dir {out}: {found}; it holds "
                     f"{', '.join(ours)}{run}. Nothing was deleted. To start over, add --overwrite (it removes "
                     "that run's files); to keep them, choose a new output_dir.")


def remove_previous_run(out: Path, names: list[str]) -> None:
    """Remove the previous run's entries `names` (from its marker, via check_output_dir)."""
    for name in names:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def claim(out: Path, recipe: Recipe, *, fresh: bool) -> Marker:
    """Write the marker: a new run id and the recipe's entries (fresh), or, resuming, the run's own id and
    entries plus those the recipe adds that nobody has written yet. A resumed run from a finetune without markers
    claims the recipe's entries: its checkpoint verified and its training keys matched, so they are its own."""
    previous = None
    if not fresh:
        try:
            previous = read_marker(out)
        except UserError:
            previous = None  # unreadable: the resumed run writes a fresh one
    planned = run_files(recipe)
    if previous is None:
        marker = Marker(new_run_id(), time.strftime("%Y-%m-%d %H:%M:%S %z"), planned)
    else:
        added = tuple(name for name in planned if name not in previous.files and not (out / name).exists())
        marker = Marker(previous.run_id, previous.created, previous.files + added)
    write_marker(out, marker)
    return marker


def write_marker(out: Path, marker: Marker) -> None:
    """Write finetune-run.json atomically (a temporary file renamed over it)."""
    path = RunDir(out).marker
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"finetune_run": MARKER_FORMAT, "run_id": marker.run_id, "created": marker.created,
                               "files": list(marker.files)}, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


# --- room on the disk ------------------------------------------------------------------------------------

def check_disk_room(out: Path, model: Any, *, checkpoints: int, reclaim: int = 0, free: int | None = None) -> None:
    """Refuse to start when the disk cannot hold the final model and `checkpoints` checkpoints at once.

    A checkpoint holds the trainable weights and two float32 AdamW moments per trainable weight; the final model
    every weight (or only the adapter, when one is trained). `checkpoints` is keep_last + 1 (the one being
    written while keep_last remain), less those a resumed run already has on disk. `reclaim`: bytes --overwrite
    will remove first. `free` defaults to the disk's free space (tests pass a small budget).
    """
    # 10% more: a margin for tokenizer files, metrics and filesystem overhead.
    needed = (final_bytes(model) + checkpoints * checkpoint_bytes(model)) * 11 // 10
    free = shutil.disk_usage(out).free if free is None else free
    if free + reclaim < needed:
        what = f" and {checkpoints} checkpoint(s) (keep_last + 1 coexist while the newest is written)" \
            if checkpoints else ""
        have = f"{size_text(free)} free" + (f" (+{size_text(reclaim)} that --overwrite removes)" if reclaim else "")
        raise UserError(f"output_dir {out}: {have}, but the final model{what} need about {size_text(needed)}. "
                        "Free disk space, lower checkpoint.keep_last, or choose another output_dir.")


def checkpoint_copies(keep_last: int, on_disk: int) -> int:
    """How many more checkpoints the disk must hold: keep_last + 1 coexist while the newest is written, less those
    already on disk (a resumed run's), and at least the one being written."""
    return max(1, keep_last + 1 - on_disk)


def checkpoint_bytes(model: Any) -> int:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in trainable) + 8 * sum(p.numel() for p in trainable)


def final_bytes(model: Any) -> int:
    params = [p for p in model.parameters() if p.requires_grad] if hasattr(model, "peft_config") \
        else list(model.parameters())
    return sum(p.numel() * p.element_size() for p in params)


def tree_bytes(out: Path, names: list[str]) -> int:
    """The bytes of the files under out/NAME for each name (what removing them frees)."""
    total = 0
    for name in names:
        path = out / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
        total += sum(p.stat().st_size for p in files)
    return total
