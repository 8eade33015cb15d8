"""Reading a recipe: YAML with two fixes (numbers, duplicate keys), `extends:`, input paths made absolute against
the recipe file, and `key.path=value` overrides. The result is validated by recipe.validation.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune.errors import UserError
from finetune.recipe import code, names
from finetune.recipe.schema import DATASET_LISTS, Recipe
from finetune.recipe.validation import validate
from finetune.versions import check_requires

# Keys that hold input paths: resolved relative to the recipe file that wrote them (when the file exists).
_PATH_KEYS = (("model", "path"), ("model", "gguf_file"), ("tokenizer", "path"), ("grpo", "replay"))


# Bounds on what one YAML document may expand to. A recipe (or an Axolotl config) is a few hundred values nested a
# few levels deep; aliases (`*name`) can make 1 KB of text stand for 10^9 values, which everything after the
# parser (validation, merging, printing) would walk one by one.
MAX_VALUES = 1_000_000
MAX_DEPTH = 100


class LimitError(yaml.constructor.ConstructorError):
    """A document beyond MAX_VALUES or MAX_DEPTH, or one that contains itself: refused before it is built."""


class RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load with three fixes for recipes.

    * `1e-4` is a float. PyYAML follows YAML 1.1, where a float needs a dot, so `lr: 1e-4` would be the
      *string* "1e-4": the schema coerces it for typed keys, but free-form ones (model.config) would pass a
      string to transformers. YAML 1.2 (and every user) reads it as a number.
    * A key written twice in one mapping is an error naming both lines. PyYAML silently keeps the last one,
      so a second `train:` section would quietly replace the first.
    * Bounded: nesting deeper than MAX_DEPTH, aliases expanding to more than MAX_VALUES values (an alias bomb)
      and an alias inside its own anchor are errors, found on the parsed nodes before any value is built.
    """

    _depth = 0
    _composed = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        # Counted while composing: PyYAML composes recursively, so a deep nesting would end in a RecursionError,
        # and a huge document is stopped before all of it is held in memory.
        self._depth += 1
        self._composed += 1
        try:
            if self._depth > MAX_DEPTH:
                raise LimitError(None, None, f"nested more than {MAX_DEPTH} levels deep; a recipe needs a few",
                                 self.peek_event().start_mark)
            if self._composed > MAX_VALUES:
                raise LimitError(None, None, f"more than {MAX_VALUES:,} values in one document; a recipe needs a "
                                             "few hundred", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges; keys written next to it legitimately override the anchor's
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first written on line {first}); keep only one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def check_expansion(root: yaml.Node) -> int:
    """The number of values `root` stands for with every alias expanded; a LimitError above MAX_VALUES or for a
    node inside itself. Each distinct node is visited once (sizes are memoized), so a bomb is refused at once."""
    sizes: dict[int, int] = {}
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # iterative depth-first: a node's size once all its children's are known
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            ancestors.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > MAX_VALUES:
                raise LimitError(None, None, f"aliases (*name) expand this value to more than {MAX_VALUES:,} "
                                             "values (an alias bomb?); a recipe needs a few hundred: write them "
                                             "out, or use fewer aliases", node.start_mark)
        elif key in ancestors:
            raise LimitError(None, None, "an alias used inside its own anchor: a value that contains itself",
                             node.start_mark)
        elif key not in sizes:
            ancestors.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def parse_yaml(text: str) -> Any:
    """Parse recipe YAML (a file or an override's value) with RecipeLoader."""
    return yaml.load(text, Loader=RecipeLoader)  # safe: RecipeLoader is a SafeLoader


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                notes: list[str] | None = None, check_inputs: bool = False, allow_code: bool = False) -> Recipe:
    """Read a recipe (a file or a name, following `extends:`), apply `key.path=value` overrides, validate it all.

    `notes` collects what the user should see but is no error (a name shadowing another, an `extends:` leaving
    its repository): the CLI prints them; library callers may pass a list or ignore them. `allow_code`: the
    command line's --allow-code (recipe/code.py); the recipe records who wrote each key that can name code.
    """
    file = resolve_recipe(path, notes)
    trail = Trail()
    raw = _load_file(file, (), notes if notes is not None else [], trail)
    for item in overrides:
        apply_override(raw, item)
    if allow_code:
        raw[code.CONSENT_KEY] = True
    # A file is named as the user wrote it; a name by the file it resolved to (so they see which one).
    source = str(path) if Path(path).expanduser().resolve() == file else str(file)
    recipe = validate(raw, source=source, check_inputs=check_inputs, overrides=overrides)
    check_requires(recipe.requires, source)
    recipe._code_origins = {key: origin for key in code.candidate_keys(recipe)
                            if (origin := code.origin_of(key, trail.files, overrides)) is not None}
    if notes is not None:
        notes.extend(trail.ignored)
    return recipe


@dataclass
class Trail:
    """What each recipe file of a load wrote, in merge order (parents before the files extending them), and the
    `allow_code` values not counted: recipe/code.py finds who named each piece of code from it."""

    files: list[tuple[code.Origin, dict[str, Any]]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def add(self, file: Path, chain: tuple[Path, ...], data: dict[str, Any]) -> None:
        """Record `file`'s own data; take out an allow_code it cannot give (it is extended, or a repository's)."""
        source = names.tree_of(file)
        in_repo = source is not None and source.kind == "repo"
        text = str(file) + (f" ({source.label})" if source is not None else "")
        if chain:
            text += ", extended by " + " <- ".join(str(p) for p in reversed(chain))
        if code.CONSENT_KEY in data and (chain or in_repo):
            data.pop(code.CONSENT_KEY)
            where = "a recipe repository's file" if in_repo else "a recipe that is extended"
            self.ignored.append(f"allow_code in {file} was not counted: it is {where}; only the recipe file you "
                                "run, or --allow-code, can allow code")
        self.files.append((code.Origin(text, own=not chain and not in_repo, folder=file.parent), data))


def resolve_recipe(ref: str | Path, notes: list[str] | None = None) -> Path:
    """The file a command-line recipe argument means: an existing file, else a name on the recipe search path.

    The rules and their order are in finetune/recipe/names.py; a name that is nowhere is a UserError listing
    the places searched and the closest names.
    """
    return names.resolve(ref, Path.cwd(), None, notes).resolve()


def load_raw(path: str | Path, _chain: tuple[Path, ...] = (), notes: list[str] | None = None) -> dict[str, Any]:
    """The merged dict of a recipe (file or name) and everything it extends, paths made absolute where they exist."""
    notes = notes if notes is not None else []
    file = names.resolve(path, Path.cwd(), _chain[-1] if _chain else None, notes).resolve()
    return _load_file(file, _chain, notes)


def _load_file(file: Path, _chain: tuple[Path, ...], notes: list[str], trail: Trail | None = None) -> dict[str, Any]:
    if file in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, file))
        raise UserError(f"extends cycle: {cycle}\n  Remove one of these `extends:` entries.")
    trail = trail if trail is not None else Trail()
    data = _read_yaml(file)
    _resolve_paths(data, file.parent)
    parents = data.pop("extends", None)
    if parents is None:
        trail.add(file, _chain, data)
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(f"{file}: `extends` must be a path or a list of paths, got {parents!r}")
    merged: dict[str, Any] = {}
    for parent in parents:
        # A path is relative to this file; a name (quickstart, team/sft) comes from the recipe search path.
        parent_file = names.resolve(parent, file.parent, file, notes).resolve()
        merged = deep_merge(merged, _load_file(parent_file, (*_chain, file), notes, trail))
    trail.add(file, _chain, data)
    return deep_merge(merged, data)


def _read_yaml(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{file}: not UTF-8 text ({e})") from None
    except OSError as e:  # permission denied, a broken link: the user can fix the file, not the code
        raise UserError(f"{file}: cannot read the recipe ({e.strerror or e})") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        problem = getattr(e, "problem", None) or str(e)
        # A duplicate key is well-formed YAML that we refuse; everything else is a syntax error.
        kind = "YAML error" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error"
        hint = " (indent with spaces, not tabs)" if "'\\t'" in problem else \
            " (check the indentation of this line)" if "<block" in problem else \
            " (check the indentation of this line and the one above)" if "mapping values" in problem else ""
        raise UserError(f"{where}: {kind}: {problem}{hint}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{file}: a recipe must be a mapping of keys, got {type(data).__name__}")
    return data


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Make relative input paths absolute against the recipe's folder, if that file or folder exists there.

    Hub ids (`org/model`) do not exist locally and are left as written.
    """

    def fix(holder: Any, key: str) -> None:
        # An empty string is Path("."), which exists: leave it for the schema to reject, not resolve it.
        if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key].strip():
            value = Path(holder[key]).expanduser()
            if not value.is_absolute() and (base / value).exists():
                holder[key] = str((base / value).resolve())

    for section, key in _PATH_KEYS:
        fix(data.get(section), key)
    rewards = data.get("grpo", {}).get("rewards") if isinstance(data.get("grpo"), dict) else None
    for reward in rewards if isinstance(rewards, list) else []:  # the built-in reward_model's model
        if isinstance(reward, dict) and reward.get("function") == "reward_model":
            fix(reward.get("args"), "path")
    for name in DATASET_LISTS:
        if isinstance(data.get(name), list):
            for entry in data[name]:
                fix(entry, "path")


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge `top` into a copy of `base`: mappings merge key by key, everything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply `a.b.c=value` (value parsed as a YAML scalar/flow value) to the raw recipe dict in place."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"override {item!r}: expected key.path=value, e.g. train.lr=1e-4")
    if any("\udc80" <= c <= "\udcff" for c in item):  # bytes the shell passed that are not UTF-8 (os.fsdecode's)
        shown = os.fsencode(item).decode("utf-8", "backslashreplace")
        raise UserError(f"override '{shown}': it holds bytes that are not UTF-8 text; recipe values are UTF-8 (YAML), "
                        "so quoting cannot help: give a path or value that is UTF-8 (rename the file, or link to it "
                        "from a UTF-8 name)")
    try:
        value = parse_yaml(text) if text.strip() else None
    except LimitError as e:
        raise UserError(f"override {item!r}: {e.problem}") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"override {item!r}: the value is not valid YAML ({problem}); to pass it as a string, "
                        f"quote it: {key.strip()}='...'") from None
    key = key.strip()
    parts = key.split(".")
    if not all(parts):
        raise UserError(f"override {item!r}: {key!r} has an empty part; expected key.path=value, e.g. train.lr=1e-4")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        node = _descend(node, part, ".".join(parts[: i + 1]), item)
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, key, item)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:  # e.g. train.lr.x=1: the recipe holds a value, not a section, at train.lr
        raise UserError(f"override {item!r}: {'.'.join(parts[:-1])} is a value ({node!r}), not a section")


def _descend(node: Any, part: str, dotted: str, item: str) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, part, dotted, item)]
    if not isinstance(node, dict):
        parent = dotted.rpartition(".")[0] or dotted
        raise UserError(f"override {item!r}: {parent} is a value ({node!r}), not a section")
    if node.get(part) is None:
        node[part] = {}
    return node[part]


def _list_index(node: list, part: str, dotted: str, item: str) -> int:
    # Only existing entries: an override can change a dataset, not invent half of one.
    if not node:
        raise UserError(f"override {item!r}: {dotted} indexes an empty list (the recipe has no entries there)")
    if not part.isdigit() or int(part) >= len(node):
        raise UserError(f"override {item!r}: {dotted} needs an index 0..{len(node) - 1}")
    return int(part)


