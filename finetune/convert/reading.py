"""Reading an Axolotl config strictly: YAML numbers as numbers (1e-4 is a float), a key written twice an error
naming both lines, and anything but a mapping at the top an error. Every problem is a UserError, no traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from finetune.errors import UserError
from finetune.recipe import parse_yaml


def read_config(path: str | Path) -> dict[str, Any]:
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{file}: no such Axolotl config") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{file}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise UserError(f"{file}: cannot read the config ({e.strerror or e})") from None
    try:
        data = parse_yaml(text)  # the recipe reader: numbers as YAML 1.2 reads them, duplicate keys refused
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise UserError(f"{where}: YAML error: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: an Axolotl config is a mapping of keys, got {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise UserError(f"{file}: keys must be strings, got {bad[0]!r}")
    return data


# A chat template or a DeepSpeed JSON is a few KB; a file this large is not one (and is not read whole).
MAX_SIDE_FILE_BYTES = 1 << 20


def read_side_file(file: Path) -> str:
    """The text of a file a config names (a chat template, a DeepSpeed JSON): a regular file, at most
    MAX_SIDE_FILE_BYTES, UTF-8 text without NUL bytes. A ValueError saying why otherwise: a device (/dev/zero)
    would be read forever, a binary file is no template, and /proc/self/environ is NUL-separated secrets."""
    if not file.is_file():
        raise ValueError("not a regular file" if file.exists() else "no such file")
    try:
        with file.open("rb") as handle:
            data = handle.read(MAX_SIDE_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_SIDE_FILE_BYTES:
        raise ValueError(f"larger than {MAX_SIDE_FILE_BYTES >> 20} MB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}): a binary file") from None
    if "\0" in text:
        raise ValueError(f"NUL bytes (the first at byte {data.index(0)}): a binary file")
    return text
