"""Hostile or odd recipe inputs are refused with a clear message, quickly: YAML that expands without bound, numbers
that are not numbers (1e400 is infinity), seeds and names beyond what the libraries and file systems take, batch
geometry beyond reason, and `model.path` next to `model.init: random`.

Torch-free and fast, like tests/test_recipe.py; the CLI-level cases (exit code 2, no traceback, nothing lost) are
rows of tests/test_bad_inputs.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from finetune.errors import UserError
from finetune.recipe import apply_override, load_recipe, loading, parse_yaml
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
    start = time.perf_counter()
    with pytest.raises(UserError) as info:
        _load_text(text, tmp_path)
    assert time.perf_counter() - start < 1.0
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
