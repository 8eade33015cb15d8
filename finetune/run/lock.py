"""The run lock: one live run per output_dir.

Rank 0 holds an exclusive `flock` on output_dir/finetune-run.lock for the run's life, and the file says who holds
it (pid, host, start time). The kernel drops a flock when its process dies, so a lock left by a run killed with
-9 is free to take, and the next run says whose it was. Nothing checks and then writes: the flock itself decides.

On a filesystem without flock (some Lustre or FUSE mounts) the lock file is created with O_EXCL instead; a file
whose holder on this host is no longer running is stale and is replaced, one that names another host is not
(its pid cannot be checked from here), and the message says how to remove it.

A released lock file is deleted; a contender that opened it just before checks, once it holds the flock, that
the file it locked is still the one at the path, and starts over otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.errors import UserError

LOCK_NAME = "finetune-run.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_ATTEMPTS = 20


class RunLock:
    """A held run lock; `release` (or leaving a `with` block) deletes the file and lets the next run in."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):  # unlinked while still held: no one can lock a file about to vanish
            os.unlink(self.path)
        os.close(self._fd)  # closing drops the flock
        self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def acquire(out: Path, note: Callable[[str], Any] = print, *, use_flock: bool = True) -> RunLock:
    """Lock output_dir `out` (created if missing) for this process, or a UserError naming the holder's pid.

    `note` is told when a stale lock (its run ended without releasing it) is taken over. `use_flock=False` takes
    the O_EXCL path a filesystem without flock gets.
    """
    path = out / LOCK_NAME
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = _lock_flock(path, out) if use_flock else None
        if fd is None:
            fd = _lock_exclusive(path, out, note)
        else:
            previous = _read_holder(fd)
            if previous:
                note(f"took over the lock of output_dir {out} left by pid {previous.get('pid')} on "
                     f"{previous.get('host')} (that run ended without releasing it, e.g. killed)")
        _write_holder(fd)
    except OSError as e:
        raise UserError(f"output_dir {out} is not writable ({e})") from None
    return RunLock(path, fd)


def check_free(out: Path) -> None:
    """Refuse (UserError naming the holder) when a live run holds `out`'s lock; takes nothing. The CLI calls it
    before starting torchrun, so a busy output_dir ends with this message rather than a failed worker's."""
    path = out / LOCK_NAME
    if not path.exists():
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return  # released meanwhile, or unreadable: the trainer's own acquire decides
    try:
        fcntl = _fcntl()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise _busy(out, path, _read_holder(fd)) from None
    except OSError:
        pass  # no flock here: the trainer's O_EXCL path checks the holder
    finally:
        os.close(fd)


def _fcntl() -> Any:
    import fcntl  # POSIX only; imported here so that the module imports everywhere

    return fcntl


def _lock_flock(path: Path, out: Path) -> int | None:
    """The fd of `path` with our flock on it; None when this filesystem has no flock."""
    fcntl = _fcntl()
    for _ in range(_ATTEMPTS):
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CLOEXEC), False
            except FileNotFoundError:
                continue  # released meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _busy(out, path, holder) from None
        except OSError as e:
            os.close(fd)
            if e.errno in _NO_FLOCK:
                if created:  # the O_EXCL path creates it again, with its holder in it
                    with contextlib.suppress(OSError):
                        path.unlink()
                return None
            raise
        if _same_file(path, fd):
            return fd
        os.close(fd)  # its holder released and deleted it after we opened it: lock the file now at `path`
    raise UserError(f"output_dir {out}: could not take the run lock {path} ({_ATTEMPTS} attempts; another run "
                    "keeps starting and ending there); try again")


def _lock_exclusive(path: Path, out: Path, note: Callable[[str], Any]) -> int:
    """The O_EXCL lock of a filesystem without flock: create the file, or replace one whose holder is gone."""
    for attempt in range(_ATTEMPTS):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            pass
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue  # released meanwhile
        holder = _parse(text)
        if not holder and attempt < 3:  # created, its holder not written yet: wait for it
            time.sleep(0.1)
            continue
        if holder and _alive(holder):
            raise _busy(out, path, holder)
        if holder and holder.get("host") != socket.gethostname():
            raise UserError(f"output_dir {out} is locked by pid {holder.get('pid')} on host {holder.get('host')} "
                            f"(lock file {path}; this filesystem has no flock, so a holder on another host "
                            "cannot be checked). If that run has ended, delete the lock file; otherwise choose "
                            "another output_dir.")
        # Stale: remove it only if it still says what we judged (another contender may have replaced it).
        with contextlib.suppress(FileNotFoundError):
            if path.read_text(encoding="utf-8") == text:
                path.unlink()
                note(f"took over the lock of output_dir {out} left by pid {holder.get('pid') if holder else '?'} "
                     "(that run is no longer running)")
    raise UserError(f"output_dir {out}: could not take the run lock {path} after {_ATTEMPTS} attempts; try again")


def _busy(out: Path, path: Path, holder: dict[str, Any] | None) -> UserError:
    who = (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}" if holder
           else "a process that has not written its pid yet")
    return UserError(f"output_dir {out} is in use by another finetune run ({who}; lock file {path}). Wait for "
                     "that run to end, or choose another output_dir.")


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the holder runs: on this host, its pid exists (a pid of another user's process counts)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        return _parse(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
    except OSError:
        return None


def _parse(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _write_holder(fd: int) -> None:
    note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %z")})
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode(), 0)
    os.fsync(fd)
