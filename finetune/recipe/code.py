"""Code a recipe names (reward functions, tools, an environment), where each reference came from, and the user's
consent to run it (docs/rl.md, "Code in recipes").

A reward function given as `module.path:function` is imported and called with the rows: running it is the same
trust as running that Python yourself. A recipe can reach a user through a recipe repository or an `extends:` chain
written by someone else, so such a recipe must not be able to give that trust: consent is `--allow-code` on the
command line or `allow_code: true` in the recipe file the user runs (not one in a recipe repository), never
inherited. Without it, a command that would run the code stops (exit 2) naming every reference and the file it
came from; nothing is imported. The shipped built-ins need no consent.

`model.trust_remote_code: true` is Hugging Face's own consent to run a model's Python files. Written in the user's
own recipe (or on the command line) it is that consent; inherited from another file it is one more reference that
needs ours.

Only the standard library: `finetune validate` stays fast (importing a reference is its own cost).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError, first_line

if TYPE_CHECKING:  # annotations only
    from finetune.recipe.schema import Recipe

BUILT_IN_REWARDS = ("exact_answer", "format_regex", "length", "reward_model")
"""Reward functions shipped with finetune (finetune/rl/rewards.py): they need no consent."""

CONSENT_KEY = "allow_code"
REMOTE_CODE_KEY = "model.trust_remote_code"
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_SPEC = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")


def spec_problem(spec: str) -> str | None:
    """Why `spec` is not `module.path:function` (None when it is): checked when the recipe loads, with or without
    consent, so `:f` or `.mod:f` never reaches an import."""
    if _SPEC.fullmatch(spec):
        return None
    module, colon, name = spec.partition(":")
    if not colon:
        return "no ':' between the module and the function"
    if not module:
        return "an empty module name"
    if not name:
        return "an empty function name"
    if module.startswith("."):
        return "a relative module name (a leading '.'): give the module's full dotted name"
    return "the module and the function must be Python names (letters, digits, '_'), dotted"


@dataclass(frozen=True)
class Origin:
    """Where a recipe value was written: a file (with the `extends:` chain that reached it) or the command line."""

    text: str
    """For messages: '/path/a.yaml (recipe repository team@1a2b3c4), extended from ./recipe.yaml'."""
    own: bool
    """Written by the user: the command line, or the recipe file they run when it is not a repository's."""
    folder: Path | None = None
    """The folder of the file that wrote it, where its module is looked for first (None: the command line)."""


COMMAND_LINE = Origin("the command line", own=True)


@dataclass(frozen=True)
class CodeRef:
    """One piece of code a recipe names."""

    key: str
    """The dotted recipe key: grpo.rewards.0.function."""
    spec: str
    """module.path:function, or the model path for model.trust_remote_code."""
    origin: Origin

    def describe(self) -> str:
        return f"{self.key}: {self.spec} (from {self.origin.text})"


def references(recipe: Recipe) -> list[CodeRef]:
    """Every piece of code the recipe names that needs consent, with its origin (recipe.code_origins, filled by
    the loader; a recipe built in code is the user's own)."""
    origins = recipe.code_origins
    named = [(f"grpo.rewards.{i}.function", r.function) for i, r in enumerate(recipe.grpo.rewards)
             if r.function not in BUILT_IN_REWARDS]
    named += [(f"grpo.tools.{i}", spec) for i, spec in enumerate(recipe.grpo.tools)]
    named += [("grpo.environment", recipe.grpo.environment)] if recipe.grpo.environment else []
    refs = [CodeRef(key, spec, origins.get(key, COMMAND_LINE)) for key, spec in named]
    remote = origins.get(REMOTE_CODE_KEY, COMMAND_LINE)
    if recipe.model.trust_remote_code and not remote.own:
        refs.append(CodeRef(REMOTE_CODE_KEY, f"the Python files of model {recipe.model.path}", remote))
    return refs


def require_consent(recipe: Recipe) -> None:
    """Stop (UserError) when the recipe names code and the user has not allowed it; naming every reference."""
    refs = references(recipe)
    if not refs or recipe.allow_code:
        return
    lines = "\n".join(f"  - {ref.describe()}" for ref in refs)
    raise UserError(f"this recipe names code that finetune would import and run, and running it has not been "
                    f"allowed:\n{lines}\n  Running it is the same trust as running that Python yourself. "
                    "If you trust it, pass --allow-code, or write allow_code: true in the recipe file you run (a "
                    "recipe it extends, or one from a recipe repository, cannot give it). docs/rl.md, \"Code in "
                    "recipes\".")


def import_ref(ref: CodeRef) -> Callable[..., Any]:
    """The callable `module.path:function` names, imported (the module looked for first in the folder of the file
    that named it, then on sys.path). Every failure is a UserError naming the key: a module that cannot be found,
    raises or does not parse while importing, or has no such callable."""
    problem = spec_problem(ref.spec)
    if problem is not None:
        raise UserError(f"{ref.key}: {ref.spec!r} is not module.path:function ({problem})")
    module_name, name = ref.spec.split(":", 1)
    _look_beside(module_name, ref.origin.folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UserError(f"{ref.key}: cannot import {module_name!r} for {ref.spec!r}: {e} (a module is looked for "
                        f"next to the recipe that names it, then on the Python path)") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module: any failure while importing is theirs
        raise UserError(f"{ref.key}: importing {module_name!r} for {ref.spec!r} raised {type(e).__name__}: "
                        f"{first_line(e)}{_where(e)}") from None
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise UserError(f"{ref.key}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no callable "
                        f"{name!r}")
    return target


def _look_beside(module_name: str, folder: Path | None) -> None:
    """Put the naming recipe's folder first on sys.path when the module's top package is there: a reward module next
    to its recipe is found however finetune was started (the console script does not put the cwd on sys.path)."""
    top = module_name.split(".", 1)[0]
    if folder is None or top in sys.modules:
        return
    here = (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file()
    if here and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def _where(e: BaseException) -> str:
    if isinstance(e, SyntaxError) and e.filename:
        return f" ({e.filename}:{e.lineno})"
    return ""


def source_record(ref: CodeRef, fn: Callable[..., Any]) -> dict[str, Any]:
    """What the run directory records of a reference: the spec, its source file and the file's sha256 (None where
    the callable has no Python source, a C function)."""
    try:
        file = inspect.getsourcefile(inspect.unwrap(fn)) or inspect.getfile(fn)
    except TypeError:
        file = None
    digest = None
    if file and Path(file).is_file():
        digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
    return {"ref": ref.spec, "file": file, "sha256": digest}


def import_all(recipe: Recipe) -> None:
    """Import every reference the recipe names (consent checked first): a broken one is an error before anything
    slow, not after the data and the model have loaded."""
    require_consent(recipe)
    for ref in references(recipe):
        if ref.key != REMOTE_CODE_KEY:
            import_ref(ref)


def run_record(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """Recipe key -> source_record of each code reference the run imports (versions.json's run record, which
    `finetune runs compare` shows): an edited reward module is seen by its sha256."""
    require_consent(recipe)
    return {ref.key: source_record(ref, import_ref(ref)) for ref in references(recipe) if ref.key != REMOTE_CODE_KEY}


def describe_for_validate(recipe: Recipe) -> list[str]:
    """What `finetune validate` says of the recipe's code: each reference imported and hashed when allowed (a
    broken one is a UserError here, before any run), or named with where it came from when not."""
    refs = [r for r in references(recipe) if r.key != REMOTE_CODE_KEY]
    lines = []
    for ref in refs:
        if recipe.allow_code:
            record = source_record(ref, import_ref(ref))
            lines.append(f"code: {ref.key}: {ref.spec} imported from {record['file']} (sha256 "
                         f"{(record['sha256'] or '-')[:12]})")
        else:
            lines.append(f"code: {ref.describe()}: not imported; running it needs --allow-code")
    remote = [r for r in references(recipe) if r.key == REMOTE_CODE_KEY]
    lines += [f"code: {r.describe()}: needs --allow-code" for r in remote if not recipe.allow_code]
    return lines


def candidate_keys(recipe: Recipe) -> list[str]:
    """The dotted keys where a recipe can name code (the loader finds who wrote each)."""
    return ([f"grpo.rewards.{i}.function" for i in range(len(recipe.grpo.rewards))]
            + [f"grpo.tools.{i}" for i in range(len(recipe.grpo.tools))] + ["grpo.environment", REMOTE_CODE_KEY])


def origin_of(key: str, trail: Sequence[tuple[Origin, dict[str, Any]]], overrides: Sequence[str]) -> Origin | None:
    """Which source wrote the value at dotted `key` of the merged recipe: an override of it or of a section holding
    it, else the last file (in merge order: parents before the files extending them) whose own data has the key.
    Lists are replaced whole by a merge, so the last writer of the key is the writer of the value."""
    if any(key == item.partition("=")[0].strip() or key.startswith(item.partition("=")[0].strip() + ".")
           for item in overrides):
        return COMMAND_LINE
    for origin, data in reversed(trail):
        if _has(data, key.split(".")):
            return origin
    return None


def _has(data: Any, parts: list[str]) -> bool:
    for part in parts:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return False
    return True
