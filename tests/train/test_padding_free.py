"""Padding-free micro-batches (data.padding_free, train/padding_free.py): with packing off, a micro-batch's samples end
to end in one row train as the same samples padded do, and auto keeps padded rows wherever it does not apply."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QUICKSTART, TINY, assert_same_steps, final_weights, rel_diff, run_cli, train_lines

from finetune.data.collate import collate_flat, collate_padded
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import load_recipe
from finetune.train.padding_free import choose


def test_a_flat_micro_batch_holds_the_padded_ones_tokens_and_targets():
    samples = [{"input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, 6, 7, 8]},
               {"input_ids": [9, 10], "labels": [9, 10]},
               {"input_ids": [11, 12, 13], "labels": [IGNORE_INDEX, IGNORE_INDEX, 13]}]
    flat, padded = collate_flat(samples, 0), collate_padded(samples, 0)
    assert flat.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert flat.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    # A document's first label is scored by no position of a padded row; here it would be the previous document's
    # last token's target, so it is ignored: the same targets, none across a boundary.
    assert flat.labels.tolist() == [[IGNORE_INDEX, 6, 7, 8, IGNORE_INDEX, 10, IGNORE_INDEX, IGNORE_INDEX, 13]]
    assert flat.targets == padded.targets == 5
    assert flat.seq_tokens == padded.seq_tokens == flat.padded_tokens == 9
    assert padded.padded_tokens == 12


def test_padding_free_trains_as_padded_micro_batches(tmp_path):
    """The same 3 steps (micro 4 x accumulation 2, fp32) with padded and padding-free micro-batches: the same counts,
    losses and grad norms within 1e-5, final weights within 1e-5 per tensor (rel_diff), and only the padding gone
    from the tokens computed."""
    runs = {}
    for setting in ("false", "true"):
        out = tmp_path / setting
        result = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "data.packing=false",
                         f"data.padding_free={setting}", "train.max_steps=3", "train.micro_batch_size=4",
                         "train.gradient_accumulation_steps=2")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[setting] = out, result.stdout
    (padded, padded_log), (flat, flat_log) = runs["false"], runs["true"]
    assert "padding-free isolation check passed" in flat_log and "padding-free rows: sdpa per document" in flat_log
    assert "padded micro-batches (data.padding_free: false)" in padded_log
    lines, ref = train_lines(flat), train_lines(padded)
    assert_same_steps(lines, ref, equal=("tokens", "seq_tokens"))
    assert all(r["padded_tokens"] == r["seq_tokens"] for r in lines)
    assert all(r["padded_tokens"] > r["seq_tokens"] for r in ref)
    weights, ref_weights = final_weights(flat), final_weights(padded)
    for name, tensor in ref_weights.items():
        assert rel_diff(weights[name], tensor) <= 1e-5, (name, rel_diff(weights[name], tensor))
    for out, on in ((flat, True), (padded, False)):
        assert json.loads((out / "versions.json").read_text())["run"]["padding_free"] is on


@pytest.fixture(scope="module")
def tiny_parts():
    recipe = load_recipe(QUICKSTART, TINY)
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    models = {}
    for attn in ("auto", "eager"):
        cfg = recipe.model.model_copy(update={"attn_implementation": attn})
        models[attn] = load_model(cfg, recipe.adapter, tokenizer, recipe.seed)
    return tokenizer, models


@pytest.mark.parametrize(("overrides", "attn", "why"), [
    ([], "auto", None),
    (["data.padding_free=false"], "auto", "data.padding_free: false"),
    (["data.pad_to_multiple_of=8"], "auto", "data.pad_to_multiple_of asks for padded shapes"),
    (["model.attn_implementation=eager"], "eager", "the model's attention is eager, not finetune's"),
])
def test_auto_keeps_padded_rows_where_it_does_not_apply(tiny_parts, overrides, attn, why):
    tokenizer, models = tiny_parts
    recipe = load_recipe(QUICKSTART, [*TINY, "data.packing=false", *overrides])
    choice = choose(recipe, models[attn], tokenizer.pad_token_id, torch.device("cpu"))
    assert choice.on is (why is None)
    assert why is None or why in choice.why
    packed = load_recipe(QUICKSTART, TINY)
    assert choose(packed, models[attn], tokenizer.pad_token_id, torch.device("cpu")).on is False


def test_true_where_it_does_not_apply_is_an_error(tiny_parts):
    tokenizer, models = tiny_parts
    recipe = load_recipe(QUICKSTART, [*TINY, "data.packing=false", "data.padding_free=true",
                                      "data.pad_to_multiple_of=8"])
    with pytest.raises(UserError, match="data.padding_free: true, but data.pad_to_multiple_of asks for padded "
                                        "shapes; set data.padding_free: auto"):
        choose(recipe, models["auto"], tokenizer.pad_token_id, torch.device("cpu"))
