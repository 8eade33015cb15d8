"""Recipe repositories: git clones of recipe folders, each pinned to a commit in the registry
($FINETUNE_HOME/recipes.json). `finetune recipes add|update|remove` change them here; recipe/names.py reads them.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from finetune.errors import UserError
from finetune.recipe.names import PATH_ENV, SUFFIXES, RefKind, Repo, load_registry, registry_file, repos_root

_REPO_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _save_registry(repos: dict[str, Repo]) -> None:
    file = registry_file()
    file.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": 1, "repositories": {n: {k: v for k, v in asdict(r).items() if k != "name"}
                                           for n, r in sorted(repos.items())}}
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, file)  # atomic: a crash leaves the old registry or the new one, never half of one


def _git(*args: str, cwd: Path | None = None) -> str:
    env = dict(os.environ)
    if not sys.stdin.isatty():
        env["GIT_TERMINAL_PROMPT"] = "0"  # no tty to answer a password prompt: fail instead of hanging
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    except FileNotFoundError:
        raise UserError("git is not installed (or not on PATH); recipe repositories are git clones. "
                        "Install git, or put a folder of recipes on FINETUNE_RECIPE_PATH instead.") from None
    if proc.returncode != 0:
        said = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:]) or f"exit {proc.returncode}"
        raise UserError(f"git {args[0]} failed: {said}")
    return proc.stdout.strip()


def _rev(ref: str, cwd: Path) -> str | None:
    """The commit `ref` names in the clone at cwd, or None."""
    proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=cwd,
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def _resolve_ref(ref: str, clone: Path, url: str) -> tuple[RefKind, str]:
    """A user's ref in a fresh fetch: a branch (followed), a tag, or a commit (fixed)."""
    tries: tuple[tuple[RefKind, str], ...] = (("branch", f"refs/remotes/origin/{ref}"), ("tag", f"refs/tags/{ref}"),
                                              ("commit", ref))
    for kind, full in tries:
        commit = _rev(full, clone)
        if commit:
            return kind, commit
    branches = _git("branch", "-r", "--format=%(refname:lstrip=3)", cwd=clone).split()
    shown = ", ".join(b for b in branches if b != "HEAD") or "none"
    raise UserError(f"'{ref}' is not a branch, tag or commit of {url} (branches: {shown})")


def _no_option(what: str, value: str, fix: str) -> None:
    """Refuse a user's value that git would read as an option (`--upload-pack=...` runs a command)."""
    if value.startswith("-"):
        raise UserError(f"{what} {value!r} starts with '-', which git would read as an option; {fix}")


def _is_url(text: str) -> bool:
    return "://" in text or bool(re.match(r"^[\w.-]+@[\w.-]+:", text))  # scheme://... or scp-like user@host:path


def add(name: str, url_or_dir: str, ref: str | None = None) -> Repo:
    """Clone a recipe repository as NAME and pin it to ref (default: the remote's default branch) now."""
    if not _REPO_NAME.match(name) or name.lower().endswith(SUFFIXES):
        raise UserError(f"repository name {name!r}: use letters, digits, '.', '_' and '-' (starting with a "
                        "letter or digit), without a .yaml suffix; recipes in it are then NAME/recipe")
    _no_option("URL_OR_DIR", url_or_dir, "give a git URL (https://..., file://..., git@host:...) or a folder "
                                         "(./-name for a folder whose name starts with '-')")
    if ref is not None:
        _no_option("--ref", ref, "give a branch, tag or commit")
    repos = load_registry()
    if name in repos:
        raise UserError(f"a recipe repository named '{name}' is already added ({repos[name].url}); "
                        f"`finetune recipes update {name}` moves its pin, `finetune recipes remove {name}` drops it")
    if _is_url(url_or_dir):
        url = url_or_dir
    else:
        folder = Path(url_or_dir).expanduser()
        if not folder.is_dir():
            raise UserError(f"{url_or_dir}: not a folder and not a git URL (https://..., file://..., git@host:...)")
        probe = subprocess.run(["git", "-C", str(folder), "rev-parse", "--git-dir"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise UserError(f"{url_or_dir}: not a git repository. Recipe repositories are pinned to a commit; "
                            f"for a plain folder of recipes, add it to {PATH_ENV} instead.")
        url = str(folder.resolve())  # the clone must find it again from any directory (update fetches it)
    dest = repos_root() / name
    if dest.exists():
        raise UserError(f"{dest} exists but is not in the registry {registry_file()}; delete it, then add again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Clone next to the destination, then rename: a failed clone leaves nothing half-made under the name.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        _git("clone", "--quiet", "--", url, str(tmp))  # `--`: whatever the URL is, git reads it as one
        if ref is None:
            head = _rev("HEAD", tmp)
            if head is None:
                raise UserError(f"{url} has no commits (nothing to pin)")
            ref = _git("rev-parse", "--abbrev-ref", "HEAD", cwd=tmp)  # the remote's default branch
            kind: RefKind = "branch"
            commit = head
        else:
            kind, commit = _resolve_ref(ref, tmp, url)
        _git("checkout", "--quiet", "--detach", commit, cwd=tmp)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    repo = Repo(name=name, url=url, ref=ref, ref_kind=kind, commit=commit)
    repos[name] = repo
    _save_registry(repos)
    return repo


def update(name: str | None = None, ref: str | None = None) -> list[tuple[Repo, str]]:
    """Fetch and move the pin of one repository (or all): [(repo as now pinned, previous commit)]."""
    if ref is not None:
        _no_option("--ref", ref, "give a branch, tag or commit")
    repos = load_registry()
    if name is not None:
        _known(name, repos)
    elif ref is not None:
        raise UserError("--ref needs a repository name: finetune recipes update NAME --ref REF")
    out = []
    for repo in ([repos[name]] if name is not None else list(repos.values())):
        if not repo.dir.is_dir():
            raise UserError(f"the clone of '{repo.name}' is missing ({repo.dir}); `finetune recipes remove "
                            f"{repo.name}` and add it again")
        _git("fetch", "--quiet", "--tags", "--force", "origin", cwd=repo.dir)
        previous = repo.commit
        if ref is not None:
            repo.ref = ref
            repo.ref_kind, repo.commit = _resolve_ref(ref, repo.dir, repo.url)
        elif repo.ref_kind != "commit":  # a commit pin stays where it is until a new --ref is given
            repo.ref_kind, repo.commit = _resolve_ref(repo.ref, repo.dir, repo.url)
        _git("checkout", "--quiet", "--detach", repo.commit, cwd=repo.dir)
        repos[repo.name] = repo
        _save_registry(repos)  # after each: a failure in a later repository keeps the earlier ones' moves
        out.append((repo, previous))
    return out


def remove(name: str) -> Repo:
    repos = load_registry()
    _known(name, repos)
    repo = repos.pop(name)
    _save_registry(repos)
    shutil.rmtree(repo.dir, ignore_errors=True)
    return repo


def _known(name: str, repos: dict[str, Repo]) -> None:
    if name not in repos:
        guess = difflib.get_close_matches(name, list(repos), n=1, cutoff=0.6)
        hint = f"did you mean '{guess[0]}'?" if guess else f"added: {', '.join(sorted(repos)) or 'none'}"
        raise UserError(f"no recipe repository named '{name}' ({hint})")


def check_pin(name: str, notes: list[str]) -> None:
    """Refuse a clone that is not at its pinned commit; note local edits (allowed, but not what was pinned)."""
    repo = load_registry()[name]
    status = _git("status", "--porcelain=v2", "--branch", "--untracked-files=no", cwd=repo.dir)
    head = next((line.split()[2] for line in status.splitlines() if line.startswith("# branch.oid ")), "")
    if head != repo.commit:
        raise UserError(
            f"recipe repository '{name}' ({repo.dir}) is at {head[:12] or 'no commit'}, but is pinned to "
            f"{repo.commit[:12]} in {registry_file()}. Run `finetune recipes update {name}` to move the pin "
            f"(to {repo.ref_kind} {repo.ref}), or `git -C {repo.dir} checkout --detach {repo.commit}` to go back.")
    if any(not line.startswith("#") for line in status.splitlines()):
        notes.append(f"recipe repository '{name}' has local changes in {repo.dir} (pinned {repo.commit[:7]} plus "
                     "edits; `git -C DIR status` shows them)")

