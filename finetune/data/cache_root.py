"""Where the data cache lives: data.cache_dir, else $FINETUNE_CACHE_DIR, else $XDG_CACHE_HOME/finetune/data
(~/.cache/finetune/data). One rule for the cache's entries (cache.py) and the images stored beside them
(image_files.py, which cache.py imports through the samples: hence a module of its own)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FINETUNE_CACHE_DIR"


def cache_root_for(cache_dir: str | None) -> Path:
    """The data cache's root for a recipe's data.cache_dir (None: not set)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "finetune" / "data"
