"""The converted recipe as YAML: a header comment saying where it came from, the Axolotl defaults written out,
the approximations accepted, every dropped key with why, and notes; then the keys in the schema's order."""

from __future__ import annotations

import textwrap
from typing import Any

import yaml
from pydantic import BaseModel

from finetune import __version__
from finetune.convert.context import Conversion
from finetune.recipe import Recipe

WIDTH = 110


def recipe_text(c: Conversion, source: str) -> str:
    """The recipe file: header, then the YAML of c.recipe in the schema's key order."""
    body = yaml.safe_dump(_ordered(c.recipe, Recipe), sort_keys=False, allow_unicode=True, width=WIDTH)
    return header(c, source) + body


def header(c: Conversion, source: str) -> str:
    lines = [f"Converted by `finetune convert axolotl` (finetune {__version__}) from {source}.",
             "It trains what Axolotl trains with that config; the differences are listed here."]
    sections = [("Axolotl defaults that differ from finetune's, written out:", c.defaults),
                ("Approximations (accepted with --allow-approx):", c.approximations),
                ("Dropped, as they change nothing that is trained here:", _grouped(c.dropped)),
                ("Notes:", c.notes),
                ("Set to null, so unset (Axolotl's defaults apply):", [", ".join(c.unset)] if c.unset else [])]
    for title, items in sections:
        if items:
            lines.append(title)
            for item in items:
                lines += textwrap.wrap(item, WIDTH - 6, initial_indent="  ", subsequent_indent="      ")
    return "".join(f"# {line}\n" for line in lines)


def _grouped(dropped: list[tuple[str, str]]) -> list[str]:
    """'key, key, ...: why', one line per reason, in the order reasons first appear."""
    by_reason: dict[str, list[str]] = {}
    for key, why in dropped:
        by_reason.setdefault(why, []).append(key)
    return [f"{', '.join(dict.fromkeys(keys))}: {why}" for why, keys in by_reason.items()]


def _ordered(value: Any, model: Any) -> Any:
    """A copy of `value` with mapping keys in the order `model` (a schema class) declares them."""
    if isinstance(value, list):
        inner = _item_model(model)
        return [_ordered(v, inner) for v in value]
    if not isinstance(value, dict):
        return value
    fields = model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}
    order = {name: i for i, name in enumerate(fields)}
    keys = sorted(value, key=lambda k: order.get(k, len(order)))
    return {k: _ordered(value[k], _field_model(fields.get(k))) for k in keys}


def _field_model(field: Any) -> Any:
    if field is None:
        return None
    annotation = field.annotation
    return annotation if isinstance(annotation, type) else _item_model(annotation)


def _item_model(annotation: Any) -> Any:
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
