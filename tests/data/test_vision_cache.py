"""Vision-language samples in the data cache (data/cache.py, store.py, store_images.py): cached samples equal fresh
ones, image entries included; the layout and the images' folders are in the key; an image file whose bytes changed
is never served stale (the entry is rebuilt); a run from a warm cache trains as a cold one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import train_lines
from PIL import Image
from vision_fixtures import recipe_yaml, write_data

from finetune.data.cache import cache_inputs, cache_key, prepare
from finetune.data.collate import collate
from finetune.data.samples import build_samples
from finetune.data.shards import Part
from finetune.data.stats import DataStats
from finetune.data.store import Samples, SplitWriter
from finetune.errors import UserError
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import Recipe, validate


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(root))
    return root


def _recipe(data: Path, family: str = "qwen2_vl", **keys: object) -> Recipe:
    raw = json.loads(recipe_yaml(data, family, **keys))
    raw["output_dir"] = str(data.parent / "run")
    return validate(raw)


def _key(recipe: Recipe) -> str:
    return cache_key(cache_inputs(recipe, load_tokenizer(recipe.tokenizer, recipe.model)))


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm", "mistral3"])  # smolvlm: a tile grid; mistral3: rows of patches
def test_cached_vlm_samples_equal_fresh_ones(tmp_path, cache_dir, family):
    recipe = _recipe(write_data(tmp_path / "data"), family, val_fraction=0.25)
    tok = load_tokenizer(recipe.tokenizer, recipe.model)
    train, evals, _, _ = build_samples(recipe, tok)
    cold, warm = prepare(recipe, tok), prepare(recipe, tok)
    assert not cold.hit and warm.hit and cold.path == warm.path, warm.note
    for got in (cold, warm):
        assert list(got.train) == train and list(got.evals) == evals  # tokens, labels and image entries
    counts = [len(s.get("images", {}).get("items", [])) for s in warm.train]
    assert 0 in counts and 1 in counts and 2 in counts
    assert (family in ("smolvlm", "mistral3")) == any("grid" in item for s in warm.train for item in s.get("images", {}).get(
        "items", []))
    batch = collate(list(warm.train), recipe.data, tok.pad_token_id)  # the pixels come from the entries read back
    assert batch.vision is not None and batch.vision.images == sum(counts)


def test_worker_parts_keep_their_images(tmp_path):
    """A worker's samples reach the store (and a list) with their image entries, as samples appended one by one."""
    recipe = _recipe(write_data(tmp_path / "data"))
    samples = build_samples(recipe, load_tokenizer(recipe.tokenizer, recipe.model))[0]
    assert sum(bool(s.get("images")) for s in samples) == 6
    for name, fill in (("one", lambda w: [w.append(s) for s in samples]),
                       ("part", lambda w: Part.of(samples, DataStats()).deliver(w))):
        (tmp_path / name).mkdir()
        writer = SplitWriter(tmp_path / name, "train")
        fill(writer)
        info = writer.close()
        assert list(Samples.open(tmp_path / name, "train", info["labels"], info)) == samples
    delivered: list[dict] = []
    Part.of(samples, DataStats()).deliver(delivered)
    assert delivered == samples


def test_layout_and_image_folders_change_the_key(tmp_path, cache_dir):
    data = write_data(tmp_path / "data")
    base = _key(_recipe(data))
    processor = json.loads(recipe_yaml(data))["model"]["image_processor"]
    changed = _recipe(data)
    changed.model.image_processor = {**processor, "max_pixels": 2048}
    moved = write_data(tmp_path / "elsewhere")  # same bytes, images resolved in another folder
    assert len({base, _key(changed), _key(_recipe(data, "qwen2_5_vl")), _key(_recipe(moved))}) == 4
    assert _key(_recipe(data)) == base


def _rewrite(path: Path, size: tuple[int, int], color: str) -> None:
    Image.new("RGB", size, color).save(path)


def test_a_changed_image_is_rebuilt_never_served(tmp_path, cache_dir):
    data = write_data(tmp_path / "data")
    recipe = _recipe(data)
    tok = load_tokenizer(recipe.tokenizer, recipe.model)
    assert not prepare(recipe, tok).hit and prepare(recipe, tok).hit
    red = data.parent / "images" / "red.png"
    for size, color in (((80, 80), "red"), ((80, 80), "pink")):  # another size, then the same size other bytes
        _rewrite(red, size, color)
        again = prepare(recipe, tok)
        assert not again.hit and f"the image {red} changed since the samples were made" in again.note
        assert list(again.train) == build_samples(recipe, tok)[0]
        assert prepare(recipe, tok).hit
    sizes = {tuple(i["size"]) for s in again.train for i in s.get("images", {}).get("items", [])
             if i["path"] == str(red)}
    assert sizes == {(80, 80)}
    red.unlink()  # the entry is not used (its check fails), and the rows name a missing file: the user's error
    with pytest.raises(UserError, match="red.png"):
        prepare(recipe, tok)


def test_a_warm_cache_trains_as_a_cold_one(tmp_path, cache_dir):
    from finetune.train.loop import train

    data = write_data(tmp_path / "data")
    losses, inodes = [], []
    for name in ("cold", "warm"):
        recipe = _recipe(data)
        recipe.train.max_steps = 2
        recipe.output_dir = str(tmp_path / name)
        train(recipe)
        losses.append([line["loss"] for line in train_lines(tmp_path / name)])
        entries = [p for p in cache_dir.iterdir() if not p.name.startswith(".") and p.name != "images"]
        assert len(entries) == 1
        inodes.append(entries[0].stat().st_ino)
    assert inodes[0] == inodes[1] and len(losses[0]) == 2  # the warm run read the cold run's entry
    np.testing.assert_array_equal(losses[0], losses[1])


@pytest.mark.parametrize("start", ["fork", "spawn"])  # spawn: how workers start on macOS and Windows
def test_tokenizer_workers_see_the_image_layout_however_they_start(tmp_path, monkeypatch, start):
    """The image layout reaches preprocessing through the tokenizer it is attached to. A spawned worker gets a copy
    of the tokenizer, not the object the layout was attached to: it must get the layout too, or the rows' images
    would be refused or lost. 2 workers over 300 rows (enough to start them) give the samples of one process."""
    from finetune.data import shards

    monkeypatch.setattr(shards, "START_METHOD", start)
    data = write_data(tmp_path / "data", n=300)
    serial = _recipe(data, num_proc=1)
    tok = load_tokenizer(serial.tokenizer, serial.model)
    expected = build_samples(serial, tok)[0]
    assert sum(bool(s.get("images")) for s in expected) == 225
    assert build_samples(_recipe(data, num_proc=2), tok)[0] == expected
