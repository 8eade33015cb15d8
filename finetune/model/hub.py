"""A model or tokenizer named by a hub id, on a machine that cannot reach the hub: loaded from the local cache
without asking the network (huggingface_hub would retry each file for about a minute first), or refused in one line
when the cache does not have it either.

Whether the hub can be reached is asked once per process: a TCP connection to its endpoint, with a short timeout.
HF_HUB_OFFLINE=1 (the hub's own switch) means it cannot.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from finetune.errors import UserError

if TYPE_CHECKING:  # annotations only
    from finetune.recipe import Recipe

CONNECT_TIMEOUT_S = 3.0
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# A repository's files that say it is in the cache: a model's config, a tokenizer-only repository's config.
_MARKERS = ("config.json", "tokenizer_config.json")


@functools.cache
def hub_reachable() -> bool:
    """Whether a connection to the hub's endpoint (HF_ENDPOINT, else huggingface.co) opens within a few seconds."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def local_files_only(name: str | None, key: str) -> bool:
    """Whether `name` (what `key` names) must be loaded from the local cache alone: it is a hub id, the hub cannot
    be reached, and the cache has it. A UserError in one line when the cache does not have it either."""
    if not name or Path(name).expanduser().exists() or not _HUB_ID.fullmatch(name) or hub_reachable():
        return False
    from huggingface_hub import try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(name, marker), str) for marker in _MARKERS):
        return True
    raise UserError(f"{key}: {name!r} is a hub id, and the hub cannot be reached from this machine (no connection "
                    f"to {os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'} within {CONNECT_TIMEOUT_S:g} s, "
                    "or HF_HUB_OFFLINE is set) nor is it in the local cache: download it where there is a network "
                    f"(hf download {name}), or set {key} to a local directory")


def recipe_ids(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, name) of each model or tokenizer the recipe loads by a name that may be a hub id."""
    t, g, d, m = recipe.train.objective, recipe.grpo, recipe.dpo, recipe.model
    named = [("model.path", m.path if m.init == "pretrained" and not m.gguf_file else None),
             ("tokenizer.path", recipe.tokenizer.path),
             ("grpo.reference", g.reference if t == "grpo" and g.beta > 0 and g.reference != "auto" else None),
             ("dpo.reference", d.reference if t == "dpo" and d.reference != "auto" else None),
             ("distill.teacher", recipe.distill.teacher if t == "distill" else None)]
    return [(key, name) for key, name in named if name and "://" not in name]


def check_recipe(recipe: Recipe) -> None:
    """Each hub id the recipe loads is in reach: the hub answers, or the cache has it (else one UserError)."""
    for key, name in recipe_ids(recipe):
        local_files_only(name, key)


def offline_if_unreachable(recipe: Recipe) -> str | None:
    """Before huggingface_hub is imported: when the recipe loads a hub id and the hub cannot be reached, turn on the
    hub's own offline switch (HF_HUB_OFFLINE=1, read when it is imported), so what the cache has loads at once. Returns
    what to tell the user (None when nothing was changed)."""
    if "huggingface_hub" in sys.modules or "HF_HUB_OFFLINE" in os.environ:
        return None
    if not any(_HUB_ID.fullmatch(name) and not Path(name).expanduser().exists() for _, name in recipe_ids(recipe)):
        return None
    if hub_reachable():
        return None
    os.environ["HF_HUB_OFFLINE"] = "1"
    return "the hub cannot be reached from this machine: hub ids are loaded from the local cache only (HF_HUB_OFFLINE=1)"
