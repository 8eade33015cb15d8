"""Directories written whole or not at all: a temporary sibling, every file fsynced, one rename into place.

Checkpoints and final/ are written this way. Any failure while writing (an OSError, a SafetensorError, torch's
RuntimeError: whatever the writer raises) removes the temporary directory and becomes one UserError that names
the path and the free space, so a full disk leaves neither debris nor a half-written directory behind.

Replacing an older directory takes two renames (the old one aside to `.old-NAME`, the new one into place), then the
old one is removed: at every moment NAME or its aside is complete. A kill between the renames leaves only the aside;
the next run (holding the lock) puts it back with `restore_displaced` before it reads the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from finetune.errors import UserError, first_line

TMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"


def temporary(target: Path) -> Path:
    """Where `target` is written before its rename: a hidden sibling in the same directory (same filesystem)."""
    return target.parent / f"{TMP_PREFIX}{target.name}"


def make_temporary(tmp: Path) -> None:
    """An empty `tmp`, replacing what an interrupted write left there."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    discard(tmp)
    tmp.mkdir()


def discard(tmp: Path) -> None:
    """Remove the temporary directory `tmp` (a file there is not ours: it stays, and the mkdir after fails)."""
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)


def displaced(target: Path) -> Path:
    """Where an older `target` waits while its replacement is renamed into place: a hidden sibling."""
    return target.parent / f"{ASIDE_PREFIX}{target.name}"


def commit(tmp: Path, target: Path) -> None:
    """fsync every file of `tmp`, then rename it to `target`. An older `target` (a rewrite of the same step, a second
    final save) is renamed aside first and removed last, so a kill at any point leaves one complete copy; a
    failure of the second rename puts the older one back."""
    fsync_tree(tmp)
    aside = displaced(target)
    if target.exists():
        discard(aside)  # a finished swap's leftover: `target` exists, so it is the complete copy
        os.replace(target, aside)
    try:
        fsync_dir(target.parent)
        os.replace(tmp, target)
    except BaseException:
        if aside.exists() and not target.exists():
            os.replace(aside, target)
        raise
    fsync_dir(target.parent)
    discard(aside)


def restore_displaced(folder: Path, name_prefix: str) -> list[str]:
    """Finish the swaps a kill interrupted in `folder` (a run folder whose lock this process holds): an aside
    `.old-NAME` (NAME starting with `name_prefix`) goes back to NAME when NAME is missing, and is removed when NAME
    is there (the new copy made it). Returns what was done, in words."""
    if not folder.is_dir():
        return []
    done = []
    for aside in sorted(p for p in folder.iterdir() if p.name.startswith(ASIDE_PREFIX + name_prefix)):
        target = folder / aside.name[len(ASIDE_PREFIX):]
        if not aside.is_dir() or aside.is_symlink():
            continue  # not a directory we renamed aside: not ours to touch
        if target.exists() or target.is_symlink():
            discard(aside)
            done.append(f"removed {aside.name} (the older copy of {target.name}, replaced)")
        else:
            os.replace(aside, target)
            fsync_dir(folder)
            done.append(f"put {aside.name} back as {target.name} (a save was interrupted while replacing it)")
    return done


def write_dir(target: Path, write: Callable[[Path], None], consequence: str) -> None:
    """Run `write(tmp)` into a temporary directory and rename it to `target`; on any failure, remove the
    temporary directory and raise `failure(...)` with `consequence` (what is intact, what to do)."""
    tmp = temporary(target)
    try:
        make_temporary(tmp)
        write(tmp)
        commit(tmp, target)
    except Exception as e:  # whatever the writer raises: the disk is as full for safetensors as for open()
        discard(tmp)
        raise failure(target, e, consequence) from None
    except BaseException:  # interrupted (Ctrl-C): no debris either, and the interrupt goes on
        discard(tmp)
        raise


def failure(target: Path, error: BaseException | None, consequence: str) -> UserError:
    """The one message of a failed write: the path, the cause, the free space there, and what to do."""
    cause = f"{type(error).__name__}: {first_line(error)}" if error is not None else "failed on another rank"
    return UserError(f"writing {target} failed ({cause}); {free_space_text(target.parent)}; {consequence}")


def free_space_text(path: Path) -> str:
    """'1.50 GiB free on the disk of PATH' for the nearest existing folder of `path`."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as e:
        return f"free space on the disk of {probe} unknown ({first_line(e)})"
    return f"{size_text(free)} free on the disk of {probe}"


def size_text(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def remove_temporaries(folder: Path, name_prefix: str) -> list[str]:
    """Remove the temporary directories an interrupted write of `name_prefix`... left in `folder` (a folder of a
    run whose lock this process holds, so no other run is writing them); returns their names."""
    if not folder.is_dir():
        return []
    found = sorted(p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX + name_prefix))
    for name in found:
        discard(folder / name)
    return found


def fsync_tree(folder: Path) -> None:
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            fsync(file)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories; rename is still atomic
        fsync(path)
