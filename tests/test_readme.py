"""README.md's commands work as a new user pastes them, in order (issue 41).

The user: a fresh clone, the README's first block (`make quickstart`, `make test`, `. .venv/bin/activate`), then
every command of the README's ```sh blocks in the order they appear. Nothing is run here (no training, no download,
a few seconds): each command is checked as far as it can be without running it.

- Every fence is labeled: ```sh or ```bash (shell commands), ```text (printed output), ```yaml. A yaml block headed
  `# examples/yaml/NAME.yaml` shows only keys and values that file has.
- A command line is split at `&&`, `||`, `;` and `|`, after joining `\\` continuations and dropping comments;
  `NAME=value` prefixes are environment settings. Its executable exists: `make` targets (and `VAR=value` arguments)
  of the Makefile; finetune, python, pip, pytest and torchrun in .venv/bin (CI runs this after `make install`);
  the file `.` sources. Any other executable fails the test until this file is taught it, except those in SKIPPED.
- `finetune ...` (also `python -m finetune`, `torchrun ... -m finetune`, and the Makefile's own lines behind a
  `make` target) parses with finetune.cli.build_parser() and cli.main's rule for what argparse leaves over. A
  recipe command's recipe loads with its overrides (load_recipe, which imports no torch), and its inputs are checked
  as check_inputs checks them, except those under runs/, which an earlier command must make (below).
- Paths under runs/ exist only if an earlier command made them: a `finetune train` whose output_dir it is (the
  recipe's, after overrides) or `finetune merge`'s output; a train into an output_dir that an earlier command wrote
  is refused by finetune without --overwrite (or `resume`), and so here. Repository paths (examples/, scripts/,
  benchmarks/, tests/, docs/, docker/, finetune/) exist.
- `pip install 'finetune[EXTRA]'` names extras of pyproject.toml; `python SCRIPT --flag` names an existing script
  whose source spells each flag.

torchrun commands need GPUs to run, not to be checked: their arguments are checked like the rest.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project supports 3.10, where tomllib is the third-party tomli
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
VENV_BIN = ROOT / ".venv" / "bin"

FENCE_LANGUAGES = {"sh", "bash", "text", "yaml"}
SHELL_LANGUAGES = {"sh", "bash"}
ACTIVATION = (".", ".venv/bin/activate")
# Executables the README may name, found in .venv/bin after `make install`.
VENV_TOOLS = {"finetune", "python", "pip", "pytest", "torchrun"}
# First path parts of repository files, which must exist; and of what commands make, which an earlier command must.
REPO_DIRS = {"examples", "scripts", "benchmarks", "tests", "docs", "docker", "finetune"}
MADE_DIRS = {"runs"}
RECIPE_COMMANDS = {"train", "validate", "preprocess", "eval", "verify"}
SKIPPED = {
    "docker": "docker is not installed by `make install`, and a build needs the network; docker/ is checked by "
              "tests/test_docker.py",
}
_SEPARATORS = {"&&", "||", ";", "|"}
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


# ------------------------------------------------------------------------------------------------- reading


@dataclass
class Fence:
    language: str
    line: int  # of the opening fence, 1-based
    body: list[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Command:
    line: int
    argv: tuple[str, ...]
    env: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"L{self.line}: {shlex.join(self.env + self.argv)[:70]}"


def fences(text: str) -> list[Fence]:
    """The fenced blocks of a Markdown text (``` or ~~~, at any indent), with their language labels."""
    found: list[Fence] = []
    current: Fence | None = None
    for number, line in enumerate(text.splitlines(), 1):
        marker = re.match(r"^\s*(?:`{3,}|~{3,})\s*(\S*)", line)
        if current is None and marker:
            current = Fence(marker.group(1), number)
        elif current is not None and marker and not marker.group(1):
            found.append(current)
            current = None
        elif current is not None:
            current.body.append((number, line))
    assert current is None, f"the fence opened on line {current.line} is never closed"
    return found


def fence_problems(text: str) -> list[str]:
    return [f"line {f.line}: fence labeled {f.language or 'nothing'!r}; label it one of {sorted(FENCE_LANGUAGES)} "
            "(sh: commands, text: printed output)" for f in fences(text) if f.language not in FENCE_LANGUAGES]


def _logical_lines(body: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    pending, start = "", 0
    for number, line in body:
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending, start = "", 0
    if pending:
        yield start, pending


def split_commands(line: int, text: str) -> list[Command]:
    """One shell line -> its simple commands (comments dropped, env prefixes apart). Other shell syntax (a
    redirection, a subshell) is an error: teach this test before the README uses it."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    commands: list[Command] = []
    words: list[str] = []
    for token in [*tokens, ";"]:
        if token in _SEPARATORS:
            env = tuple(w for w in _leading_env(words))
            if words[len(env):]:
                commands.append(Command(line, tuple(words[len(env):]), env))
            words = []
        elif token and set(token) <= set("();<>|&"):
            raise AssertionError(f"line {line}: shell syntax {token!r} is not checked by tests/test_readme.py")
        else:
            words.append(token)
    return commands


def _leading_env(words: list[str]) -> Iterator[str]:
    for word in words:
        if not _ENV.match(word):
            return
        yield word


def shell_commands(text: str) -> list[Command]:
    """Every command of the text's sh/bash fences, in order."""
    return [command for fence in fences(text) if fence.language in SHELL_LANGUAGES
            for line, logical in _logical_lines(fence.body) for command in split_commands(line, logical)]


# ------------------------------------------------------------------------------------------------- the Makefile


def makefile() -> tuple[dict[str, list[str]], dict[str, str]]:
    """(target -> its recipe lines with simple variables expanded, variable -> value)."""
    variables: dict[str, str] = {}
    rules: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in MAKEFILE.read_text().splitlines():
        assignment = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*[:?]?=\s*(.*)$", line)
        rule = re.match(r"^([^\s:#=][^:=]*?)\s*:(?!=)", line)
        if line.startswith("\t") and current is not None:
            current.append(line[1:])
        elif assignment:
            variables[assignment.group(1)] = assignment.group(2).strip()
            current = None
        elif rule:
            current = []
            for target in rule.group(1).split():
                rules[target] = current
        elif not line.strip():
            current = None  # a blank line ends a rule; a comment line does not

    def expand(text: str) -> str:
        for _ in range(10):
            text = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables.get(m.group(1), m.group(0)), text)
        return text

    return {target: [expand(x) for x in lines] for target, lines in rules.items()}, variables


# ------------------------------------------------------------------------------------------------- the walk


@dataclass
class Walk:
    """What the commands so far have made: run directories (output_dir -> the line of the train that wrote it)
    and other made paths."""

    runs: dict[str, int] = field(default_factory=dict)
    made: dict[str, int] = field(default_factory=dict)
    line: int = 0  # of the command being checked

    def has(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in (*self.runs, *self.made))


def repo_relative(path: str) -> str | None:
    """`path` relative to the repository root, normalized (None for an absolute path outside it)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        try:
            p = p.resolve().relative_to(ROOT)
        except ValueError:
            return None
    return os.path.normpath(p).replace(os.sep, "/")


def need(path: str, walk: Walk, what: str) -> list[str]:
    """`path` (an input) exists when the command runs: made by an earlier command, or a repository file."""
    rel = repo_relative(path)
    if rel is None:
        return [f"{what} {path}: an absolute path outside the repository"]
    if rel.split("/")[0] in MADE_DIRS:
        return [] if walk.has(rel) else [f"{what} {path}: no earlier command in the README makes it"]
    if not (ROOT / rel).exists():
        return [f"{what} {path}: no such file in the repository"]
    return []


def named_paths(argv: tuple[str, ...]) -> list[str]:
    """Arguments that name a repository path or a made one (not options, not key=value overrides)."""
    out = []
    for token in argv:
        value = token.split("=", 1)[1] if token.startswith("--") and "=" in token else token
        if value.startswith("-") or "=" in value:
            continue
        if value.split("/")[0] in REPO_DIRS | MADE_DIRS and "/" in value:
            out.append(value)
    return out


@contextlib.contextmanager
def in_repository() -> Iterator[None]:
    """Output dirs and paths not found next to a recipe are relative to the current directory: the root."""
    before = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(before)


def check(command: Command, walk: Walk) -> list[str]:
    """The problems of one command, given what earlier commands made; records what it makes."""
    argv = command.argv
    tool = argv[0]
    problems = [p for path in named_paths(argv[1:]) for p in need(path, walk, "argument")]
    if tool in SKIPPED:
        return problems
    if tool in VENV_TOOLS:
        if not (VENV_BIN / tool).is_file():
            problems.append(f"{tool} is not in .venv/bin (`make install` puts it there)")
        checker = {"finetune": check_finetune, "python": check_python, "pip": check_pip, "pytest": check_pytest,
                   "torchrun": check_torchrun}[tool]
        return problems + checker(argv[1:], walk)
    if tool in (".", "source"):
        return problems + ([] if len(argv) == 2 and (ROOT / argv[1]).is_file() else
                           [f"{shlex.join(argv)}: sources no file of the checkout"])
    if tool == "make":
        return problems + check_make(argv[1:], walk)
    if tool in ("bash", "sh"):
        return problems + (need(argv[1], walk, "script") if len(argv) > 1 else ["a shell with no script"])
    return problems + [f"executable {tool!r}: not one the README's reader has after `make quickstart` and the "
                       "activation line (or tests/test_readme.py does not know it yet)"]


def check_make(args: tuple[str, ...], walk: Walk) -> list[str]:
    rules, variables = makefile()
    text = MAKEFILE.read_text()
    problems = []
    for arg in args:
        if "=" in arg:
            name = arg.split("=", 1)[0]
            if f"$({name})" not in text and name not in variables:
                problems.append(f"make variable {name}: the Makefile does not read it")
        elif arg not in rules:
            problems.append(f"make target {arg!r}: not in the Makefile (targets: {sorted(rules)})")
        else:
            for line in rules[arg]:
                argv = shlex.split(line.lstrip("@-"))
                if argv and argv[0].endswith("bin/finetune"):
                    problems += [f"Makefile `{arg}`: {p}" for p in check_finetune(tuple(argv[1:]), walk)]
    return problems


def parse_finetune(args: tuple[str, ...]):
    """finetune's own parsing: build_parser(), then what cli.main does with the arguments argparse left over."""
    from finetune.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsed, extra = build_parser().parse_known_args(list(args))
    except SystemExit as e:
        return None, [] if e.code == 0 else [f"finetune's parser refuses it: {err.getvalue().strip()}"]
    problems = []
    for item in extra:
        if item.startswith("-") or not hasattr(parsed, "overrides") or "=" not in item:
            problems.append(f"finetune refuses the argument {item!r}")
        else:
            parsed.overrides.append(item)
    if not getattr(parsed, "command", None):
        problems.append("finetune with no command")
    return parsed, problems


def check_finetune(args: tuple[str, ...], walk: Walk) -> list[str]:
    parsed, problems = parse_finetune(args)
    if parsed is None or problems:
        return problems
    command = parsed.command
    if command in RECIPE_COMMANDS:
        rel = repo_relative(parsed.recipe)
        if command == "eval" and rel is not None and rel.split("/")[0] in MADE_DIRS:  # a run directory
            return need(parsed.recipe, walk, "run")
        return check_recipe(parsed, walk)
    if command == "merge":
        problems = need(parsed.run_dir, walk, "run")
        walk.made[repo_relative(parsed.out or f"{parsed.run_dir}/merged") or parsed.out] = walk.line
        return problems
    if command in ("generate", "chat"):
        return need(parsed.run_dir, walk, "run") + [p for image in getattr(parsed, "image", [])
                                                     for p in need(image, walk, "image")]
    if command == "plot":
        return [p for run in parsed.run_dirs for p in need(run, walk, "run")]
    if command == "runs":
        return need(parsed.run_a, walk, "run") + need(parsed.run_b, walk, "run")
    if command == "convert":
        return need(parsed.config, walk, "config")
    return []  # env, schema, recipes: nothing to check beyond parsing


def recipe_inputs(recipe) -> list[str]:
    """The input paths a recipe reads (after `extends:` and overrides)."""
    paths = [recipe.tokenizer.path, *(ds.path for ds in (*recipe.datasets, *recipe.eval_datasets))]
    if recipe.model.init == "pretrained":
        paths.append(recipe.model.path)
    if recipe.resume not in (None, "auto"):
        paths.append(recipe.resume)
    if recipe.train.objective == "dpo" and recipe.dpo.reference != "auto":
        paths.append(recipe.dpo.reference)
    if recipe.train.objective == "grpo":
        paths += [recipe.grpo.replay, recipe.grpo.reference if recipe.grpo.reference != "auto" else None]
    return [p for p in paths if p and "://" not in p]


def check_recipe(parsed, walk: Walk) -> list[str]:
    """The recipe loads with its overrides; inputs that earlier commands make are checked against them, the rest
    by load_recipe's check_inputs; a train into a run an earlier command wrote needs --overwrite or resume."""
    from finetune.errors import UserError
    from finetune.recipe import load_recipe, missing_inputs

    try:
        with in_repository():
            recipe = load_recipe(parsed.recipe, list(parsed.overrides), allow_code=parsed.allow_code)
            made = [p for p in recipe_inputs(recipe)
                    if (rel := repo_relative(p)) is not None and rel.split("/")[0] in MADE_DIRS]
            # check_inputs's own checks (load_recipe(check_inputs=True) adds exactly these), but for made inputs
            missing = [m for m in missing_inputs(recipe) if not any(p in m for p in made)]
    except UserError as e:
        return [f"the recipe does not load: {e}"]
    problems = [f"the recipe does not load: {m}" for m in missing]
    problems += [p for path in made for p in need(path, walk, "recipe input")]
    if parsed.command == "train":
        out = repo_relative(recipe.output_dir) or recipe.output_dir
        if out in walk.runs and not parsed.overwrite and recipe.resume is None:
            problems.append(f"output_dir {out} was written by the command on line {walk.runs[out]}: a second "
                            "train into it is refused without --overwrite (or resume: auto)")
        walk.runs[out] = walk.line
    return problems


def check_python(args: tuple[str, ...], walk: Walk) -> list[str]:
    if args[:1] == ("-m",):
        module, rest = args[1] if len(args) > 1 else "", args[2:]
        checker = {"finetune": check_finetune, "pytest": check_pytest}.get(module)
        return checker(rest, walk) if checker else [f"python -m {module}: a module tests/test_readme.py does not know"]
    if not args or args[0].startswith("-"):
        return [f"python {shlex.join(args)}: no script named"]
    problems = need(args[0], walk, "script")
    if not problems:
        source = (ROOT / args[0]).read_text()
        problems += [f"{args[0]} defines no option {flag}" for token in args[1:] if token.startswith("--")
                     if (flag := token.split("=", 1)[0]) and f'"{flag}"' not in source and f"'{flag}'" not in source]
    return problems


def check_pytest(args: tuple[str, ...], walk: Walk) -> list[str]:
    return [p for token in args if not token.startswith("-") and ("/" in token or token.endswith(".py"))
            for p in need(token.split("::")[0], walk, "test path")]


def check_pip(args: tuple[str, ...], walk: Walk) -> list[str]:
    if args[:1] != ("install",):
        return [f"pip {shlex.join(args)}: only `pip install` is expected in the README"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    problems = []
    for token in args[1:]:
        ours = re.fullmatch(r"(?:finetune|\.)\[([^\]]*)\]", token)
        for extra in (ours.group(1).split(",") if ours else []):
            if extra.strip() not in extras:
                problems.append(f"pip install {token}: pyproject.toml defines no extra {extra.strip()!r} "
                                f"(extras: {sorted(extras)})")
    return problems


def check_torchrun(args: tuple[str, ...], walk: Walk) -> list[str]:
    if "-m" not in args or args[args.index("-m") + 1:][:1] != ("finetune",):
        return [f"torchrun {shlex.join(args)}: expected torchrun ... -m finetune ..."]
    return check_finetune(args[args.index("-m") + 2:], walk)


def walk_commands(commands: list[Command]) -> list[list[str]]:
    """Each command's problems, checked in order (what one makes, the next may use)."""
    walk = Walk()
    results = []
    for command in commands:
        walk.line = command.line
        results.append(check(command, walk))
    return results


def problems_of(text: str) -> list[list[str]]:
    return walk_commands(shell_commands(text))


# ------------------------------------------------------------------------------------------------- the README

README_TEXT = README.read_text(encoding="utf-8")
COMMANDS = shell_commands(README_TEXT)


@pytest.fixture(scope="module")
def readme_results() -> list[list[str]]:
    return walk_commands(COMMANDS)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c.id for c in COMMANDS])
def test_the_readme_command_is_runnable_as_written(readme_results, index):
    command = COMMANDS[index]
    if command.argv[0] in SKIPPED:
        pytest.skip(SKIPPED[command.argv[0]])
    assert readme_results[index] == [], f"README line {command.line}: {shlex.join(command.argv)}"


def test_every_readme_fence_is_labeled():
    assert fence_problems(README_TEXT) == []


def test_the_readme_starts_with_the_setup_commands_and_the_activation_line():
    first = next(f for f in fences(README_TEXT) if f.language in SHELL_LANGUAGES)
    commands = [c.argv for line, text in _logical_lines(first.body) for c in split_commands(line, text)]
    assert commands == [("make", "quickstart"), ("make", "test"), ACTIVATION]


def test_the_readme_names_the_venv_only_in_the_activation_line():
    """One convention: every command after the activation line is plain `finetune`, `python`, `pip`, ..."""
    lines = [n for n, line in enumerate(README_TEXT.splitlines(), 1) if ".venv/bin/" in line]
    activation = [n for n, line in enumerate(README_TEXT.splitlines(), 1) if line.startswith(" ".join(ACTIVATION))]
    assert len(activation) == 1 and lines == activation, f".venv/bin/ on README lines {lines}"


def _subset_problems(shown, actual, where: str) -> list[str]:
    if isinstance(shown, dict):
        if not isinstance(actual, dict):
            return [f"{where}: a mapping in the README, {actual!r} in the file"]
        return [p for key, value in shown.items() if key != "..."
                for p in (_subset_problems(value, actual[key], f"{where}.{key}") if key in actual
                          else [f"{where}.{key}: not in the file"])]
    if isinstance(shown, list):
        if not isinstance(actual, list) or len(shown) > len(actual):
            return [f"{where}: {shown!r} in the README, {actual!r} in the file"]
        return [p for i, value in enumerate(shown) for p in _subset_problems(value, actual[i], f"{where}.{i}")]
    return [] if shown == actual else [f"{where}: {shown!r} in the README, {actual!r} in the file"]


def test_an_abridged_recipe_in_the_readme_shows_what_its_file_holds():
    shown = [f for f in fences(README_TEXT) if f.language == "yaml"
             and f.body and re.match(r"#\s*examples/yaml/\S+\.yaml", f.body[0][1].strip())]
    assert shown, "the README's recipe block names its file in its first line"
    for fence in shown:
        file = ROOT / fence.body[0][1].strip().lstrip("#").split()[0]
        text = "\n".join(line for _, line in fence.body)
        assert _subset_problems(yaml.safe_load(text), yaml.safe_load(file.read_text()), file.name) == []


# ------------------------------------------------------------------------------------------------- the checker
# The checks above can fail: each kind of mistake the README had, or could have, is caught.


def _sh(*lines: str) -> str:
    return "```sh\n" + "\n".join(lines) + "\n```\n"


def test_a_second_train_into_the_quickstart_run_is_caught():
    chain = "finetune train examples/yaml/quickstart.yaml && finetune train examples/yaml/quickstart-dpo.yaml"
    results = problems_of(_sh("make quickstart", chain))
    assert results[0] == [] and results[2] == []
    assert len(results[1]) == 1 and "runs/quickstart was written by the command on line 2" in results[1][0]
    assert problems_of(_sh("make quickstart", "finetune train examples/yaml/quickstart.yaml --overwrite")) == [[], []]


def test_a_run_that_no_earlier_command_makes_is_caught():
    dpo_first = problems_of(_sh("finetune train examples/yaml/quickstart-dpo.yaml", "make quickstart"))
    assert "runs/quickstart/final: no earlier command" in " ".join(dpo_first[0]) and dpo_first[1] == []
    assert problems_of(_sh("make quickstart", "finetune train examples/yaml/quickstart-dpo.yaml")) == [[], []]
    other_input = "finetune train examples/yaml/quickstart-dpo.yaml datasets.0.path=nope.jsonl"
    assert "data file not found: nope.jsonl" in " ".join(problems_of(_sh("make quickstart", other_input))[1])
    assert "no earlier command" in " ".join(problems_of(_sh("finetune plot runs/quickstart --out c.png"))[0])


@pytest.mark.parametrize(("line", "expected"), [
    ("finetune train examples/yaml/quickstart.yaml --max-steps 3", "refuses the argument '--max-steps'"),
    ("finetune train examples/yaml/quickstart.yaml train.lrr=1e-3", "did you mean 'lr'"),
    ("finetune trian examples/yaml/quickstart.yaml", "finetune's parser refuses it"),
    ("finetune verify examples/yaml/no-such.yaml", "does not load"),
    ("finetune train examples/yaml/quickstart.yaml datasets.0.path=nope.jsonl", "data file not found"),
    ("make quickstrat", "make target 'quickstrat'"),
    ("make test NO_SUCH_VAR=1", "make variable NO_SUCH_VAR"),
    ("pip install 'finetune[nope]'", "no extra 'nope'"),
    ("python scripts/no_such_script.py", "no such file"),
    ("python benchmarks/overhead.py --no-such-flag", "defines no option --no-such-flag"),
    ("pytest tests/no_such_test.py", "no such file"),
    ("torchrun --nproc_per_node 2 -m finetune train examples/yaml/quickstart.yaml --nproc", "parser refuses"),
    (".venv/bin/finetune env", "executable '.venv/bin/finetune'"),
    ("OMP_NUM_THREADS=1 python -m finetune validate docs/no-such.yaml", "does not load"),
])
def test_a_command_that_would_fail_is_caught(line, expected):
    (problems,) = problems_of(_sh(line))
    assert expected in " ".join(problems), problems


def test_the_same_commands_written_right_pass():
    assert problems_of(_sh(
        "OMP_NUM_THREADS=1 finetune validate examples/yaml/quickstart.yaml train.lr=1e-4 data.packing=false \\",
        "    --allow-code  # a comment",
        "pip install 'finetune[tracking]' && python benchmarks/overhead.py --rounds 60",
        "python -m pytest -m slow tests/test_readme.py",
    )) == [[], [], [], []]


def test_an_unlabeled_fence_is_caught():
    assert fence_problems("```\nmake quickstart\n```\n```text\nout\n```\n") == [
        "line 1: fence labeled 'nothing'; label it one of ['bash', 'sh', 'text', 'yaml'] (sh: commands, text: "
        "printed output)"]
