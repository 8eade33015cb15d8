"""Hints for a key in the wrong place (finetune/recipe/hints.py): a key of another section, another tool's name for
a key, a command-line option that is a recipe key; an override's problem names the command line; a local path that
does not exist is a recipe error naming it; `finetune env` suggests no CUDA-only package on a machine without CUDA."""

from __future__ import annotations

import pytest
from conftest import QUICKSTART_YAML

from finetune.cli import main
from finetune.errors import UserError
from finetune.recipe import Recipe, flatten, load_recipe
from finetune.recipe.hints import FOREIGN, key_for_option


def problems_of(*overrides: str) -> str:
    with pytest.raises(UserError) as info:
        load_recipe(QUICKSTART_YAML, list(overrides), check_inputs=True)
    return str(info.value)


def test_every_foreign_name_points_at_a_key_of_the_schema():
    keys = {k.split(".0")[0].split(".1")[0] for k in flatten(Recipe().model_dump(mode="json"))}
    assert {target for target, _ in FOREIGN.values()} <= keys


@pytest.mark.parametrize(("override", "hint"), [
    ("max_steps=3", "max_steps: unknown key; did you mean 'train.max_steps'? (max_steps is a key of another section)"),
    ("train.learning_rate=1e-4", "train.learning_rate: unknown key; did you mean 'train.lr'? (learning_rate is another "
                                 "tool's name for it)"),
    ("per_device_train_batch_size=8", "did you mean 'train.micro_batch_size'?"),
    ("data.micro_batch_size=2", "did you mean 'train.micro_batch_size' or 'eval.micro_batch_size'?"),
    ("beta=0.1", "did you mean 'dpo.beta' or 'orpo.beta' or 'distill.beta' or 'grpo.beta'?"),
    ("sequence_len=512", "did you mean 'data.max_seq_len'?"),
    ("train.lrr=1", "train.lrr: unknown key; did you mean 'lr'?"),  # a close sibling first
])
def test_a_key_in_the_wrong_place_gets_where_it_belongs(override, hint):
    message = problems_of(override)
    assert hint in message and f"(set on the command line: {override})" in message, message


def test_an_overrides_problem_names_the_command_line_and_a_files_does_not(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {QUICKSTART_YAML}\ntrain: {{lr: -1}}\n")
    with pytest.raises(UserError) as info:
        load_recipe(recipe, ["train.epochs=0"])
    lines = str(info.value).splitlines()
    assert lines[1] == "  - train.epochs: got 0; input should be greater than 0 (set on the command line: " \
                       "train.epochs=0)"
    assert lines[2] == "  - train.lr: got -1; input should be greater than 0"


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-steps", "3"], "error: unrecognized option --max-steps: recipe keys are set as key.path=value after the "
                           "recipe, e.g. finetune train RECIPE train.max_steps=3"),
    (["--learning_rate=1e-4"], "e.g. finetune train RECIPE train.lr=1e-4"),
    (["--bogus"], "error: unrecognized argument: --bogus (finetune train --help lists the options)"),
])
def test_an_option_that_is_a_recipe_key_says_how_to_set_it(capsys, argv, message):
    assert main(["train", str(QUICKSTART_YAML), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" not in err, err


def test_key_for_option_knows_dotted_keys_and_leaves_ambiguous_names_alone():
    assert key_for_option("--train.lr") == "train.lr" and key_for_option("--warmup-steps") == "train.warmup_steps"
    assert key_for_option("--beta") is None  # dpo's, orpo's or grpo's: no guess
    assert key_for_option("--nothing-like-it") is None


@pytest.mark.parametrize("path", ["~/models/SmolLM2-135M", "./no-model", "/no/such/model", "runs/x/final"])
def test_a_local_model_path_that_does_not_exist_is_a_recipe_error(path):
    message = problems_of("model.init=pretrained", f"model.path={path}")
    assert f"model.path: {path} does not exist (a local path: a relative one is looked up next to the recipe file, " \
           "then in the current directory" in message


def test_a_hub_id_is_left_to_the_hub():
    recipe = load_recipe(QUICKSTART_YAML, ["model.init=pretrained", "model.path=org/model"])
    assert recipe.model.path == "org/model"


def test_env_suggests_no_cuda_only_package_without_cuda(monkeypatch):
    from rich.console import Console

    from finetune import versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: None if p == "flash-attn" else real(p))
    monkeypatch.setattr(versions, "device_info", lambda: {"device": "cpu", "count": 0, "cuda_version": None,
                                                          "capability": None, "bf16": False})
    console = Console(record=True, width=300)
    console.print(versions.env_table())
    row = next(line for line in console.export_text().splitlines() if "flash-attn" in line)
    assert "needs a CUDA GPU" in row and "pip install" not in row
