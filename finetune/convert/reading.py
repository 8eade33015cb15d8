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
