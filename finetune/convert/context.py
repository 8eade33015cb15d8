"""One conversion in progress: the Axolotl config read, the recipe being written, and everything to report.

Rules read the config through the typed getters (a wrong type is a problem naming the key, never a crash), write
the recipe with `put`, and record what they could not carry over: `refuse` (a problem: exit 2), `approximate` (a
problem unless --allow-approx, then announced), `drop` (no effect here: listed in the recipe's header), `default`
(an Axolotl default written out because finetune's differs) and `note`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


@dataclass
class Conversion:
    config: dict[str, Any]
    allow_approx: bool = False
    allow_template_path: bool = False
    """Read chat_template_jinja from a file outside the config's folder too (--allow-template-path)."""
    recipe: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    approximations: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    defaults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unset: list[str] = field(default_factory=list)

    # --- reading the config -----------------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        """Whether the config sets `key` (null counts as unset, as in Axolotl)."""
        return self.config.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        return default if value is None else value

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            return self._wrong(key, value, "true or false", default)
        return value

    def integer(self, key: str, default: int | None = None, minimum: int | None = 0) -> int | None:
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            return self._wrong(key, value, "a whole number", default)
        if minimum is not None and value < minimum:
            return self._wrong(key, value, f"a whole number >= {minimum}", default)
        return value

    def number(self, key: str, default: float | None = None, text_ok: bool = False) -> float | None:
        """A number; `text_ok`: also a string that reads as one (Axolotl's learning_rate is str | float)."""
        value = self.config.get(key)
        if value is None:
            return default
        if text_ok and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return self._wrong(key, value, "a number", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return self._wrong(key, value, "a number", default)
        return float(value)

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            return self._wrong(key, value, "a string", default)
        return value

    def texts(self, key: str) -> list[str] | None:
        value = self.config.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return self._wrong(key, value, "a list of strings", None)
        return value

    def mapping(self, key: str) -> dict[str, Any] | None:
        value = self.config.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            return self._wrong(key, value, "a mapping", None)
        return value

    def _wrong(self, key: str, value: Any, expected: str, default: Any) -> Any:
        self.refuse(key, f"got {value!r}; Axolotl expects {expected}")
        return default

    # --- writing the recipe and the report --------------------------------------------------------------------

    def put(self, dotted: str, value: Any) -> None:
        """Set a recipe key (`train.lr`); sections are created as needed."""
        *sections, last = dotted.split(".")
        node = self.recipe
        for name in sections:
            node = node.setdefault(name, {})
        node[last] = value

    def peek(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.recipe
        for name in dotted.split("."):
            if not isinstance(node, dict) or name not in node:
                return default
            node = node[name]
        return node

    def default(self, dotted: str, value: Any, why: str) -> None:
        """Write an Axolotl default that differs from finetune's, and say so in the header."""
        self.put(dotted, value)
        self.defaults.append(f"{dotted}: {_show(value)} ({why})")

    def carry(self, key: str, dotted: str, value: Any, why: str) -> None:
        """`value` (read from `key`, or Axolotl's default for it) into the recipe; a default is said so."""
        if self.has(key):
            self.put(dotted, value)
        else:
            self.default(dotted, value, why)

    def refuse(self, key: str, why: str) -> None:
        self.problems.append(f"{key}: {why}")

    def approximate(self, key: str, what: str) -> None:
        """What the recipe does instead of `key`: accepted with --allow-approx, a problem without."""
        if self.allow_approx:
            self.approximations.append(f"{key}: {what}")
        else:
            self.problems.append(f"{key}: only approximately: {what} (--allow-approx accepts it)")

    def drop(self, key: str, why: str) -> None:
        self.dropped.append((key, why))

    def note(self, text: str) -> None:
        self.notes.append(text)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def is_off(value: Any) -> bool:
    """A value that leaves a feature off: null, false, 0, an empty string, list or mapping."""
    return value is None or value is False or (not isinstance(value, bool) and value in (0, "", [], {}))
