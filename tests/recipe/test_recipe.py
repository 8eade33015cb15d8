"""The recipe: schema errors and their messages, `extends:`, overrides, path resolution, hashing, `validate`.

Fast and torch-free: everything here goes through `finetune.recipe` (and the CLI for `validate`). Each error
test asserts the part of the message a user needs: the dotted key, what was given, what is allowed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from finetune.errors import UserError
from finetune.recipe import (
    Recipe,
    apply_override,
    load_raw,
    load_recipe,
    parse_yaml,
    recipe_hash,
    to_yaml,
    validate,
)

EXAMPLE_RECIPES = sorted([*(REPO_ROOT / "examples" / "yaml").glob("*.yaml"),
                          *(REPO_ROOT / "examples" / "yaml").glob("*.yml")])


def base() -> dict:
    """A minimal valid raw recipe (validate does not require its paths to exist)."""
    return {
        "model": {"init": "random", "config": {"model_type": "llama", "hidden_size": 32}},
        "tokenizer": {"path": "some/tokenizer"},
        "datasets": [{"path": "train.jsonl", "format": "chat"}],
    }


def error_of(raw: dict) -> str:
    with pytest.raises(UserError) as info:
        validate(raw, source="r.yaml")
    return str(info.value)


def with_(**sections) -> dict:
    raw = base()
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) else value
    return raw


# --- schema errors ---------------------------------------------------------------------------------------

def test_valid_base_recipe_has_defaults():
    recipe = validate(base())
    assert isinstance(recipe, Recipe)
    assert recipe.train.micro_batch_size == 4 and recipe.data.packing is True and recipe.resume is None


def test_unknown_top_level_key_suggests_the_close_one():
    raw = base()
    raw["trian"] = {"lr": 1e-3}
    msg = error_of(raw)
    assert "r.yaml: 1 problem in the recipe:" in msg
    assert "trian: unknown key; did you mean 'train'?" in msg


def test_unknown_nested_key_suggests_the_close_one():
    msg = error_of(with_(train={"lrr": 1e-3}))
    assert "train.lrr: unknown key; did you mean 'lr'?" in msg


def test_unknown_key_in_a_datasets_entry():
    raw = base()
    raw["datasets"] = [{"path": "a.jsonl"}, {"path": "b.jsonl", "fromat": "chat"}]
    assert "datasets.1.fromat: unknown key; did you mean 'format'?" in error_of(raw)


def test_unknown_key_without_a_close_match_lists_the_known_keys():
    msg = error_of(with_(loss={"zzzz": 1}))
    assert "loss.zzzz: unknown key; known keys here: impl, chunk_size, z_loss, softcap" in msg


def test_wrong_type_names_key_and_value():
    msg = error_of(with_(train={"micro_batch_size": "four"}))
    assert 'train.micro_batch_size: got "four"; input should be a valid integer' in msg


def test_fraction_for_an_integer_is_refused():
    msg = error_of(with_(train={"gradient_accumulation_steps": 2.5}))
    assert "train.gradient_accumulation_steps: got 2.5; input should be a valid integer" in msg


def test_bad_literal_lists_what_is_allowed():
    msg = error_of(with_(train={"lr_scheduler": "cosin"}))
    assert "train.lr_scheduler: got \"cosin\"; allowed: 'cosine', 'linear' or 'constant'" in msg
    msg = error_of(with_(model={"dtype": "fp8"}))
    assert "model.dtype: got \"fp8\"; allowed: 'float32', 'bfloat16' or 'float16'" in msg


def test_a_union_fails_on_one_line():
    msg = error_of(with_(adapter={"target_modules": 5}))
    assert msg.count("adapter.target_modules") == 1
    assert "adapter.target_modules: got 5; allowed: 'all-linear'; or input should be a valid list" in msg


def test_negative_learning_rate():
    assert "train.lr: got -0.001; input should be greater than 0" in error_of(with_(train={"lr": -1e-3}))


def test_missing_required_key_in_a_datasets_entry():
    raw = base()
    raw["datasets"] = [{"format": "chat"}]
    assert "datasets.0.path: required, but missing" in error_of(raw)


def test_empty_dataset_path_is_refused():
    raw = base()
    raw["datasets"] = [{"path": ""}]
    assert 'datasets.0.path: got ""; string should have at least 1 character' in error_of(raw)


def test_several_errors_are_collected_in_one_message():
    raw = with_(train={"lrr": 1, "lr_scheduler": "cosin"}, data={"packing": "maybe"})
    msg = error_of(raw)
    assert "r.yaml: 3 problems in the recipe:" in msg
    lines = [line for line in msg.splitlines() if line.startswith("  - ")]
    assert len(lines) == 3
    assert any(line.startswith("  - train.lrr:") for line in lines)
    assert any(line.startswith("  - train.lr_scheduler:") for line in lines)
    assert any(line.startswith("  - data.packing:") for line in lines)


# --- cross-field checks ----------------------------------------------------------------------------------

def test_an_objective_gets_the_default_it_can_use_and_only_a_written_value_is_refused():
    """GRPO trains one completion per row: data.packing defaults to false for it; written true, it is refused."""
    grpo = {"datasets": [{"path": "p.jsonl", "format": "prompt"}], "train": {"objective": "grpo"},
            "grpo": {"rewards": [{"function": "exact_answer"}]}}
    recipe = validate({**base(), **grpo})
    assert recipe.data.packing is False and validate(base()).data.packing is True
    msg = error_of({**base(), **grpo, "data": {"packing": True}})
    assert "data.packing: true is written in the recipe (or one it extends), and GRPO trains one completion per " \
           "row; set data.packing: false (or leave it out: false is GRPO's default)" in msg


@pytest.mark.parametrize("where", ["/", "~", "~/", "~/../{home_name}"])
def test_output_dir_is_neither_the_root_nor_the_home_folder(where):
    home = Path.home().resolve()
    output_dir = where.format(home_name=home.name)
    msg = error_of(with_(output_dir=output_dir))
    what = "the file system's root" if where == "/" else "your home folder"
    assert f"output_dir: {output_dir} is {what} ({'/' if where == '/' else home}); a run writes recipe.yaml" in msg
    validate(with_(output_dir=str(home / "runs" / "x")))  # a folder inside it is fine


def test_an_override_with_bytes_that_are_not_utf8_says_so_not_to_quote_it():
    import os

    raw = base()
    item = os.fsdecode(b"output_dir=/tmp/\xff")
    with pytest.raises(UserError) as info:
        apply_override(raw, item)
    assert str(info.value) == ("override 'output_dir=/tmp/\\xff': it holds bytes that are not UTF-8 text; recipe "
                               "values are UTF-8 (YAML), so quoting cannot help: give a path or value that is UTF-8 "
                               "(rename the file, or link to it from a UTF-8 name)")


def test_packing_needs_max_seq_len():
    msg = error_of(with_(data={"packing": True, "max_seq_len": None}))
    assert "data.max_seq_len: packing needs a row length" in msg
    validate(with_(data={"packing": False, "max_seq_len": None}))  # fine without packing


def test_epochs_and_max_steps_both_null():
    msg = error_of(with_(train={"epochs": None, "max_steps": None}))
    assert "train.epochs / train.max_steps: both are null; set at least one" in msg


def test_pretrained_needs_a_path():
    msg = error_of(with_(model={"init": "pretrained", "config": None}))
    assert "model.path: required for init: pretrained" in msg


def test_no_datasets():
    raw = base()
    raw["datasets"] = []
    assert "datasets: at least one training dataset is required" in error_of(raw)


def test_missing_inputs_are_reported_when_asked(tmp_path):
    # Every CLI command asks (check_inputs=True); a finished run's stored recipe is read without it.
    (tmp_path / "there.jsonl").write_text("{}\n")
    raw = with_(resume=str(tmp_path / "nope"))
    raw["datasets"] = [{"path": str(tmp_path / "there.jsonl")}, {"path": "gone.jsonl"}, {"path": "org/hub-set"}]
    with pytest.raises(UserError) as info:
        validate(raw, check_inputs=True)
    msg = str(info.value)
    assert f"resume: checkpoint '{tmp_path / 'nope'}' does not exist" in msg
    assert "datasets.1.path: data file not found: gone.jsonl" in msg
    assert "datasets.0" not in msg and "datasets.2" not in msg  # present, and a hub name
    assert validate(raw).resume == str(tmp_path / "nope")


def test_cross_field_problems_are_collected_together():
    raw = with_(model={"init": "pretrained"}, data={"max_seq_len": None}, train={"epochs": None})
    raw["datasets"] = []
    msg = error_of(raw)
    assert "r.yaml: 4 problems in the recipe:" in msg


# --- files: YAML errors, missing files, extends ----------------------------------------------------------

def test_yaml_syntax_error_names_file_and_line(write_recipe):
    path = write_recipe("train:\n  lr: 1\n lr2: [\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert str(info.value).startswith(f"{path}:3:2: YAML syntax error:")


def test_tab_indentation_gets_a_hint(write_recipe):
    path = write_recipe("train:\n\tlr: 1\n")
    with pytest.raises(UserError, match="indent with spaces, not tabs") as info:
        load_recipe(path)
    assert str(info.value).startswith(f"{path}:2:1:")


def test_duplicate_key_is_an_error_naming_both_lines(write_recipe):
    path = write_recipe("train:\n  lr: 1.0\nseed: 1\ntrain:\n  epochs: 2\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert str(info.value) == f"{path}:4:1: YAML error: duplicate key 'train' (first written on line 1); keep only one"


def test_yaml_anchors_and_merge_keys_still_work():
    assert parse_yaml("a: &x {p: 1, q: 2}\nb:\n  <<: *x\n  p: 3\n") == {"a": {"p": 1, "q": 2}, "b": {"p": 3, "q": 2}}


def test_exponent_floats_are_numbers_everywhere():
    # PyYAML (YAML 1.1) reads 1e-4 as a string; free-form keys like model.config would then get strings.
    assert parse_yaml("{a: 1e-4, b: 3.0e-3, c: -2E5, d: '1e-4', e: 1e, f: 10}") == \
        {"a": 1e-4, "b": 3e-3, "c": -2e5, "d": "1e-4", "e": "1e", "f": 10}


def test_a_recipe_must_be_a_mapping(write_recipe):
    path = write_recipe("- a\n- b\n")
    with pytest.raises(UserError, match="a recipe must be a mapping of keys, got list"):
        load_recipe(path)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(UserError) as info:
        load_recipe(tmp_path / "nope.yaml")
    assert str(info.value) == f"recipe file not found: {tmp_path / 'nope.yaml'}"


def test_missing_parent_recipe_names_the_extending_file(write_recipe):
    child = write_recipe({"extends": "gone.yaml"})
    with pytest.raises(UserError) as info:
        load_recipe(child)
    assert f"recipe file not found: {child.parent / 'gone.yaml'} (extended from {child})" == str(info.value)


def test_extends_cycle(write_recipe):
    a = write_recipe({"extends": "b.yaml", "seed": 1}, "a.yaml")
    b = write_recipe({"extends": "a.yaml", "seed": 2}, "b.yaml")
    with pytest.raises(UserError) as info:
        load_recipe(a)
    assert f"extends cycle: {a} -> {b} -> {a}" in str(info.value)


def test_extends_itself(write_recipe):
    a = write_recipe({"extends": "a.yaml"}, "a.yaml")
    with pytest.raises(UserError, match="extends cycle") as info:
        load_recipe(a)
    assert f"{a} -> {a}" in str(info.value)


def test_extends_must_be_paths(write_recipe):
    path = write_recipe({"extends": {"a": 1}})
    with pytest.raises(UserError, match="`extends` must be a path or a list of paths"):
        load_recipe(path)


def test_extends_str_relative_to_the_extending_file_deep_merge_lists_replaced(write_recipe):
    write_recipe({**base(), "train": {"lr": 0.5, "epochs": 3},
                  "datasets": [{"path": "a.jsonl"}, {"path": "b.jsonl"}]}, "parents/base.yaml")
    child = write_recipe({"extends": "parents/base.yaml", "train": {"lr": 0.1},
                          "datasets": [{"path": "c.jsonl"}]}, "child.yaml")
    recipe = load_recipe(child)
    assert recipe.train.lr == 0.1 and recipe.train.epochs == 3  # nested mappings merge key by key
    assert [d.path for d in recipe.datasets] == ["c.jsonl"]  # lists are replaced, not concatenated
    assert recipe.model.config == {"model_type": "llama", "hidden_size": 32}


def test_extends_list_later_wins_and_the_file_itself_wins_last(write_recipe):
    write_recipe({**base(), "seed": 1, "train": {"lr": 0.1, "epochs": 2}}, "one.yaml")
    write_recipe({"seed": 2, "train": {"lr": 0.2}}, "two.yaml")
    child = write_recipe({"extends": ["one.yaml", "two.yaml"], "train": {"epochs": 5}}, "child.yaml")
    recipe = load_recipe(child)
    assert recipe.seed == 2 and recipe.train.lr == 0.2 and recipe.train.epochs == 5


def test_nested_extends_resolve_relative_to_each_file(write_recipe):
    write_recipe({**base(), "seed": 7}, "deep/grand.yaml")
    write_recipe({"extends": "grand.yaml", "train": {"lr": 0.3}}, "deep/parent.yaml")
    child = write_recipe({"extends": "deep/parent.yaml"}, "child.yaml")
    recipe = load_recipe(child)
    assert recipe.seed == 7 and recipe.train.lr == 0.3


def test_diamond_extends_is_not_a_cycle(write_recipe):
    write_recipe(base(), "root.yaml")
    write_recipe({"extends": "root.yaml", "seed": 1}, "left.yaml")
    write_recipe({"extends": "root.yaml", "seed": 2}, "right.yaml")
    assert load_recipe(write_recipe({"extends": ["left.yaml", "right.yaml"]}, "child.yaml")).seed == 2


# --- overrides -------------------------------------------------------------------------------------------

def test_overrides_parse_values_as_yaml(write_recipe):
    path = write_recipe(base())
    recipe = load_recipe(path, ["train.lr=1e-4", "data.packing=false", "model.config.hidden_size=64",
                                "datasets.0.path=/data/other.jsonl", "resume=null", "eval.every_steps=5"])
    assert recipe.train.lr == 1e-4 and isinstance(recipe.train.lr, float)
    assert recipe.data.packing is False
    assert recipe.model.config["hidden_size"] == 64
    assert recipe.datasets[0].path == "/data/other.jsonl"
    assert recipe.resume is None and recipe.eval.every_steps == 5


def test_override_values_in_free_form_sections_keep_their_types():
    raw = base()
    apply_override(raw, "model.config.rms_norm_eps=1e-5")
    assert raw["model"]["config"]["rms_norm_eps"] == 1e-5


def test_override_creates_a_missing_section():
    raw = base()
    apply_override(raw, "loss.impl=torch")
    assert validate(raw).loss.impl == "torch"


def test_override_of_an_unknown_key_is_caught_by_the_schema(write_recipe):
    with pytest.raises(UserError, match="train.lrr: unknown key; did you mean 'lr'"):
        load_recipe(write_recipe(base()), ["train.lrr=1"])


@pytest.mark.parametrize(("item", "expected"), [
    ("train.lr", "override 'train.lr': expected key.path=value, e.g. train.lr=1e-4"),
    ("=3", "override '=3': expected key.path=value"),
    ("train..lr=3", "override 'train..lr=3': 'train..lr' has an empty part"),
    ("train.lr=[1, 2", "override 'train.lr=[1, 2': the value is not valid YAML"),
    ("datasets.3.path=x.jsonl", "override 'datasets.3.path=x.jsonl': datasets.3 needs an index 0..0"),
    ("datasets.x.path=x.jsonl", "override 'datasets.x.path=x.jsonl': datasets.x needs an index 0..0"),
    ("eval_datasets.0.path=x", "override 'eval_datasets.0.path=x': eval_datasets.0 indexes an empty list"),
    ("seed.x=1", "override 'seed.x=1': seed is a value (0), not a section"),
    ("model.init.x.y=1", "override 'model.init.x.y=1': model.init is a value ('random'), not a section"),
])
def test_bad_overrides(item, expected):
    raw = {**base(), "seed": 0, "eval_datasets": []}
    with pytest.raises(UserError) as info:
        apply_override(raw, item)
    assert expected in str(info.value)


# --- path resolution -------------------------------------------------------------------------------------

def test_relative_paths_resolve_against_the_recipe_folder_when_they_exist(tmp_path, write_recipe):
    (tmp_path / "sub" / "data").mkdir(parents=True)
    (tmp_path / "sub" / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "sub" / "tok").mkdir()
    raw = base()
    raw["tokenizer"] = {"path": "tok"}
    raw["model"] = {"path": "Org/some-model"}  # a hub id: does not exist locally, left as written
    raw["datasets"] = [{"path": "data/train.jsonl"}, {"path": "data/missing.jsonl"}, {"path": "org/dataset"}]
    raw["eval_datasets"] = [{"path": "data/train.jsonl"}]
    recipe = load_recipe(write_recipe(raw, "sub/recipe.yaml"))
    assert recipe.tokenizer.path == str(tmp_path / "sub" / "tok")
    assert recipe.model.path == "Org/some-model"
    assert [d.path for d in recipe.datasets] == [str(tmp_path / "sub" / "data" / "train.jsonl"),
                                                 "data/missing.jsonl", "org/dataset"]
    assert recipe.eval_datasets[0].path == str(tmp_path / "sub" / "data" / "train.jsonl")


def test_paths_in_a_parent_resolve_against_the_parent_folder(tmp_path, write_recipe):
    (tmp_path / "parents").mkdir()
    (tmp_path / "parents" / "train.jsonl").write_text("{}\n")
    write_recipe({**base(), "datasets": [{"path": "train.jsonl"}]}, "parents/base.yaml")
    recipe = load_recipe(write_recipe({"extends": "parents/base.yaml"}, "child.yaml"))
    assert recipe.datasets[0].path == str(tmp_path / "parents" / "train.jsonl")


# --- output: to_yaml and recipe_hash --------------------------------------------------------------------

def test_to_yaml_round_trips_through_validate(write_recipe):
    raw = with_(train={"lr": 3e-4, "adam_betas": [0.9, 0.95]}, adapter={"type": "lora", "target_modules": ["q_proj"]})
    recipe = load_recipe(write_recipe(raw))
    again = validate(yaml.safe_load(to_yaml(recipe)))
    assert again == recipe
    assert to_yaml(again) == to_yaml(recipe)


def test_quickstart_round_trips():
    recipe = load_recipe(REPO_ROOT / "examples" / "yaml" / "quickstart.yaml")
    assert validate(parse_yaml(to_yaml(recipe))) == recipe


@pytest.mark.parametrize("change", ["logging.every_steps=7", "eval.every_steps=3", "checkpoint.every_steps=2",
                                   "checkpoint.keep_last=5", "output_dir=elsewhere", "data.packing_check=false",
                                   "resume=auto"])
def test_recipe_hash_ignores_harmless_changes(write_recipe, change):
    path = write_recipe(base())
    assert recipe_hash(load_recipe(path)) == recipe_hash(load_recipe(path, [change]))


@pytest.mark.parametrize("change", ["train.lr=1e-3", "model.config.hidden_size=64", "datasets.0.path=other.jsonl",
                                   "seed=1", "data.max_seq_len=512", "train.micro_batch_size=2",
                                   "adapter.type=lora"])
def test_recipe_hash_changes_with_training_changes(write_recipe, change):
    path = write_recipe(base())
    assert recipe_hash(load_recipe(path)) != recipe_hash(load_recipe(path, [change]))


# --- every shipped recipe validates ----------------------------------------------------------------------

def test_the_examples_folder_has_recipes():
    assert REPO_ROOT / "examples" / "yaml" / "quickstart.yaml" in EXAMPLE_RECIPES


@pytest.mark.parametrize("path", EXAMPLE_RECIPES, ids=[p.name for p in EXAMPLE_RECIPES])
def test_example_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.datasets or recipe.grpo.replay  # a replay (GRPO) trains on its file's rollouts
    # docs/design.md: every example is headed by a comment saying what it does and the exact command.
    head = path.read_text(encoding="utf-8").splitlines()[0]
    assert head.startswith("#"), f"{path.name}: start with a comment saying what it does and how to run it"


# --- the CLI: `finetune validate` ------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


def test_validate_prints_the_resolved_recipe(write_recipe):
    path = write_recipe(base())
    (path.parent / "train.jsonl").write_text("{}\n")  # `finetune validate` checks that the data files exist
    result = run_cli("validate", str(path), "train.lr=1e-4")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed == yaml.safe_load(to_yaml(load_recipe(path, ["train.lr=1e-4"])))
    assert printed["train"]["lr"] == 1e-4 and printed["data"]["max_seq_len"] == 2048  # defaults filled in


def test_validate_bad_recipe_exits_2_without_traceback(write_recipe):
    path = write_recipe(with_(train={"lrr": 1}))
    result = run_cli("validate", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: 1 problem in the recipe:")
    assert "train.lrr: unknown key; did you mean 'lr'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_debug_shows_the_traceback(write_recipe):
    path = write_recipe(with_(train={"lrr": 1}))
    result = run_cli("validate", str(path), "--debug")
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "train.lrr: unknown key" in result.stderr


def test_validate_imports_no_torch():
    """What keeps `finetune validate` well under a second: neither torch nor transformers is imported (checked by
    module, not by the clock, which a busy machine moves)."""
    script = textwrap.dedent(f"""
        import json, sys, io, contextlib
        from finetune.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["validate", {str(REPO_ROOT / "examples" / "yaml" / "quickstart.yaml")!r}])
        print(json.dumps({{"rc": rc, "torch": "torch" in sys.modules,
                          "transformers": "transformers" in sys.modules}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["rc"] == 0
    assert not facts["torch"] and not facts["transformers"]


def test_load_raw_returns_the_merged_dict(write_recipe):
    write_recipe({"seed": 1, "train": {"lr": 0.1}}, "p.yaml")
    raw = load_raw(write_recipe({"extends": "p.yaml", "train": {"epochs": 2}}, "c.yaml"))
    assert raw == {"seed": 1, "train": {"lr": 0.1, "epochs": 2}}


def test_recipe_json_schema_builds():
    schema = Recipe.model_json_schema()
    assert "train" in schema["properties"]
