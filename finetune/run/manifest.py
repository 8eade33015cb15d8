"""A checkpoint's manifest: every file's name, size and sha256, written last inside the temporary directory.

A checkpoint is trusted by its content, not by its files' presence: a truncated file, a damaged optimizer.pt or a
kilobyte of zeros inside model.safetensors all differ from what was written, and `check` says which file and how.
Hashing reads every byte; the files are hashed in parallel threads (hashlib releases the GIL).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 * 2**20


def write(folder: Path) -> None:
    """Write folder/manifest.json describing every other file under `folder`, and fsync it."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = _hash_all(folder, names)
    files = {name: {"size": (folder / name).stat().st_size, "sha256": digests[name]} for name in names}
    path = folder / MANIFEST
    path.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1), encoding="utf-8")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(folder: Path) -> dict[str, dict[str, Any]] | str:
    """The manifest's files ({name: {size, sha256}}), or a problem in words when it is missing or unreadable."""
    path = folder / MANIFEST
    if not path.is_file():
        return f"{MANIFEST} is missing"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                for v in files.values()):
            raise ValueError("files: expected {name: {size, sha256}}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    return files


def check(folder: Path, deep: bool = True) -> str | None:
    """None when every file the manifest lists is there with its size (and, `deep`, its sha256); else the first
    problem found, in words naming the file."""
    files = read(folder)
    if isinstance(files, str):
        return files
    for name, entry in files.items():
        path = folder / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            return f"{MANIFEST} lists {name!r}, outside the checkpoint"
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} is truncated or unreadable ({size} bytes; the manifest records {entry['size']})"
    if deep:
        digests = _hash_all(folder, list(files))
        for name, entry in files.items():
            if digests[name] != entry["sha256"]:
                return f"{name} is damaged: its sha256 differs from the manifest's (changed after it was written)"
    return None


def _hash_all(folder: Path, names: list[str]) -> dict[str, str]:
    if len(names) <= 1:
        return {name: sha256(folder / name) for name in names}
    with ThreadPoolExecutor(max_workers=min(8, len(names), os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda name: sha256(folder / name), names)))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
