"""Recipe names: the search path, recipe repositories (git clones pinned in a registry), `requires:`.

A local bare git repository stands in for a shared recipe repository (file:// URL, no network). Commands run
in process through `finetune.cli.main` (fast, and still the real argument parsing and exit codes); one test
runs `python -m finetune` end to end. Every test gets its own FINETUNE_HOME and no FINETUNE_RECIPE_PATH, so
nothing leaks from, or into, the user's real ~/.cache/finetune.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, needs, python_path

from finetune.cli import load_recipe_arg, main
from finetune.errors import UserError
from finetune.recipe import load_raw, load_recipe, names, repos

SHIPPED = REPO_ROOT / "examples" / "yaml"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(*args: str, cwd: Path) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **GIT_ENV})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def commit_all(work: Path, message: str) -> str:
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", message, cwd=work)
    git("push", "-q", "origin", "HEAD:main", cwd=work)
    return git("rev-parse", "HEAD", cwd=work)


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Own FINETUNE_HOME, no FINETUNE_RECIPE_PATH, an empty cwd (a name must not hit a stray file), wide tables."""
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FINETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FINETUNE_RECIPE_PATH", raising=False)
    monkeypatch.setenv("COLUMNS", "1000")  # one line per table row
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return tmp_path


@pytest.fixture
def team(tmp_path: Path) -> tuple[Path, str]:
    """A bare repository (the 'server') and a work clone pushing to it; returns (work dir, file:// URL).

    sft.yaml extends the shipped quickstart by name; sub/tiny.yaml extends ../sft.yaml by relative path, as a
    repository's own recipes should (its local name is whoever-adds-it's choice).
    """
    bare = tmp_path / "team.git"
    git("init", "-q", "--bare", "-b", "main", str(bare), cwd=tmp_path)
    work = tmp_path / "team-work"
    git("clone", "-q", str(bare), str(work), cwd=tmp_path)
    write(work / "sft.yaml", """\
        # Team SFT: the quickstart at a lower learning rate
        extends: quickstart
        train: {lr: 1.0e-3}
        """)
    write(work / "sub" / "tiny.yaml", """\
        # A tiny variant of the team SFT
        extends: ../sft.yaml
        model: {config: {hidden_size: 64}}
        """)
    commit_all(work, "first recipes")
    return work, bare.as_uri()


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def validated(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc, out, err = cli(capsys, "validate", *args)
    assert rc == 0, err
    return yaml.safe_load(out)


# --- repositories: add, list, use by name, update, remove -------------------------------------------------

def test_add_then_list_then_validate_by_name(team, capsys):
    work, url = team
    head = git("rev-parse", "HEAD", cwd=work)
    rc, out, err = cli(capsys, "recipes", "add", "team", url)
    assert rc == 0, err
    assert f"pinned at {head[:12]}" in out
    registry = json.loads(names.registry_file().read_text())
    assert registry["repositories"]["team"] == {"url": url, "ref": "main", "ref_kind": "branch", "commit": head}

    rc, out, _ = cli(capsys, "recipes", "list")
    assert rc == 0
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 4}
    assert "Team SFT: the quickstart at a lower learning rate" in rows["team/sft"]
    assert f"repo team@{head[:7]}" in rows["team/sft"] and f"repo team@{head[:7]}" in rows["team/sub/tiny"]
    assert "shipped example" in rows["quickstart"] and "Quickstart:" in rows["quickstart"]

    printed = validated(capsys, "team/sub/tiny")
    assert printed["train"]["lr"] == 1.0e-3  # from team/sft
    assert printed["model"]["config"]["hidden_size"] == 64  # its own
    assert printed["model"]["config"]["num_hidden_layers"] == 4  # from the shipped quickstart
    # The quickstart's relative paths still resolve against the quickstart's own folder.
    assert printed["tokenizer"]["path"] == str(REPO_ROOT / "examples" / "tokenizer")


def test_update_moves_the_pin_and_until_then_the_old_commit_is_used(team, capsys):
    work, url = team
    first = git("rev-parse", "HEAD", cwd=work)
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    write(work / "sft.yaml", "# Team SFT, v2\nextends: quickstart\ntrain: {lr: 5.0e-4}\n")
    second = commit_all(work, "lower lr")

    assert validated(capsys, "team/sft")["train"]["lr"] == 1.0e-3  # pinned: the push changes nothing yet
    rc, out, err = cli(capsys, "recipes", "update", "team")
    assert rc == 0, err
    assert f"team: {first[:12]} -> {second[:12]} (branch main)" in out
    assert names.load_registry()["team"].commit == second
    assert validated(capsys, "team/sft")["train"]["lr"] == 5.0e-4
    rc, out, _ = cli(capsys, "recipes", "update")  # all repositories; nothing new
    assert f"team: already at {second[:12]}" in out


def test_pin_to_a_tag_or_commit_and_switch_with_ref(team, capsys):
    work, url = team
    first = git("rev-parse", "HEAD", cwd=work)
    git("tag", "v1", cwd=work)
    git("push", "-q", "origin", "v1", cwd=work)
    write(work / "sft.yaml", "extends: quickstart\ntrain: {lr: 7.0e-4}\n")
    second = commit_all(work, "v2")
    assert cli(capsys, "recipes", "add", "team", url, "--ref", "v1")[0] == 0
    assert names.load_registry()["team"].commit == first
    assert validated(capsys, "team/sft")["train"]["lr"] == 1.0e-3
    assert cli(capsys, "recipes", "update", "team", "--ref", first[:10])[0] == 0  # a commit pin: fixed
    assert names.load_registry()["team"].ref_kind == "commit"
    rc, out, _ = cli(capsys, "recipes", "update", "team")
    assert "already at" in out
    assert cli(capsys, "recipes", "update", "team", "--ref", "main")[0] == 0
    assert names.load_registry()["team"].commit == second
    rc, _, err = cli(capsys, "recipes", "update", "team", "--ref", "nope")
    assert rc == 2 and "'nope' is not a branch, tag or commit" in err and "branches: main" in err


def test_a_clone_moved_off_its_pin_is_refused_and_local_edits_are_noted(team, capsys):
    work, url = team
    first = git("rev-parse", "HEAD", cwd=work)
    write(work / "other.yaml", "extends: quickstart\n")
    second = commit_all(work, "second")
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    clone = names.repos_root() / "team"
    git("checkout", "-q", "--detach", first, cwd=clone)
    rc, out, err = cli(capsys, "validate", "team/sft")
    assert rc == 2 and out == ""
    assert f"is at {first[:12]}, but is pinned to {second[:12]}" in err
    assert "finetune recipes update team" in err
    git("checkout", "-q", "--detach", second, cwd=clone)
    (clone / "sft.yaml").write_text("extends: quickstart\ntrain: {lr: 9.0e-4}\n")
    rc, out, err = cli(capsys, "validate", "team/sft")
    assert rc == 0
    assert "note: recipe repository 'team' has local changes" in err
    assert yaml.safe_load(out)["train"]["lr"] == 9.0e-4


def test_remove_drops_the_clone_and_the_name(team, capsys):
    _, url = team
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    rc, out, _ = cli(capsys, "recipes", "remove", "team")
    assert rc == 0 and "removed team" in out
    assert not (names.repos_root() / "team").exists()
    assert names.load_registry() == {}
    rc, _, err = cli(capsys, "validate", "team/sft")
    assert rc == 2 and "recipe 'team/sft' not found" in err


def test_add_refuses_bad_input_and_leaves_nothing_behind(team, tmp_path, capsys):
    work, url = team
    cases = [
        (("Bad/Name", url), "repository name 'Bad/Name'"),
        (("team", str(tmp_path / "cwd")), "not a git repository"),
        (("team", str(tmp_path / "nowhere")), "not a folder and not a git URL"),
        (("team", (tmp_path / "missing.git").as_uri()), "git clone failed"),
        (("team", url, "--ref", "v9"), "'v9' is not a branch, tag or commit"),
    ]
    for args, expected in cases:
        rc, _, err = cli(capsys, "recipes", "add", *args)
        assert rc == 2 and expected in err, (args, err)
        assert not names.repos_root().exists() or not any(names.repos_root().iterdir()), args
    assert cli(capsys, "recipes", "add", "team", str(work))[0] == 0  # a local git work tree is fine too
    rc, _, err = cli(capsys, "recipes", "add", "team", url)
    assert rc == 2 and "already added" in err
    rc, _, err = cli(capsys, "recipes", "update", "taem")
    assert rc == 2 and "did you mean 'team'?" in err


# --- resolution: order, shadowing, errors ------------------------------------------------------------------

def test_extends_across_repositories_and_the_search_path(team, tmp_path, monkeypatch, capsys):
    """FINETUNE_RECIPE_PATH recipe -> repo recipe (by name) -> repo sibling (by path) -> shipped (by name)."""
    _, url = team
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    mine = tmp_path / "mine"
    write(mine / "exp.yaml", "# My experiment\nextends: team/sub/tiny\ntrain: {max_steps: 7}\n")
    monkeypatch.setenv("FINETUNE_RECIPE_PATH", str(mine))
    rc, out, err = cli(capsys, "validate", "exp")
    assert rc == 0, err
    assert err == ""  # everything inside its own tree or by name: nothing to note
    printed = yaml.safe_load(out)
    assert (printed["train"]["max_steps"], printed["train"]["lr"], printed["model"]["config"]["hidden_size"],
            printed["data"]["max_seq_len"]) == (7, 1.0e-3, 64, 512)


def test_resolution_order_path_dirs_then_repositories_then_shipped(team, tmp_path, monkeypatch, capsys):
    _, url = team
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    first, second = tmp_path / "first", tmp_path / "second"
    # Extending its own name: the next quickstart on the search path (here the second's), not itself.
    write(first / "quickstart.yaml", "# first's quickstart\nextends: quickstart\ntrain: {lr: 0.5}\nseed: 1\n")
    write(second / "quickstart.yaml", "# second's quickstart\nextends: " + str(SHIPPED / "quickstart.yaml") +
          "\nseed: 2\n")
    write(second / "team" / "sft.yaml", "# second's team/sft\nextends: quickstart\nseed: 3\n")
    monkeypatch.setenv("FINETUNE_RECIPE_PATH", os.pathsep.join([str(first), str(tmp_path / "gone"), str(second)]))

    notes: list[str] = []
    recipe = load_recipe("quickstart", notes=notes)
    assert (recipe.seed, recipe.train.lr) == (1, 0.5)  # the first directory wins over the second and shipped
    assert load_raw(first / "quickstart.yaml")["seed"] == 1
    assert load_raw(second / "quickstart.yaml")["seed"] == 2
    assert any("shadows" in n and str(second) in n and "shipped example" in n for n in notes), notes
    assert load_recipe("team/sft").seed == 3  # a path directory wins over the repository
    monkeypatch.setenv("FINETUNE_RECIPE_PATH", str(tmp_path / "gone"))
    assert load_recipe("team/sft").train.lr == 1.0e-3  # then the repository
    assert load_recipe("quickstart").seed == 0  # then the shipped example

    # An existing file beats every name (explicit first): a file called `quickstart` in the cwd.
    write(Path.cwd() / "quickstart", "extends: " + str(SHIPPED / "quickstart.yaml") + "\nseed: 9\n")
    assert load_recipe("quickstart").seed == 9

    monkeypatch.setenv("FINETUNE_RECIPE_PATH", os.pathsep.join([str(first), str(second)]))
    rc, out, _ = cli(capsys, "recipes", "list")
    lines = [line for line in out.splitlines() if line.count("│") >= 4 and line.split("│")[1].strip() == "quickstart"]
    assert len(lines) == 3
    assert f"FINETUNE_RECIPE_PATH {first}" in lines[0] and "shadowed" not in lines[0]
    assert f"FINETUNE_RECIPE_PATH {second} (shadowed)" in lines[1]
    assert "shipped example (shadowed)" in lines[2]


def test_unknown_name_lists_the_places_searched_and_near_misses(team, tmp_path, monkeypatch, capsys):
    _, url = team
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    monkeypatch.setenv("FINETUNE_RECIPE_PATH", str(tmp_path / "gone"))
    rc, out, err = cli(capsys, "validate", "qickstart")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert "error: recipe 'qickstart' not found" in err
    assert f"FINETUNE_RECIPE_PATH: {tmp_path / 'gone'} (missing)" in err
    assert "recipe repositories (as REPO/recipe): team" in err
    assert f"shipped examples: {SHIPPED}" in err
    assert "Did you mean: quickstart" in err
    rc, _, err = cli(capsys, "validate", "tema/sft")
    assert "no repository is named 'tema' (did you mean 'team'?)" in err and "team/sft" in err
    rc, _, err = cli(capsys, "validate", "sft")  # the bare last part of a repository recipe
    assert "Did you mean: team/sft?" in err


def test_extends_by_unknown_name_names_the_extending_file(write_recipe):
    child = write_recipe({"extends": "llama-3.1-8b-loar"})
    with pytest.raises(UserError) as info:
        load_recipe(child)
    assert f"recipe 'llama-3.1-8b-loar' not found (extended from {child})" in str(info.value)
    assert "Did you mean: llama-3.1-8b-lora" in str(info.value)


def test_a_missing_path_stays_a_path_with_a_hint_toward_the_name(write_recipe):
    child = write_recipe({"extends": "quickstart.yaml"})
    with pytest.raises(UserError) as info:
        load_recipe(child)
    message = str(info.value)
    assert message.startswith(f"recipe file not found: {child.parent / 'quickstart.yaml'} (extended from {child})")
    assert "There is a recipe named 'quickstart'" in message


def test_extends_leaving_its_tree_is_allowed_and_noted(team, tmp_path, capsys):
    work, url = team
    outside = write(tmp_path / "home" / "outside.yaml", "extends: quickstart\nseed: 5\n")
    elsewhere = write(tmp_path / "elsewhere" / "abs.yaml", "extends: quickstart\nseed: 6\n")
    write(work / "escape.yaml", "extends: ../../outside.yaml\n")  # from home/recipes/team up to home/
    write(work / "absolute.yaml", f"extends: {elsewhere}\n")
    commit_all(work, "escapes")
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    rc, out, err = cli(capsys, "validate", "team/escape")
    assert rc == 0 and yaml.safe_load(out)["seed"] == 5
    assert f"extends {outside}, outside its own tree" in err and err.startswith("note: ")
    notes: list[str] = []
    assert load_recipe("team/absolute", notes=notes).seed == 6
    assert len(notes) == 1 and f"extends {elsewhere}, outside its own tree" in notes[0]
    # The user's own recipe may extend anything anywhere without a note.
    own = write(tmp_path / "cwd" / "own" / "r.yaml", "extends: ../../elsewhere/abs.yaml\n")
    notes = []
    assert load_recipe(own, notes=notes).seed == 6 and notes == []


def test_the_cli_helper_hands_torchrun_the_resolved_file(team, capsys):
    _, url = team
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    args = argparse.Namespace(recipe="team/sft", overrides=["seed=4"])
    assert load_recipe_arg(args).seed == 4
    assert args.recipe == str(names.repos_root() / "team" / "sft.yaml")


def test_real_cli_validates_a_repository_recipe_by_name_without_importing_torch(team, tmp_path):
    """`python -m finetune validate team/sft` end to end, and the name path stays torch-free."""
    _, url = team
    repos.add("team", url)
    script = textwrap.dedent("""
        import contextlib, io, json, sys
        from finetune.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["validate", "team/sft", "requires={torch: '>=2', finetune: '>=0.1'}"])
        print(json.dumps({"rc": rc, "out": out.getvalue(), "torch": "torch" in sys.modules}))
    """)
    env = {**os.environ, "PYTHONPATH": python_path(REPO_ROOT)}  # keeps an inherited PYTHONPATH's libraries
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "cwd", capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["rc"] == 0 and not facts["torch"], (facts, done.stderr)
    assert yaml.safe_load(facts["out"])["train"]["lr"] == 1.0e-3
    done = subprocess.run([sys.executable, "-m", "finetune", "recipes", "list"], cwd=tmp_path / "cwd",
                          capture_output=True, text=True, env={**env, "COLUMNS": "1000"}, timeout=60)
    assert done.returncode == 0 and "team/sft" in done.stdout, done.stderr


# --- requires ------------------------------------------------------------------------------------------

def test_requires_met(write_recipe):
    from finetune import __version__

    path = write_recipe(f"extends: {SHIPPED / 'quickstart.yaml'}\n"
                        f"requires: {{finetune: '>={__version__}', pyyaml: '>=5', PyYAML: '>=5,<100'}}\n")
    assert load_recipe(path).requires["finetune"] == f">={__version__}"


def test_requires_unmet_names_each_requirement_and_the_fix(write_recipe, capsys):
    import importlib.metadata

    from finetune import __version__

    pyyaml = importlib.metadata.version("pyyaml")
    path = write_recipe(f"extends: {SHIPPED / 'quickstart.yaml'}\nrequires:\n"
                        "  finetune: '>=99'\n  pyyaml: '<1'\n  pyyml: '>=1'\n  no-such-package-xyz: '>=1'\n"
                        "  transformers: '5.23.0'\n")
    rc, out, err = cli(capsys, "validate", str(path))
    assert rc == 2 and out == ""
    assert f"error: {path}: 5 requirements are not met" in err
    assert f"requires.finetune: needs finetune>=99, installed {__version__}; fix: pip install 'finetune>=99'" in err
    assert f"requires.pyyaml: needs pyyaml<1, installed {pyyaml}; fix: pip install 'pyyaml<1'" in err
    assert "requires.pyyml: needs pyyml>=1, which is not installed (did you mean 'pyyaml'?)" in err
    assert "requires.no-such-package-xyz: needs no-such-package-xyz>=1, which is not installed; fix:" in err
    assert "requires.transformers: '5.23.0' is not a version specifier (did you mean '==5.23.0'?)" in err
    # The documented way out: drop the check for one run.
    rc, out, err = cli(capsys, "validate", str(path), "requires={}")
    assert rc == 0, err


# --- small pieces -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "validate", "eval", "verify"])
def test_every_recipe_command_takes_a_name(command, capsys):
    """All four go through one helper: a name resolves (here to a mistake caught before torch is imported)."""
    rc, _, err = cli(capsys, command, "quickstart", "train.lr=-1")
    assert rc == 2 and f"error: {SHIPPED / 'quickstart.yaml'}: 1 problem in the recipe" in err, err
    rc, _, err = cli(capsys, command, "quickstar")
    assert rc == 2 and "Did you mean: quickstart" in err


@pytest.mark.parametrize(("ref", "path_like"), [
    ("quickstart", False), ("team/sft", False), ("team/sub/sft", False), ("llama-3.1-8b-lora", False),
    ("quickstart.yaml", True), ("x.YML", True), ("./quickstart", True), ("../q", True), ("~/q", True),
    ("/abs/q", True), ("team/../q", True), ("team//q", True), ("", True),
])
def test_names_and_paths(ref, path_like):
    assert names.is_path_like(ref) is path_like


def test_description_is_the_first_line_of_the_leading_comment(tmp_path):
    cases = {
        "# yaml-language-server: $schema=recipe.schema.json\n#\n# What it does\n# more\nseed: 1\n": "What it does",
        "\n# Leading blank lines are fine\nseed: 1\n": "Leading blank lines are fine",
        "seed: 1  # a key's comment is no description\n# nor is a later one\n": "",
        "": "",
    }
    for i, (text, expected) in enumerate(cases.items()):
        assert names.describe(write(tmp_path / f"{i}.yaml", text)) == expected


def test_home_defaults_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("FINETUNE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert names.repos_root() == tmp_path / "xdg" / "finetune" / "recipes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert names.repos_root() == Path.home() / ".cache" / "finetune" / "recipes"


# --- packaging: the shipped examples travel with a non-editable install ---------------------------------------

def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_every_package_is_listed_when_packages_are_listed():
    """An explicit `packages` list (needed to map examples/ into the package) must not forget a subpackage."""
    listed = _pyproject()["tool"]["setuptools"].get("packages")
    if not isinstance(listed, list):
        pytest.skip("packages are discovered with packages.find")
    on_disk = {".".join(p.parent.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "finetune").rglob("__init__.py")}
    assert on_disk <= set(listed), f"add to [tool.setuptools] packages: {sorted(on_disk - set(listed))}"


def test_an_installed_wheel_finds_the_shipped_examples(tmp_path):
    """Build the wheel, install it away from the checkout, run a shipped recipe by name: paths resolve inside it."""
    if "finetune.examples" not in _pyproject()["tool"]["setuptools"].get("package-dir", {}):
        pytest.skip("pyproject.toml does not map examples/ into the package (finetune.examples) yet")
    needs("setuptools", minimum="77")  # the build backend of pyproject.toml, used without build isolation
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source, wheels, site = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("finetune", "examples"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(wheels.glob("finetune-*.whl"))
    done = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # The installed copy first; the inherited PYTHONPATH after it for the libraries (on a GPU machine they live only
    # there), less the checkout, so `finetune` can only come from the wheel.
    env = {**os.environ, "PYTHONPATH": python_path(site, without=REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "finetune", "validate", "quickstart"], cwd=tmp_path / "cwd",
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed["tokenizer"]["path"] == str(site / "finetune" / "examples" / "tokenizer")
    assert Path(printed["datasets"][0]["path"]).is_file()


def test_a_broken_registry_is_reported_by_names_and_ignored_by_paths(team, write_recipe, capsys):
    names.registry_file().parent.mkdir(parents=True)
    names.registry_file().write_text("{not json")
    write_recipe({"seed": 3}, "base.yaml")
    assert load_raw(write_recipe({"extends": "base.yaml"}, "child.yaml")) == {"seed": 3}
    rc, _, err = cli(capsys, "validate", "team/sft")
    assert rc == 2 and "the recipe repository registry is unreadable" in err
