"""Where recipe names come from: the recipe search path, recipe repositories and their pin registry.

A recipe reference (the RECIPE argument of `finetune train/validate/eval/verify`, or an `extends:` entry) is
either a file or a name:

1. A reference that names an existing file (relative to the current directory on the command line, to the
   extending file's folder in `extends:`) is that file. Explicit beats implicit: a name never shadows a file.
2. A path-like reference (absolute, starting with `.` or `~`, or ending in .yaml/.yml) that is not a file is
   an error ("recipe file not found"); it is never looked up as a name, so a typo in a path cannot quietly pick
   up some other recipe that happens to share its stem.
3. Anything else is a NAME (`quickstart`, `team/sft`, `team/sub/sft`; no suffix), looked up in this order,
   first hit wins:
   a. each directory of FINETUNE_RECIPE_PATH (os.pathsep-separated), in order: NAME.yaml under it;
   b. recipe repositories added with `finetune recipes add REPO URL`: `REPO/rest` is rest.yaml in that clone;
   c. the examples shipped with finetune (examples/yaml: quickstart, smollm2-135m-lora, ...).
   The order goes from the most deliberate and local choice to the most general, as PATH does: an
   environment variable is set for one shell or one CI job, so it can override anything (a patched copy of a
   repo recipe, a local variant of an example); repositories are added once per user; the shipped examples
   are the fallback. Repository names are namespaced (`REPO/...`), so they collide only with a same-named
   sub-folder of a FINETUNE_RECIPE_PATH directory. A name that resolves while other places also have it
   prints a note naming what it shadows, and `finetune recipes list` shows every place. A recipe extending its
   own name (a local quickstart.yaml saying `extends: quickstart`) gets the next one down, never itself.

Repositories are git clones under $FINETUNE_HOME/recipes/REPO (default ~/.cache/finetune), each checked out
(detached) at the commit recorded in $FINETUNE_HOME/recipes.json: loading a repository recipe refuses a
clone that is not at its pinned commit, so a recipe name means the same bytes until `finetune recipes update`
moves the pin. Inside a repository, recipes should extend each other by relative path (`base.yaml`): the
repository's local name is chosen by whoever adds it, so the author cannot know it.

This module finds recipes and reads the registry; finetune/recipe/repos.py changes it (git clone, fetch, pin).
Only the standard library (rich lazily, for the table), so `finetune validate` stays fast. Nothing here prints:
what the user should see goes into a `notes` list that the CLI prints.
"""

from __future__ import annotations

import difflib
import importlib.resources
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from finetune.errors import UserError

if TYPE_CHECKING:  # annotation only; rich is imported when the table is built
    from rich.table import Table

SUFFIXES = (".yaml", ".yml")
PATH_ENV = "FINETUNE_RECIPE_PATH"
HOME_ENV = "FINETUNE_HOME"
# Listing walks at most this deep below a source root: FINETUNE_RECIPE_PATH may point at a big folder by
# mistake, and `recipes list` / "did you mean" must not crawl a home directory. Deeper recipes still resolve.
LIST_DEPTH = 4

SourceKind = Literal["path", "repo", "shipped"]
RefKind = Literal["branch", "tag", "commit"]


# --- where recipes live -----------------------------------------------------------------------------------

def finetune_home() -> Path:
    """Per-user state: $FINETUNE_HOME, else $XDG_CACHE_HOME/finetune, else ~/.cache/finetune."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "finetune"


def repos_root() -> Path:
    return finetune_home() / "recipes"


def registry_file() -> Path:
    # Next to the clones, not inside: a repository may be called anything a folder may, "registry" included.
    return finetune_home() / "recipes.json"


def shipped_dir() -> Path | None:
    """The shipped examples: examples/yaml of the source tree, else finetune/examples/yaml of an installed wheel.

    A checkout (or an editable install, which `make install` does) reads the repository's own examples/yaml,
    so there is one copy and nothing to drift. A wheel carries the same files inside the package as
    finetune/examples/ (yaml, data, tokenizer side by side, so the examples' relative paths such as
    ../tokenizer keep working); importlib.resources finds them wherever the package is installed. The
    pyproject.toml check makes sure a stray site-packages/examples folder of some other project is not taken
    for ours.
    """
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "examples" / "yaml").is_dir():
        return checkout / "examples" / "yaml"
    installed = importlib.resources.files("finetune") / "examples" / "yaml"
    # Recipes name sibling files by relative path, so only a real folder will do (not a zip import).
    return installed if isinstance(installed, Path) and installed.is_dir() else None


@dataclass(frozen=True)
class Source:
    """One place recipe names are looked up."""

    kind: SourceKind
    root: Path
    label: str
    """How the user sees it: 'FINETUNE_RECIPE_PATH /dir', 'repo team@1a2b3c4', 'shipped example'."""
    prefix: str = ""
    """Names from this source start with it ('team/' for a repository)."""
    exists: bool = True


def recipe_path_dirs() -> list[Path]:
    """FINETUNE_RECIPE_PATH, split on os.pathsep; empty entries are skipped, relative ones are against the cwd."""
    raw = os.environ.get(PATH_ENV, "")
    return [Path(p).expanduser().resolve() for p in raw.split(os.pathsep) if p.strip()]


def sources() -> list[Source]:
    """Every place a name is looked up, in search order (see the module docstring for why this order)."""
    out = [Source("path", d, f"{PATH_ENV} {d}", exists=d.is_dir()) for d in recipe_path_dirs()]
    for name, repo in load_registry().items():
        out.append(Source("repo", repo.dir, f"repo {name}@{repo.commit[:7]}", prefix=f"{name}/",
                          exists=repo.dir.is_dir()))
    shipped = shipped_dir()
    if shipped is not None:
        out.append(Source("shipped", shipped, "shipped example"))
    return out


@dataclass(frozen=True)
class Candidate:
    """A recipe file a name can mean."""

    name: str
    file: Path
    source: Source


def is_path_like(ref: str) -> bool:
    """True when `ref` can only be a path: absolute, ./ ../ ~, a .yaml/.yml suffix, or not a well-formed name."""
    text = ref.replace("\\", "/")
    if not text or Path(ref).is_absolute() or text.startswith(("./", "../", "~", "/")):
        return True
    if text.lower().endswith(SUFFIXES):
        return True
    return any(part in ("", ".", "..") for part in text.split("/"))


def _with_suffix(root: Path, rest: str) -> Path | None:
    for suffix in SUFFIXES:
        file = root / f"{rest}{suffix}"
        if file.is_file():
            return file
    return None


def find(name: str) -> list[Candidate]:
    """Every recipe file `name` can mean, in search order: the first one is what it resolves to."""
    hits = []
    for source in sources():
        if not source.exists:
            continue
        if source.prefix:
            if not name.startswith(source.prefix):
                continue
            rest = name[len(source.prefix):]
        else:
            rest = name
        file = _with_suffix(source.root, rest)
        if file is not None:
            hits.append(Candidate(name, file, source))
    return hits


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """(name without suffix, file) for every recipe below root, hidden folders (.git) skipped, sorted."""
    base_depth = len(root.parts)
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        depth = len(here.parts) - base_depth
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < LIST_DEPTH else []
        for file in sorted(files):
            if file.lower().endswith(SUFFIXES) and not file.startswith("."):
                rel = (here / file).relative_to(root)
                yield rel.with_suffix("").as_posix(), here / file


def available() -> list[Candidate]:
    """Every recipe in every source, in search order (a name may appear more than once: the first wins)."""
    out = []
    for source in sources():
        if source.exists:
            out.extend(Candidate(source.prefix + name, file, source) for name, file in _walk(source.root))
    return out


def tree_of(file: Path) -> Source | None:
    """The source whose folder holds `file`, if any (a user's own recipe elsewhere belongs to none)."""
    file = file.resolve()
    try:
        known = sources()
    except UserError:  # an unreadable registry must not break recipes that use no repository; names report it
        return None
    for source in known:
        if source.exists and file.is_relative_to(source.root.resolve()):
            return source
    return None


def describe(file: Path) -> str:
    """A recipe's one-line description: the first line of its leading comment block (modelines skipped)."""
    try:
        with file.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                text = line.strip()
                if not text:
                    continue
                if not text.startswith("#"):
                    return ""  # a comment further down describes a key, not the recipe
                text = text.lstrip("#").strip()
                if text and not text.startswith("yaml-language-server:"):
                    return text
    except OSError:
        return ""
    return ""


# --- resolving a reference --------------------------------------------------------------------------------

def resolve(ref: str | Path, base: Path, extended_from: Path | None = None,
            notes: list[str] | None = None) -> Path:
    """The recipe file `ref` means (see the module docstring for the rules). Raises UserError when none.

    `base` is the folder relative paths start from; `extended_from` the file whose `extends:` this is (None on
    the command line). Things the user should see but that are not errors go into `notes`.
    """
    notes = notes if notes is not None else []
    text = str(ref)
    path = base / Path(text).expanduser()  # an absolute ref replaces base
    if path.is_file():
        if extended_from is not None:
            _note_outside_tree(extended_from, path, notes)
        return path
    hits = [] if is_path_like(text) else find(text)
    if extended_from is not None:
        # A recipe extending its own name means the next one on the search path (a local variant of the shipped
        # quickstart saying `extends: quickstart`), never itself: that would only ever be a cycle.
        hits = [h for h in hits if h.file.resolve() != extended_from.resolve()]
    if not hits:
        if is_path_like(text) or path.is_dir():
            where = f" (extended from {extended_from})" if extended_from else ""
            shown = text if extended_from is None else str(path)
            what = "is a directory, not a recipe file" if path.is_dir() else "recipe file not found"
            raise UserError(f"{what}: {shown}{where}{_name_hint(text)}")
        raise UserError(_not_found(text, base, extended_from))
    chosen = hits[0]
    if chosen.source.kind == "repo":
        from finetune.recipe.repos import check_pin  # git runs only when a repository recipe is used

        check_pin(chosen.source.prefix.rstrip("/"), notes)
    if len(hits) > 1:
        others = "; ".join(f"{h.source.label} ({h.file})" for h in hits[1:])
        notes.append(f"recipe '{text}' is {chosen.file} ({chosen.source.label}); it shadows {others}")
    return chosen.file


def _note_outside_tree(extending: Path, target: Path, notes: list[str]) -> None:
    """Allowed, but said: a repository (or search-path, or shipped) recipe reaching out of its own folder.

    A recipe in a repository is reviewed and pinned as part of that repository; an `extends:` that climbs out
    of it (../../x.yaml, /abs/path) depends on files nobody pinned, so the user gets to see it.
    """
    source = tree_of(extending)
    if source is None:
        return  # the user's own recipe: extending anything anywhere is ordinary
    if not target.resolve().is_relative_to(source.root.resolve()):
        notes.append(f"{extending} ({source.label}) extends {target.resolve()}, outside its own tree "
                     f"{source.root}")


def _name_hint(text: str) -> str:
    """For a missing path whose stem is a known recipe name: say how to use the name instead."""
    stem = text.replace("\\", "/")
    for suffix in SUFFIXES:
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
    stem = stem.removeprefix("./")
    if not stem or is_path_like(stem):
        return ""
    hits = find(stem)
    if not hits:
        return ""
    return (f"\n  There is a recipe named '{stem}' ({hits[0].source.label}: {hits[0].file}); to use it, write "
            f"the name without the suffix: {stem}")


def _not_found(name: str, base: Path, extended_from: Path | None) -> str:
    where = f" (extended from {extended_from})" if extended_from else ""
    lines = [f"recipe '{name}' not found{where}: it is not a file relative to {base}, and no recipe has that "
             "name. Searched, in order:"]
    path_dirs = recipe_path_dirs()
    if path_dirs:
        shown = ", ".join(f"{d}{'' if d.is_dir() else ' (missing)'}" for d in path_dirs)
        lines.append(f"  1. {PATH_ENV}: {shown}")
    else:
        lines.append(f"  1. {PATH_ENV}: not set")
    repos = load_registry()
    repo_part = name.split("/", 1)[0] if "/" in name else None
    if not repos:
        lines.append("  2. recipe repositories: none added (finetune recipes add NAME GIT_URL)")
    else:
        lines.append(f"  2. recipe repositories (as REPO/recipe): {', '.join(sorted(repos))} in {repos_root()}")
        if repo_part and repo_part not in repos:
            guess = difflib.get_close_matches(repo_part, list(repos), n=1, cutoff=0.6)
            maybe = f" (did you mean '{guess[0]}'?)" if guess else ""
            lines.append(f"     no repository is named '{repo_part}'{maybe}")
    shipped = shipped_dir()
    lines.append(f"  3. shipped examples: {shipped if shipped else 'not found in this installation'}")
    names = list(dict.fromkeys(c.name for c in available()))
    guesses = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    last = name.rsplit("/", 1)[-1]
    guesses += [n for n in names if n.rsplit("/", 1)[-1] == last and n not in guesses]
    if guesses:
        lines.append(f"  Did you mean: {', '.join(guesses[:5])}?")
    lines.append("  `finetune recipes list` shows every recipe name and where it comes from.")
    return "\n".join(lines)



@dataclass
class Repo:
    """One recipe repository: where it came from and the commit its clone is pinned to."""

    name: str
    url: str
    ref: str
    """The branch, tag or commit followed: `update` moves a branch or tag pin, never a commit pin."""
    ref_kind: RefKind
    commit: str

    @property
    def dir(self) -> Path:
        return repos_root() / self.name


def load_registry() -> dict[str, Repo]:
    file = registry_file()
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        return {name: Repo(name=name, **entry) for name, entry in data["repositories"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{file}: the recipe repository registry is unreadable ({e}); fix or delete it "
                        f"(and the clones in {repos_root()}), then add the repositories again") from None


# --- `finetune recipes list` ------------------------------------------------------------------------------

def list_table() -> Table:
    """Every recipe name, its description and where it comes from; shadowed duplicates are shown, dimmed."""
    from rich.table import Table

    table = Table(title="recipes (a name resolves to its first row; search order: FINETUNE_RECIPE_PATH, "
                        "repositories, shipped examples)", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("description")
    table.add_column("source")
    seen: dict[str, Candidate] = {}
    for cand in available():
        if seen.setdefault(cand.name, cand) is not cand:  # the row above with this name is the one used
            table.add_row(cand.name, describe(cand.file), f"{cand.source.label} (shadowed)", style="dim")
        else:
            table.add_row(cand.name, describe(cand.file), cand.source.label)
    return table
