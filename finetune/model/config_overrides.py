"""model.config_overrides: keys set on a pretrained model's own config (its config.json) before its weights load.

Each key is checked against the config as loaded: a key the config does not have is an error naming the close ones
(and the sub-config or the mapping that has a key of that name: a vision-language model's text_config, transformers
5's rope_parameters), so that a typo never loads a model that silently ignores it. A mapping given for a sub-config
(text_config, vision_config) is merged into it, key by key, under the same rule; any other value replaces the key's
whole value, as Axolotl's `setattr` does. transformers' own type checks (its configs are strict dataclasses) name a
value of the wrong type. Nothing here loads a weight: the checks run before the model does.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from finetune.errors import UserError, first_line
from finetune.recipe import ModelConfig

KEY = "model.config_overrides"


def overridden_config(cfg: ModelConfig, path: str, **kwargs: Any) -> Any | None:
    """The config of the model at `path` (kwargs: gguf_file, local_files_only, as the model loads) with
    model.config_overrides set on it; None when there are none (the model then loads its own config)."""
    if not cfg.config_overrides:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError):
        return None  # loading the model says why, naming the file
    return apply_overrides(config, cfg.config_overrides)


def apply_overrides(config: Any, overrides: Mapping[str, Any], where: str = KEY) -> Any:
    """`config` with `overrides` set on it (in place; returned), each key checked first; a UserError naming the key
    (`where`.key) otherwise."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        at = f"{where}.{key}"
        if key not in known_keys(config):
            raise UserError(f"{at}: {type(config).__name__} has no key {key!r}{_hint(config, key)}")
        current = getattr(config, key, None)
        if isinstance(current, PretrainedConfig):
            if not isinstance(value, Mapping):
                raise UserError(f"{at}: {key} is a sub-config ({type(current).__name__}); give a mapping of its keys, "
                                f"e.g. {{{key}: {{attention_dropout: 0.1}}}}")
            apply_overrides(current, value, at)
            continue
        try:
            setattr(config, key, value)
        except Exception as e:  # noqa: BLE001 - transformers' strict field validation, worded for the key
            raise UserError(f"{at}: {value!r} is refused by {type(config).__name__} ({first_line(e)})") from None
    return config


def known_keys(config: Any) -> set[str]:
    """The keys a config has: its fields, what it serializes, and the aliases transformers maps onto them."""
    keys = set(config.to_dict()) | set(getattr(config, "attribute_map", {}) or {})
    if dataclasses.is_dataclass(config):
        keys |= {f.name for f in dataclasses.fields(config)}
    return {k for k in keys if not k.startswith("_")}


def _hint(config: Any, key: str) -> str:
    """Where a key of that name is (a sub-config, a mapping such as rope_parameters), else the close keys."""
    from transformers import PretrainedConfig

    for name in sorted(known_keys(config)):
        value = getattr(config, name, None)
        inner = known_keys(value) if isinstance(value, PretrainedConfig) else \
            set(value) if isinstance(value, Mapping) else set()
        if key in inner:
            if isinstance(value, PretrainedConfig):
                return f"; its {name} has it: write {{{name}: {{{key}: ...}}}} (merged into {name})"
            return (f"; {name} has it: write {{{name}: {{...}}}}, the whole mapping (it replaces {name}, now "
                    f"{dict(value)})")
    close = difflib.get_close_matches(key, sorted(known_keys(config)), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else f" (its keys: {', '.join(sorted(known_keys(config)))})"
