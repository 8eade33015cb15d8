"""Hostile or odd inputs are refused with a clear message, quickly: YAML that expands without bound, numbers
that are not numbers (1e400 is infinity), seeds and names beyond what the libraries and file systems take, batch
geometry beyond reason (and a step larger than the epoch, a warning), `model.path` next to `model.init: random`,
`convert axolotl` reading a template file outside the config's folder or one that is not text, and `recipes add`
handing git an option.

Torch-free and fast, like tests/recipe/test_recipe.py (the step-plan tests import the data package inside the test); the
CLI-level cases (exit code 2, no traceback, nothing lost) are rows of tests/test_bad_inputs.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml
from conftest import QUICKSTART_YAML
from helpers import profile_events

from finetune.errors import UserError
from finetune.recipe import apply_override, load_recipe, loading, parse_yaml, validate
from finetune.recipe.loading import MAX_DEPTH, MAX_VALUES


def alias_bomb(levels: int = 9, key: str = "lol") -> str:
    """The billion laughs: each level a list of ten aliases of the level below; `levels` 9 stands for 10^9."""
    lines = [f"a0: &a0 [{', '.join([key] * 10)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


# --- YAML bounded while loading ------------------------------------------------------------------------------

def test_alias_bomb_is_refused_quickly(tmp_path):
    text = alias_bomb()
    assert len(text) < 1024  # 1 KB of text that stands for 10^9 values
    caught = []

    def load() -> None:
        with pytest.raises(UserError) as info:
            _load_text(text, tmp_path)
        caught.append(info)

    # Refused from the parsed nodes, never expanded: work counted in calls (helpers.profile_events), not seconds.
    assert profile_events(load) < 200_000
    info = caught[0]
    assert "recipe.yaml:6:5: YAML error: aliases (*name) expand this value to more than 1,000,000 values " \
           "(an alias bomb?)" in str(info.value)


def test_alias_bomb_in_an_override_value_is_refused():
    flow = "[" + ", ".join(line.partition(": ")[2] for line in alias_bomb().splitlines()) + "]"
    raw: dict = {}
    with pytest.raises(UserError) as info:
        apply_override(raw, f"model.config.x={flow}")
    assert str(info.value).startswith("override 'model.config.x=[&a0 [lol, ")
    assert str(info.value).endswith("]': aliases (*name) expand this value to more than 1,000,000 values (an alias "
                                    "bomb?); a recipe needs a few hundred: write them out, or use fewer aliases")
    assert raw == {}


def test_aliases_within_bounds_still_load():
    # Anchors and merge keys are ordinary YAML: a recipe that reuses a section must keep loading.
    text = "base: &b {lr: 0.1, epochs: 2}\ntrain: {<<: *b, epochs: 3}\nlists: [*b, *b, *b]\n"
    assert parse_yaml(text) == {"base": {"lr": 0.1, "epochs": 2}, "train": {"lr": 0.1, "epochs": 3},
                                "lists": [{"lr": 0.1, "epochs": 2}] * 3}


def test_expansion_limit_is_exact():
    # 10 x 10 x 10 x 10 x 10 x 10 = 10^6 leaves plus the lists that hold them: just over the limit.
    assert MAX_VALUES == 1_000_000
    parse_yaml(alias_bomb(levels=5))  # 10^5 leaves: fine
    with pytest.raises(Exception, match="more than 1,000,000 values"):
        parse_yaml(alias_bomb(levels=6))


def test_alias_inside_its_own_anchor_is_refused(tmp_path):
    with pytest.raises(UserError) as info:
        _load_text("model:\n  config: &c {model_type: llama, again: *c}\n", tmp_path)
    assert "recipe.yaml:2:11: YAML error: an alias used inside its own anchor: a value that contains itself" \
        in str(info.value)


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    with pytest.raises(UserError) as info:
        _load_text("model: {config: {x: " + "[" * 100_000 + "]" * 100_000 + "}}\n", tmp_path)
    assert f"YAML error: nested more than {MAX_DEPTH} levels deep; a recipe needs a few" in str(info.value)
    parse_yaml("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))  # just within: loads


def test_huge_written_out_document_is_stopped_while_composing(monkeypatch):
    # The limit itself (10^6) takes PyYAML ~20 s to compose: shown on a lower limit (our own constant).
    monkeypatch.setattr(loading, "MAX_VALUES", 1000)
    parse_yaml("[" + "1," * 998 + "1]")  # 999 values and the list: exactly the limit
    with pytest.raises(Exception, match="more than 1,000 values in one document; a recipe needs a few hundred"):
        parse_yaml("[" + "1," * 999 + "1]")


def _load_text(text: str, tmp: Path) -> None:
    file = tmp / "recipe.yaml"
    file.write_text(text)
    load_recipe(file)


# --- numbers, seeds, names and batch geometry ----------------------------------------------------------------

def base() -> dict:
    return {"model": {"init": "random", "config": {"model_type": "llama", "hidden_size": 32}},
            "tokenizer": {"path": "some/tokenizer"}, "datasets": [{"path": "train.jsonl"}]}


def problems_of(**sections) -> list[str]:
    """The problem lines validate() reports for base() with `sections` merged in (a section's keys one by one)."""
    raw = base()
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) else value
    with pytest.raises(UserError) as info:
        validate(raw, source="r.yaml")
    return [line.strip()[2:] for line in str(info.value).splitlines()[1:]]


def test_lr_1e400_is_infinity_and_an_error(tmp_path):
    file = tmp_path / "recipe.yaml"
    file.write_text(f"extends: {QUICKSTART_YAML}\ntrain:\n  lr: 1e400\n")
    with pytest.raises(UserError) as info:
        load_recipe(file)
    assert str(info.value) == (f"{file}: 1 problem in the recipe:\n  - train.lr: got inf; must be a finite number "
                               "(YAML reads a number beyond 1.8e308, such as 1e400, as infinity)")


@pytest.mark.parametrize(("lr", "kind"), [(1e39, "infinite"), (3.5e38, "infinite"), (1e-46, "zero")])
def test_lr_outside_float32_is_an_error(lr, kind):
    assert problems_of(train={"lr": lr}) == [
        f"train.lr: got {lr!r}, which is {kind} as a float32 (the precision the update is computed in); use one "
        "float32 holds (1.4e-45 to 3.4e38), e.g. 2e-4"]


@pytest.mark.parametrize("lr", [3.4e38, 1e-44, 2e-4, 10.0])
def test_lr_within_float32_validates(lr):
    assert validate({**base(), "train": {"lr": lr}}).train.lr == lr


@pytest.mark.parametrize(("section", "values", "line"), [
    ("train", {"adam_betas": [float("nan"), 0.99]}, "train.adam_betas.0: got nan; must be a finite number"),
    ("train", {"weight_decay": float("inf")}, "train.weight_decay: got inf; must be a finite number (YAML reads a "
                                              "number beyond 1.8e308, such as 1e400, as infinity)"),
    ("train", {"max_grad_norm": float("inf")}, "train.max_grad_norm: got inf; must be a finite number (YAML reads a "
                                               "number beyond 1.8e308, such as 1e400, as infinity)"),
    ("eval", {"every_epochs": float("nan")}, "eval.every_epochs: got nan; must be a finite number"),
    ("loss", {"z_loss": float("-inf")}, "loss.z_loss: got -inf; must be a finite number (YAML reads a number "
                                        "beyond 1.8e308, such as 1e400, as infinity)"),
])
def test_any_float_key_must_be_finite(section, values, line):
    assert problems_of(**{section: values}) == [line]


def test_a_quoted_1e400_is_named_as_written():
    assert problems_of(train={"lr": "1e400"}) == [
        'train.lr: got "1e400"; must be a finite number (YAML reads a number beyond 1.8e308, such as 1e400, as '
        'infinity)']


@pytest.mark.parametrize(("seed", "line"), [
    (99999999999999999999, "seed: got 99999999999999999999; input should be less than or equal to 4294967295"),
    (2**32, "seed: got 4294967296; input should be less than or equal to 4294967295"),
    (-1, "seed: got -1; input should be greater than or equal to 0"),
])
def test_seed_outside_what_numpy_takes_is_an_error(seed, line):
    assert problems_of(seed=seed) == [line]


def test_seed_at_the_bounds_validates():
    assert validate({**base(), "seed": 2**32 - 1}).seed == 2**32 - 1
    assert validate({**base(), "seed": 0}).seed == 0


def test_output_dir_name_longer_than_255_bytes_is_an_error():
    assert problems_of(output_dir="runs/" + "x" * 313 + "/sub") == [
        "output_dir: a folder name of 313 bytes (xxxxxxxxxxxxxxxxxxxx...); file systems take at most 255 bytes per "
        "name: use a shorter one"]
    # Bytes, not characters: 128 two-byte letters are 256 bytes.
    assert problems_of(output_dir="é" * 128) == [
        "output_dir: a folder name of 256 bytes (éééééééééééééééééééé...); file systems take at most 255 bytes per "
        "name: use a shorter one"]
    assert validate({**base(), "output_dir": "runs/" + "x" * 255}).output_dir == "runs/" + "x" * 255


@pytest.mark.parametrize(("section", "key"), [("train", "gradient_accumulation_steps"),
                                              ("train", "micro_batch_size"), ("eval", "micro_batch_size")])
def test_batch_geometry_is_bounded(section, key):
    assert problems_of(**{section: {key: 1e9}}) == [
        f"{section}.{key}: got 1000000000.0; input should be less than or equal to 65536"]
    assert getattr(getattr(validate({**base(), section: {key: 65536}}), section), key) == 65536


# --- model.path with model.init: random ------------------------------------------------------------------------

PATH_WITH_RANDOM = ("model.path: set, but model.init is random, which ignores it (random weights from model.config; "
                    "init: random may come from a recipe this one extends, such as the quickstart); to train the "
                    "model at model.path, set model.init: pretrained")


def test_model_path_with_init_random_is_an_error():
    assert problems_of(model={"path": "my/model"}) == [PATH_WITH_RANDOM]
    assert problems_of(model={"path": "my/model", "config": None}) == [PATH_WITH_RANDOM]


def test_model_path_in_a_recipe_extending_the_quickstart(tmp_path):
    file = tmp_path / "recipe.yaml"
    file.write_text(f"extends: {QUICKSTART_YAML}\nmodel:\n  path: my/model\n")
    with pytest.raises(UserError) as info:
        load_recipe(file)
    assert str(info.value) == f"{file}: 1 problem in the recipe:\n  - {PATH_WITH_RANDOM}"
    # An override is the same recipe: model.path=/nonexistent no longer validates with the quickstart's init.
    with pytest.raises(UserError, match="model.path: set, but model.init is random"):
        load_recipe(QUICKSTART_YAML, ["model.path=/nonexistent"])
    # The fix the message names works (the quickstart's model.config is then unused, as for any pretrained model).
    fixed = load_recipe(file, ["model.init=pretrained"])
    assert (fixed.model.init, fixed.model.path) == ("pretrained", "my/model")


# --- a step larger than the epoch: a warning at start ----------------------------------------------------------

def _plan_warning(rows: int, world_size: int = 1, drop_last: bool = False, **train) -> str | None:
    from finetune.data import StepPlan  # the data package (not torch-free): imported by these tests only
    from finetune.train.plan import step_larger_than_epoch

    recipe = validate({**base(), "data": {"packing": False, "drop_last": drop_last}, "train": train})
    samples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]} for _ in range(rows)]
    return step_larger_than_epoch(StepPlan(samples, recipe, world_size), world_size)


def test_a_step_larger_than_the_epoch_is_a_warning():
    assert _plan_warning(6, micro_batch_size=4, gradient_accumulation_steps=4) == (
        "warning: one optimizer step takes 16 rows (train.micro_batch_size 4 x gradient_accumulation_steps 4) but "
        "an epoch has only 6 rows: each epoch is one step of 6 rows. gradient_accumulation_steps 1 or less fills "
        "every step")
    assert _plan_warning(30, world_size=2, micro_batch_size=2, gradient_accumulation_steps=10) == (
        "warning: one optimizer step takes 40 rows (train.micro_batch_size 2 x gradient_accumulation_steps 10 x 2 "
        "processes) but an epoch has only 30 rows: each epoch is one step of 30 rows. gradient_accumulation_steps 7 "
        "or less fills every step")


def test_a_step_that_fits_the_epoch_is_no_warning():
    assert _plan_warning(16, micro_batch_size=4, gradient_accumulation_steps=4) is None
    assert _plan_warning(17, micro_batch_size=4, gradient_accumulation_steps=4) is None  # a short last step is fine
    with pytest.raises(UserError, match="one optimizer step needs 16 rows but an epoch has only 6"):
        _plan_warning(6, drop_last=True, micro_batch_size=4, gradient_accumulation_steps=4)  # an error, as before


# --- convert axolotl: chat_template_jinja read only inside the config's folder, only as text ---------------------

JINJA_CONFIG = ("base_model: org/model\nchat_template: jinja\nchat_template_jinja: {}\n"
                "datasets:\n  - {{path: data.jsonl, type: chat_template}}\n")
OUTSIDE = ("a file outside the config's folder ({}); its text would be copied into the recipe, so only files inside "
           "that folder are read. Copy the template next to the config, or pass --allow-template-path")


def _convert_error(config: Path, *flags: str, capsys) -> str:
    """`finetune convert axolotl CONFIG -o recipe.yaml FLAGS` through the CLI: exit 2, no recipe written, stderr."""
    from finetune.cli import main

    out = config.parent / "recipe.yaml"
    assert main(["convert", "axolotl", str(config), "-o", str(out), *flags]) == 2
    assert not out.exists()
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    return captured.err


def test_template_file_inside_the_config_folder_is_read(tmp_path):
    from finetune.convert import convert_axolotl

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "mine.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "config.yml").write_text(JINJA_CONFIG.format("templates/mine.jinja"))
    recipe = yaml.safe_load(convert_axolotl(tmp_path / "config.yml").text)
    assert recipe["tokenizer"]["chat_template"] == "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_proc_self_environ_is_never_copied_into_a_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("I22_SECRET", "hunter2")
    config = tmp_path / "config.yml"
    config.write_text(JINJA_CONFIG.format("/proc/self/environ"))
    err = _convert_error(config, capsys=capsys)
    assert err == (f"error: {config}: 1 problem converting the Axolotl config:\n"
                   f"  - chat_template_jinja: /proc/self/environ: {OUTSIDE.format(tmp_path)}\n")
    # Allowed outside, it is still no text: NUL-separated.
    err = _convert_error(config, "--allow-template-path", capsys=capsys)
    assert "  - chat_template_jinja: /proc/self/environ: NUL bytes (the first at byte " in err
    assert err.endswith("): a binary file; chat_template_jinja takes Jinja text or a template file\n")
    assert "hunter2" not in err


def test_a_link_out_of_the_folder_and_a_dotdot_path_are_outside(tmp_path, capsys):
    (tmp_path / "outside.jinja").write_text("{{ messages }}")
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "link.jinja").symlink_to(tmp_path / "outside.jinja")
    for name in ("link.jinja", "../outside.jinja", str(tmp_path / "outside.jinja")):
        (folder / "config.yml").write_text(JINJA_CONFIG.format(name))
        assert f"  - chat_template_jinja: {name}: {OUTSIDE.format(folder)}\n" in \
            _convert_error(folder / "config.yml", capsys=capsys)


def test_allow_template_path_reads_a_text_file_anywhere(tmp_path):
    from finetune.convert import convert_axolotl

    (tmp_path / "outside.jinja").write_text("{{ messages }}")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.yml").write_text(JINJA_CONFIG.format("../outside.jinja"))
    converted = convert_axolotl(tmp_path / "cfg" / "config.yml", allow_template_path=True)
    assert yaml.safe_load(converted.text)["tokenizer"]["chat_template"] == "{{ messages }}"


def test_a_binary_template_file_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "bin.jinja").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\xff\xfe")
    config = tmp_path / "config.yml"
    config.write_text(JINJA_CONFIG.format("bin.jinja"))
    assert _convert_error(config, capsys=capsys) == (
        f"error: {config}: 1 problem converting the Axolotl config:\n  - chat_template_jinja: bin.jinja "
        f"({tmp_path / 'bin.jinja'}): not UTF-8 text (byte 9 is 0xff): a binary file; chat_template_jinja takes "
        "Jinja text or a template file\n")
    (tmp_path / "bin.jinja").write_bytes(b"{{ messages }}\x00")  # UTF-8, with a NUL
    assert "NUL bytes (the first at byte 14): a binary file" in _convert_error(config, capsys=capsys)


def test_missing_template_file_and_a_folder_are_named(tmp_path, capsys):
    config = tmp_path / "config.yml"
    config.write_text(JINJA_CONFIG.format("nope.jinja"))
    assert f"  - chat_template_jinja: nope.jinja ({tmp_path / 'nope.jinja'}): no such file; " in \
        _convert_error(config, capsys=capsys)
    (tmp_path / "dir.jinja").mkdir()
    config.write_text(JINJA_CONFIG.format("dir.jinja"))
    assert f"  - chat_template_jinja: dir.jinja ({tmp_path / 'dir.jinja'}): not a regular file; " in \
        _convert_error(config, capsys=capsys)


def test_deepspeed_file_is_read_only_as_a_small_regular_file(tmp_path):
    from finetune.convert import convert_axolotl
    from finetune.convert.reading import read_side_file

    config = tmp_path / "config.yml"
    config.write_text("base_model: org/model\ndeepspeed: ds.json\ndatasets:\n  - {path: data.jsonl, type: alpaca}\n")
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    converted = convert_axolotl(config, allow_approx=True)
    assert yaml.safe_load(converted.text)["distributed"]["strategy"] == "fsdp"
    # A device or a pipe is no config file (/dev/zero would be read forever): not read, so the stage is unknown.
    (tmp_path / "ds.json").unlink()
    os.mkfifo(tmp_path / "ds.json")
    writer = threading.Thread(target=(tmp_path / "ds.json").write_text, args=('{"zero_optimization": {"stage": 3}}',),
                              daemon=True)
    writer.start()  # blocks until a reader opens the pipe: the old code did, and got stage 3
    with pytest.raises(UserError, match="deepspeed: 'ds.json': cannot tell the ZeRO stage"):
        convert_axolotl(config, allow_approx=True)
    reader = os.open(tmp_path / "ds.json", os.O_RDONLY | os.O_NONBLOCK)  # lets the writer finish
    writer.join(10)
    os.close(reader)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (1 << 20) + b"{}")
    with pytest.raises(ValueError, match="larger than 1 MB"):
        read_side_file(big)


# --- recipes add: nothing the user typed reaches git as an option ------------------------------------------------

@pytest.fixture
def fake_git(tmp_path, monkeypatch) -> Path:
    """A `git` first on PATH that records its arguments (one line each, a blank line after a call) and fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "git.log"
    script = bin_dir / "git"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {log}\necho >> {log}\necho "fatal: fake git" >&2\nexit 128\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FINETUNE_HOME", str(tmp_path / "home"))
    return log


def _git_calls(log: Path) -> list[list[str]]:
    return [call.splitlines() for call in log.read_text().split("\n\n") if call] if log.exists() else []


@pytest.mark.parametrize("url", ["--upload-pack=touch /tmp/pwned;://x", "-c", "--config=core.sshCommand=sh"])
def test_recipes_add_refuses_a_url_starting_with_a_dash(url, fake_git, capsys):
    from finetune.cli import main

    assert main(["recipes", "add", "team", "--", url]) == 2
    assert capsys.readouterr().err == (
        f"error: URL_OR_DIR {url!r} starts with '-', which git would read as an option; give a git URL (https://..., "
        "file://..., git@host:...) or a folder (./-name for a folder whose name starts with '-')\n")
    assert _git_calls(fake_git) == []  # git never ran


def test_recipes_add_and_update_refuse_a_ref_starting_with_a_dash(fake_git, capsys):
    from finetune.cli import main

    assert main(["recipes", "add", "team", "https://example.invalid/recipes.git", "--ref=--output=x"]) == 2
    assert capsys.readouterr().err == ("error: --ref '--output=x' starts with '-', which git would read as an "
                                       "option; give a branch, tag or commit\n")
    assert main(["recipes", "update", "team", "--ref=-x"]) == 2
    assert capsys.readouterr().err == ("error: --ref '-x' starts with '-', which git would read as an option; give a "
                                       "branch, tag or commit\n")
    assert _git_calls(fake_git) == []


def test_recipes_add_passes_the_url_after_double_dash(fake_git, capsys):
    from finetune.cli import main

    assert main(["recipes", "add", "team", "https://example.invalid/recipes.git"]) == 2
    assert capsys.readouterr().err == "error: git clone failed: fatal: fake git\n"
    [call] = _git_calls(fake_git)
    assert call[:4] == ["clone", "--quiet", "--", "https://example.invalid/recipes.git"]
    assert Path(call[4]).parent == fake_git.parent / "home" / "recipes" and len(call) == 5
    assert list((fake_git.parent / "home" / "recipes").iterdir()) == []  # the failed clone left nothing
