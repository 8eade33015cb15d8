"""The recipe JSON Schema (`finetune schema`) and the generated reference (docs/recipe-reference.md).

Both come from the pydantic models in finetune/recipe.py: the schema must be exactly what pydantic builds
(plus `extends`), carry every key's docstring as its description, and accept every shipped example as an
editor would see it (before `extends:` is merged); the committed docs must be what the generator writes now.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any, get_args, get_origin

import pytest
import yaml
from conftest import REPO_ROOT
from pydantic import BaseModel

from finetune.cli import main
from finetune.recipe import Recipe


def section_models() -> dict[str, type[BaseModel]]:
    """Every schema class reachable from Recipe, by class name (the $defs keys)."""
    found: dict[str, type[BaseModel]] = {"Recipe": Recipe}
    todo = [Recipe]
    while todo:  # sections, and the sections inside them (grpo.rewards[])
        for field in todo.pop().model_fields.values():
            for candidate in (field.annotation, *get_args(field.annotation)):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel) and candidate.__name__ not in found:
                    found[candidate.__name__] = candidate
                    todo.append(candidate)
    return found


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_recipe_reference",
                                                  REPO_ROOT / "scripts" / "gen_recipe_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schema_command_writes_exactly_the_models_schema(tmp_path, capsys):
    out = tmp_path / "recipe.schema.json"
    assert main(["schema", "--out", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == Recipe.model_json_schema()
    assert main(["schema"]) == 0  # stdout
    assert json.loads(capsys.readouterr().out) == Recipe.model_json_schema()


def test_every_key_of_every_section_is_in_the_schema_with_its_docstring():
    schema = Recipe.model_json_schema()
    models = section_models()
    assert set(models) - {"Recipe"} == set(schema["$defs"]), "a section class is missing from $defs"
    for name, model in models.items():
        node = schema if model is Recipe else schema["$defs"][name]
        assert node.get("description"), f"{name}: give the class a docstring (it is the section's description)"
        assert node["additionalProperties"] is False, f"{name}: unknown keys must be errors in editors too"
        for key, field in model.model_fields.items():
            assert field.description, f"{name}.{key}: add a docstring under the field (it is the description)"
            assert node["properties"][key]["description"] == field.description, f"{name}.{key}"


def test_extends_is_in_the_schema_but_not_a_field():
    extends = Recipe.model_json_schema()["properties"]["extends"]
    assert {"type": "string"} in extends["anyOf"] and "recipe name" in extends["description"]
    assert "extends" not in Recipe.model_fields  # merged away at load time; a stray one is still an error


def _unknown_keys(value: Any, node: dict[str, Any], defs: dict[str, Any], where: str) -> list[str]:
    """Keys an editor would flag: walk a raw recipe along the schema's properties/$ref/items (no jsonschema)."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    if isinstance(value, dict) and "properties" in node:
        out = []
        for key, item in value.items():
            if key not in node["properties"]:
                out.append(f"{where}{key}")
            else:
                out += _unknown_keys(item, node["properties"][key], defs, f"{where}{key}.")
        return out
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [bad for item in value for bad in _unknown_keys(item, node["items"], defs, where)]
    return []


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "examples" / "yaml").glob("*.yaml")), ids=lambda p: p.name)
def test_the_schema_accepts_every_shipped_example_as_written(path):
    schema = Recipe.model_json_schema()
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert _unknown_keys(raw, schema, schema["$defs"], "") == []


def test_the_schema_walk_catches_an_unknown_key():
    schema = Recipe.model_json_schema()
    raw = {"extends": "quickstart", "train": {"lrr": 1}, "datasets": [{"path": "x", "fromat": "chat"}]}
    assert _unknown_keys(raw, schema, schema["$defs"], "") == ["train.lrr", "datasets.fromat"]


def test_generated_docs_are_up_to_date():
    gen = load_generator()
    for path, text in ((gen.REFERENCE, gen.render_reference()), (gen.SCHEMA, gen.render_schema())):
        assert Path(path).read_text(encoding="utf-8") == text, \
            f"{Path(path).relative_to(REPO_ROOT)} is out of date: run python scripts/gen_recipe_reference.py"
    assert gen.main(["--check"]) == 0


def test_the_reference_lists_every_key_with_its_default():
    text = (REPO_ROOT / "docs" / "recipe-reference.md").read_text(encoding="utf-8")
    for key, field in Recipe.model_fields.items():
        assert f"| `{key}` |" in text, key
        annotation = field.annotation
        inner = get_args(annotation)[0] if get_origin(annotation) is list else annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            prefix = f"{key}[]" if get_origin(annotation) is list else key
            if key == "eval_datasets":
                prefix = "datasets[]"  # documented once, with datasets
            for sub, sub_field in inner.model_fields.items():
                row = next((line for line in text.splitlines() if line.startswith(f"| `{prefix}.{sub}` |")), None)
                assert row is not None, f"{prefix}.{sub}"
                default = sub_field.get_default(call_default_factory=True)
                if not sub_field.is_required() and isinstance(default, (bool, int, str)):
                    shown = json.dumps(default) if not isinstance(default, str) else default
                    assert f"`{shown}`" in row, (row, default)
    assert "# yaml-language-server: $schema=recipe.schema.json" in text
