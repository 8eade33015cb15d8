"""Code in recipes (finetune/recipe/code.py): a recipe that names code runs it only with the user's consent, given
where a shared recipe cannot give it (--allow-code, or allow_code in the recipe file the user runs); every reference
is named with the file and `extends:` chain it came from; `validate` imports each one when allowed and names it when
not; a run records each one's source file by sha256.

The end-to-end case is the attack of issue 40: a recipe repository (added with `finetune recipes add`) reached through
`extends:` names a standard-library callable as a reward function.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import QUICKSTART_YAML
from helpers import TINY, run_cli

from finetune.cli import main
from finetune.errors import UserError
from finetune.recipe import load_recipe
from finetune.recipe.code import references, require_consent

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
REPLAY = QUICKSTART_YAML.parent / "grpo-replay.yaml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(autouse=True)
def own_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward module's folder is put on sys.path when it is imported (recipe/code.py): only for this test; and
    the modules the tests write are imported afresh."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("good_rewards", "broken_rewards", "team_rewards", "my_rewards"):
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Own FINETUNE_HOME (recipe repositories), no FINETUNE_RECIPE_PATH, git without the user's config."""
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FINETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FINETUNE_RECIPE_PATH", raising=False)
    return tmp_path / "home"


def grpo_prompts(folder: Path, prompt: str) -> Path:
    """Eight prompt rows of `prompt` and nothing else: pty.spawn(prompts, completions) gets them as its argv."""
    return write(folder / "prompts.jsonl", "".join(json.dumps({"prompt": prompt}) + "\n" for _ in range(8)))


def team_repository(root: Path, reward: str) -> str:
    """A git repository of recipes (what `finetune recipes add` clones): grpo.yaml names `reward` and tries to give
    itself consent; team_rewards.py, a reward module beside it. Returns its file:// URL."""
    work = root / "team-work"
    work.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=work, check=True, env={**os.environ, **GIT_ENV})
    write(work / "grpo.yaml", f"""\
        # Team GRPO
        extends: {REPLAY}
        allow_code: true
        datasets: [{{path: prompts.jsonl, format: prompt}}]
        grpo:
          replay: null
          num_generations: 2
          max_new_tokens: 2
          rewards: [{{function: "{reward}"}}]
        """)
    write(work / "team_rewards.py", """\
        import os
        def score(prompts, completions, **fields):
            open(os.environ["MARKER"], "w").write("ran")
            return [float(len(c) % 2) for c in completions]
        """)
    grpo_prompts(work, "What is 1 + 1?")
    for cmd in (["add", "-A"], ["commit", "-q", "-m", "recipes"]):
        subprocess.run(["git", *cmd], cwd=work, check=True, env={**os.environ, **GIT_ENV})
    return work.as_uri()


def user_recipe(folder: Path, prompts: Path, *extra: str) -> Path:
    lines = [f"extends: {extra[0]}" if extra else "extends: team/grpo", f"output_dir: {folder / 'run'}",
             f"datasets: [{{path: {prompts}, format: prompt}}]", "eval_datasets: []",
             "train: {micro_batch_size: 2, gradient_accumulation_steps: 1, max_steps: 1}"]
    return write(folder / "mine.yaml", "\n".join(lines) + "\n")


def run_args(recipe: Path, *flags: str) -> list[str]:
    return ["train", str(recipe), *TINY, *flags]


def test_a_shared_recipe_naming_a_stdlib_callable_runs_nothing_without_consent(home, tmp_path, capsys):
    """Issue 40's attack: the repository's recipe sets `function: "pty:spawn"` (and allow_code: true, which it cannot
    give). Without consent: exit 2 naming the reference and the repository, and nothing executed. With --allow-code
    the very same callable runs (as the user's own Python would): the marker is made."""
    url = team_repository(tmp_path, "pty:spawn")
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    marker = tmp_path / "pwned"
    script = write(tmp_path / "make-marker.sh", f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    recipe = user_recipe(tmp_path, grpo_prompts(tmp_path, str(script)))
    env = {"FINETUNE_HOME": str(home), **GIT_ENV}
    r = run_cli(*run_args(recipe), env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    clone = home / "recipes" / "team" / "grpo.yaml"
    assert f"grpo.rewards.0.function: pty:spawn (from {clone} (repo team@" in r.stderr, r.stderr
    assert f"extended by {recipe}" in r.stderr and "--allow-code" in r.stderr
    assert f"allow_code in {clone} was not counted" in r.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()

    r = run_cli(*run_args(recipe, "--allow-code"), env=env)
    assert marker.exists(), r.stderr[-3000:]  # it ran: consent is the same trust as running it yourself
    assert r.returncode == 2 and "reward function 'spawn' raised" in r.stderr  # pty.spawn is no reward function


def test_with_consent_a_module_beside_its_recipe_runs_and_the_run_records_its_sha256(home, tmp_path, capsys,
                                                                                    monkeypatch):
    """A reward module next to the repository recipe that names it is found there; versions.json records its file and
    sha256, and `runs compare` marks the row when the module changed between two runs."""
    url = team_repository(tmp_path, "team_rewards:score")
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    recipe = user_recipe(tmp_path, grpo_prompts(tmp_path, "What is 0 + 1?"))
    marker = tmp_path / "ran"
    r = run_cli(*run_args(recipe, "--allow-code"), env={"FINETUNE_HOME": str(home), "MARKER": str(marker), **GIT_ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.read_text() == "ran"
    module = home / "recipes" / "team" / "team_rewards.py"
    record = json.loads((tmp_path / "run" / "versions.json").read_text())["run"]["code"]
    assert record == {"grpo.rewards.0.function": {"ref": "team_rewards:score", "file": str(module),
                                                  "sha256": hashlib.sha256(module.read_bytes()).hexdigest()}}
    other = tmp_path / "other"
    other.mkdir()
    for name in ("recipe.yaml", "metrics.jsonl"):
        (other / name).write_bytes((tmp_path / "run" / name).read_bytes())
    versions = json.loads((tmp_path / "run" / "versions.json").read_text())
    versions["run"]["code"]["grpo.rewards.0.function"]["sha256"] = "0" * 64
    (other / "versions.json").write_text(json.dumps(versions))
    monkeypatch.setenv("COLUMNS", "1000")  # one line per table row
    rc, out, _ = cli(capsys, "runs", "compare", str(tmp_path / "run"), str(other))
    assert rc == 0 and "code grpo.rewards.0.function (differs)" in out and "sha256 000000000000" in out


def test_consent_is_given_by_the_flag_or_the_recipe_you_run_never_by_one_it_extends(tmp_path):
    base = write(tmp_path / "base.yaml", f"""\
        extends: {REPLAY}
        allow_code: true
        grpo: {{rewards: [{{function: "my_rewards:score"}}]}}
        """)
    mine = write(tmp_path / "mine.yaml", "extends: base.yaml\n")
    notes: list[str] = []
    recipe = load_recipe(mine, notes=notes)
    assert not recipe.allow_code and notes == [
        f"allow_code in {base.resolve()} was not counted: it is a recipe that is extended; only the recipe file you "
        "run, or --allow-code, can allow code"]
    [ref] = references(recipe)
    assert (ref.key, ref.spec) == ("grpo.rewards.0.function", "my_rewards:score")
    assert ref.origin.text == f"{base.resolve()}, extended by {mine.resolve()}" and not ref.origin.own
    with pytest.raises(UserError, match=r"running it has not been allowed:\n  - grpo.rewards.0.function: "
                                        r"my_rewards:score \(from .*base.yaml, extended by .*mine.yaml\)"):
        require_consent(recipe)
    assert load_recipe(mine, allow_code=True).allow_code  # --allow-code
    assert load_recipe(write(tmp_path / "own.yaml", "extends: base.yaml\nallow_code: true\n")).allow_code
    overridden = load_recipe(mine, ["grpo.rewards=[{function: 'other:fn'}]"])
    assert references(overridden)[0].origin.text == "the command line"


def test_a_repository_recipe_run_by_name_cannot_allow_code(home, tmp_path, capsys, monkeypatch):
    url = team_repository(tmp_path, "team_rewards:score")
    assert cli(capsys, "recipes", "add", "team", url)[0] == 0
    monkeypatch.chdir(tmp_path)
    notes: list[str] = []
    recipe = load_recipe("team/grpo", notes=notes)
    assert not recipe.allow_code and any("a recipe repository's file" in n for n in notes)
    rc, _, err = cli(capsys, "train", "team/grpo")
    assert rc == 2 and "grpo.rewards.0.function: team_rewards:score (from " in err and "(repo team@" in err


def test_inherited_trust_remote_code_needs_consent_and_ones_own_does_not(tmp_path):
    base = write(tmp_path / "base.yaml", f"extends: {QUICKSTART_YAML}\nmodel: {{trust_remote_code: true}}\n")
    inherited = load_recipe(write(tmp_path / "mine.yaml", f"extends: {base.name}\n"))
    [ref] = references(inherited)
    assert ref.key == "model.trust_remote_code" and "base.yaml" in ref.origin.text
    with pytest.raises(UserError, match="model.trust_remote_code: the Python files of model"):
        require_consent(inherited)
    own = load_recipe(write(tmp_path / "own.yaml", f"extends: {QUICKSTART_YAML}\nmodel: {{trust_remote_code: true}}\n"))
    assert references(own) == []
    assert references(load_recipe(tmp_path / "mine.yaml", ["model.trust_remote_code=true"])) == []


@pytest.mark.parametrize(("spec", "why"), [
    (":f", "an empty module name"), (".mod:f", "a relative module name"), ("mod:", "an empty function name"),
    ("my-mod:f", "must be Python names"), ("nope", "unknown reward function 'nope'; built-ins: exact_answer"),
])
def test_a_malformed_reference_is_a_recipe_error_with_or_without_consent(tmp_path, capsys, spec, why):
    recipe = write(tmp_path / "r.yaml", f"extends: {REPLAY}\ngrpo: {{rewards: [{{function: '{spec}'}}]}}\n")
    for flags in ((), ("--allow-code",)):
        rc, _, err = cli(capsys, "validate", str(recipe), *flags)
        assert rc == 2 and "grpo.rewards.0.function: got" in err and why in err, err


def test_validate_names_code_without_consent_and_imports_it_with(tmp_path, capsys):
    (tmp_path / "good_rewards.py").write_text("def score(prompts, completions, **kw):\n    return [0.0]\n")
    recipe = write(tmp_path / "r.yaml", f"extends: {REPLAY}\ngrpo: {{rewards: [{{function: 'good_rewards:score'}}]}}\n")
    rc, out, err = cli(capsys, "validate", str(recipe))
    assert rc == 0 and yaml.safe_load(out)["grpo"]["rewards"][0]["function"] == "good_rewards:score"
    assert "code: grpo.rewards.0.function: good_rewards:score (from " in err and "not imported" in err
    rc, out, err = cli(capsys, "validate", str(recipe), "--allow-code")
    assert rc == 0 and f"imported from {tmp_path / 'good_rewards.py'} (sha256 " in err, err


@pytest.mark.parametrize(("source", "message"), [
    ("def score(:\n", "importing 'broken_rewards' for 'broken_rewards:score' raised SyntaxError: "),
    ("raise RuntimeError('no GPU here')\n", "raised RuntimeError: no GPU here"),
    ("import sys\nsys.exit(3)\n", "raised SystemExit: 3"),
    ("x = 1\n", "module 'broken_rewards' ("),
    (None, "cannot import 'broken_rewards' for 'broken_rewards:score'"),
])
def test_a_broken_reference_is_found_by_validate_before_any_run(tmp_path, capsys, source, message):
    if source is not None:
        (tmp_path / "broken_rewards.py").write_text(source)
    recipe = write(tmp_path / "r.yaml", f"extends: {REPLAY}\ngrpo: {{rewards: [{{function: 'broken_rewards:score'}}]}}\n")
    rc, _, err = cli(capsys, "validate", str(recipe), "--allow-code")
    assert rc == 2 and "grpo.rewards.0.function: " in err and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(("args", "problem"), [
    ({"targt": 3}, "grpo.rewards.0.args.targt: unknown key; did you mean 'target'?"),
    ({"target": -1}, "grpo.rewards.0.args.target: got -1; input should be greater than or equal to 0"),
])
def test_built_in_args_are_checked_like_recipe_keys(tmp_path, capsys, args, problem):
    recipe = write(tmp_path / "r.yaml", f"extends: {REPLAY}\n")
    rc, _, err = cli(capsys, "validate", str(recipe), f"grpo.rewards=[{{function: length, args: {json.dumps(args)}}}]")
    assert rc == 2 and problem in err, err


def test_format_regex_needs_a_pattern_that_compiles_and_exact_answer_a_known_arg(tmp_path, capsys):
    recipe = write(tmp_path / "r.yaml", f"extends: {REPLAY}\n")
    rc, _, err = cli(capsys, "validate", str(recipe), "grpo.rewards=[{function: format_regex}, {function: "
                     "format_regex, args: {pattern: '(('}}, {function: exact_answer, args: {feild: gold}}]")
    assert rc == 2 and "3 problems" in err, err
    assert "grpo.rewards.0.args.pattern: required, but missing" in err
    assert "grpo.rewards.1.args.pattern: got \"((\"; not a regular expression: missing )" in err
    assert "grpo.rewards.2.args.feild: unknown key; did you mean 'field'?" in err


def test_tools_and_an_environment_are_code_that_needs_consent(tmp_path):
    data = REPLAY.parent.parent / "data" / "grpo_prompts_train.jsonl"
    recipe = load_recipe(write(tmp_path / "r.yaml", f"extends: {REPLAY}\ngrpo: {{replay: null}}\n"
                               f"datasets: [{{path: {data}, format: prompt}}]\n"),
                         ["grpo.tools=[calc:multiply, calc:divide]", "grpo.environment=games:Chess"])
    assert [(r.key, r.spec) for r in references(recipe)] == [("grpo.tools.0", "calc:multiply"),
                                                           ("grpo.tools.1", "calc:divide"),
                                                           ("grpo.environment", "games:Chess")]
    with pytest.raises(UserError, match=r"- grpo.tools.0: calc:multiply \(from the command line\)\n"
                                        r"  - grpo.tools.1: calc:divide .*\n  - grpo.environment: games:Chess"):
        require_consent(recipe)
    with pytest.raises(UserError, match=r"grpo.tools: got .*each tool is module.path:function: ':x' \(an empty "
                                        "module name\\)"):
        load_recipe(tmp_path / "r.yaml", ["grpo.tools=[':x']"])
