"""Images in a row's `images` column (TRL's convention, hub datasets such as llava-instruct-mix-vsft): image parts
without a path take them in order; bytes are written once into the image store (finetune/data/image_files.py) and
are then paths like any other. The samples equal those of the same rows with image files named by path."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image
from vision_fixtures import IMAGES, image_rows, model_config, recipe_yaml, tokenizer_config, write_images

from finetune.data.collate import collate
from finetune.data.formats import MessageFields, to_example
from finetune.data.image_files import STORE_FOLDER, store_dir, stored
from finetune.data.samples import build_samples
from finetune.data.sources import BadRow, RawRow, _undecoded
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import DataConfig, load_recipe


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tokenizer_config(), model_config())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The fixture rows twice: with image files named by path (train.jsonl), and with their images' bytes in an
    `images` column of a parquet file, every content a list of parts (what a parquet column must be)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("columns")
    write_images(folder / "images")
    by_path, by_column = [], []
    for row in image_rows(8):
        path_messages, column_messages, images = [], [], []
        for m in row["messages"]:
            parts = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
            path_messages.append({"role": m["role"], "content": parts})
            # every part every key (text None for an image), as a parquet column of structs holds them
            column_messages.append({"role": m["role"], "content": [{"type": p["type"], "text": p.get("text")}
                                                                   for p in parts]})
            images += [{"bytes": (folder / p["path"]).read_bytes(), "path": p["path"]}
                       for p in parts if p["type"] == "image"]
        by_path.append({"messages": path_messages})
        by_column.append({"messages": column_messages, "images": images})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in by_path))
    pq.write_table(pa.Table.from_pylist(by_column), folder / "train.parquet")
    return folder


def _samples(folder, name, tok, cache):
    recipe_file = folder / f"{name}.yaml"
    recipe_file.write_text(recipe_yaml(folder / name, cache_dir=str(cache), num_proc=1))
    train, _, stats, _ = build_samples(load_recipe(recipe_file), tok)
    return train, stats


def _without_paths(sample):
    images = sample.get("images")
    items = [{k: v for k, v in item.items() if k != "path"} for item in images["items"]] if images else None
    return {**sample, "images": items}


def test_column_rows_give_the_samples_and_pixels_of_path_rows(data, tok, tmp_path):
    """Read through the real data path (build_samples: read_rows' parquet reader, formats, tokenize): token for
    token, label for label, image for image the same samples; collate's pixels equal; each image stored once."""
    by_path, _ = _samples(data, "train.jsonl", tok, tmp_path / "cache")
    by_column, stats = _samples(data, "train.parquet", tok, tmp_path / "cache")
    assert stats.rows_read == 8 and stats.samples == 8
    assert [_without_paths(s) for s in by_column] == [_without_paths(s) for s in by_path]
    paths = [item["path"] for s in by_column if "images" in s for item in s["images"]["items"]]
    assert len(paths) == 8 and len(set(paths)) == 3  # 8 images in 6 rows, 3 of them different
    stored_files = sorted((tmp_path / "cache" / STORE_FOLDER).iterdir())
    assert sorted(map(str, stored_files)) == sorted(set(paths))  # each written once however many rows show it
    shown = [item["path"] for s in by_path if "images" in s for item in s["images"]["items"]]
    assert [Path(p).read_bytes() for p in paths] == [Path(p).read_bytes() for p in shown]
    assert all(f.suffix == ".png" for f in stored_files)
    config = DataConfig(packing=False)
    a, b = collate(by_path, config, tok.pad_token_id), collate(by_column, config, tok.pad_token_id)
    assert a.vision is not None and b.vision is not None and a.vision.images == 8
    for key, value in a.vision.inputs.items():
        assert torch.equal(value, b.vision.inputs[key]), key
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_hub_image_columns_are_read_undecoded(data, tok, tmp_path):
    """A hub dataset's Image feature (decoded into PIL images by default) is read as its bytes: the same example as
    the parquet row; a decoded PIL image without a file is stored losslessly as PNG, the same pixels."""
    import datasets

    name = IMAGES[1][0]
    raw = (data / "images" / name).read_bytes()
    row = {"messages": [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
           "images": [{"bytes": raw, "path": name}]}
    features = datasets.Features({"messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(
        {"type": datasets.Value("string"), "text": datasets.Value("string")})}), "images": datasets.List(datasets.Image())})
    dataset = datasets.Dataset.from_list([row], features=features)
    assert isinstance(dataset[0]["images"][0], Image.Image)  # what iterating it would give
    (hub_row,) = list(_undecoded(dataset))
    assert hub_row["images"][0]["bytes"] == raw
    fields = MessageFields(cache_dir=str(tmp_path))
    (path,) = to_example(RawRow(hub_row, "hub[train][0]"), "chat", fields=fields).images
    assert Path(path).read_bytes() == raw
    decoded = Image.open(io.BytesIO(raw))
    decoded.load()
    (png,) = to_example(RawRow({**row, "images": [decoded.copy()]}, "hub[train][0]"), "chat", fields=fields).images
    assert png.endswith(".png")
    assert Image.open(png).tobytes() == decoded.tobytes()


def _row(*parts, images=None):
    row = {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": "ok"}]}
    return {**row, "images": images} if images is not None else row


IMAGE = {"type": "image"}
TEXT = {"type": "text", "text": "what?"}


@pytest.fixture
def png(tmp_path):
    out = io.BytesIO()
    Image.new("RGB", (8, 6), "red").save(out, format="PNG")
    return {"bytes": out.getvalue(), "path": "red.png"}


def _example(row, tmp_path, fmt="chat"):
    fields = MessageFields(image_root=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    return to_example(RawRow(row, "d.parquet[row 3]"), fmt, fields=fields)


def test_bad_image_columns_are_bad_rows_naming_the_row(tmp_path, png):
    cases = [
        (_row(IMAGE, IMAGE, TEXT, images=[png]), "part 1 (image) has no path and the row's 'images' holds 1 images"),
        (_row(IMAGE, TEXT, images=[png, png]), "'images' holds 2 images and its messages have 1 image parts"),
        (_row(TEXT, images=[png]), "'images' holds 1 images and its messages have no image parts"),
        (_row(IMAGE, images=[{"bytes": b"not an image", "path": "x.png"}]), "images[0]: 12 bytes that are not an image"),
        (_row(IMAGE, images=["https://example.com/cat.png"]), "remote images are not supported; download them"),
        (_row(IMAGE, images=[{"bytes": None, "path": None}]), "images[0] has neither image bytes nor a path"),
        (_row(IMAGE, images=[3]), "images[0] is a int, not an image"),
        (_row({"type": "image", "index": 1}, images=[png, png]), "has index 1, but it is the row's image 0"),
        (_row({"type": "image", "url": "https://example.com/a.png"}), "remote images are not supported"),
        (_row({"type": "image", "image": {"bytes": b"GIF89a", "path": None}}), "6 bytes that are not an image"),
    ]
    for row, message in cases:
        with pytest.raises(BadRow, match=r"^d\.parquet\[row 3\]") as e:
            _example(row, tmp_path)
        assert message in str(e.value), str(e.value)
    for fmt, row in (("alpaca", {"instruction": "i", "output": "o", "images": [png]}),
                     ("completion", {"text": "t", "images": [png]})):
        with pytest.raises(BadRow, match=f"images are read in chat rows .* this dataset's format is {fmt}"):
            _example(row, tmp_path, fmt)
    assert _example({"instruction": "i", "output": "o", "images": []}, tmp_path, "alpaca").images == ()
    (one,) = _example(_row(IMAGE, images=png), tmp_path).images  # one image, not in a list: an `image` column
    assert Path(one).read_bytes() == png["bytes"]


def test_parts_take_their_own_images_or_the_columns_in_order(tmp_path, png):
    """A part's own image (a path, or bytes inline) is its; parts without one take the column's in order."""
    write_images(tmp_path / "images")
    blue = {"bytes": (tmp_path / "images" / "blue.png").read_bytes(), "path": None}
    row = _row({"type": "image", "path": "images/green.png"}, IMAGE, {"type": "image", "image": blue}, IMAGE,
               images=[png, "images/yellow.png"])
    paths = _example(row, tmp_path).images
    assert [Path(p).read_bytes() for p in paths] == [
        (tmp_path / "images" / "green.png").read_bytes(), png["bytes"], blue["bytes"],
        (tmp_path / "images" / "yellow.png").read_bytes()]
    assert paths[1].startswith(str(tmp_path / "cache" / STORE_FOLDER))
    with Image.open(tmp_path / "images" / "red.png") as opened:  # decoded from a file: that file, not a copy
        (own,) = _example(_row(IMAGE, images=[opened]), tmp_path).images
    assert own == str((tmp_path / "images" / "red.png").resolve())


def test_preference_rows_with_images_are_bad_rows(png):
    from finetune.data.pairs import to_pair

    row = {"prompt": "p", "chosen": "a", "rejected": "b", "images": [png]}
    with pytest.raises(BadRow, match=r"^d:4: the row has 1 images in 'images'; .* format is preference"):
        to_pair(RawRow(row, "d:4"))
    assert to_pair(RawRow({**row, "images": None}, "d:4")).chosen[0]["content"] == "a"


def test_the_store_is_under_the_data_cache_root(tmp_path, monkeypatch):
    from finetune.data.cache import cache_root
    from finetune.recipe import Recipe

    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path / "env"))
    for cache_dir in (None, str(tmp_path / "set")):
        recipe = Recipe.model_validate({"model": {"path": "m"}, "datasets": [{"path": "d.jsonl"}],
                                        "data": {"cache_dir": cache_dir}})
        assert store_dir(cache_dir) == cache_root(recipe) / STORE_FOLDER


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    """Threads writing the same image at once (as ranks reading the same rows do): one file, whole, no temporary
    file left; a file cut short (a disk that lost it) is written again."""
    out = io.BytesIO()
    Image.new("RGB", (300, 300), "green").save(out, format="BMP")  # large and fast to make
    data = out.getvalue()
    barrier, paths = threading.Barrier(8), []

    def write() -> None:
        barrier.wait()
        for _ in range(5):
            paths.append(stored("d:1", data, tmp_path))

    threads = [threading.Thread(target=write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and len(paths) == 40
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].rsplit("/", 1)[1]] and paths[0].endswith(".bmp")
    target = tmp_path / paths[0].rsplit("/", 1)[1]
    assert target.read_bytes() == data
    target.write_bytes(data[:100])
    assert stored("d:1", data, tmp_path) == paths[0] and target.read_bytes() == data


def test_one_training_step_from_parquet_rows(data, tmp_path):
    from helpers import train_lines

    from finetune.train.loop import train

    recipe_file = tmp_path / "vlm.yaml"
    recipe_file.write_text(recipe_yaml(data / "train.parquet", cache_dir=str(tmp_path / "cache")))
    out = tmp_path / "run"
    train(load_recipe(recipe_file, [f"output_dir={out}", "train.max_steps=1", "datasets.0.max_rows=4"]))
    (line,) = train_lines(out)
    assert line["step"] == 1 and line["loss"] > 0 and torch.isfinite(torch.tensor(line["loss"]))
    assert len(list((tmp_path / "cache" / STORE_FOLDER).iterdir())) == 3  # rows 0-3: red; blue, green; green; none
