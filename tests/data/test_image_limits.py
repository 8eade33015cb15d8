"""Images that would cost far more than they should, and image files that are no longer what they are named for
(finetune/data/image_files.py, images.py, pixels.py, cache.py).

A decompression bomb (a PNG of a few KB whose header says 20000 x 20000 pixels) is a bad row naming its file:line
whichever way it comes (a path in a chat row, bytes in a parquet `images` column), so that `data.on_bad_row: skip`
skips it; one that replaces a file after preprocessing is refused by collate before it is decoded; PIL's own
DecompressionBombError and DecompressionBombWarning never reach the user. A file of the image store damaged since it
was written (same size, still an image, other bytes) is written again from the row's bytes, and refused where they
are not at hand.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image
from vision_fixtures import bomb_png, model_config, recipe_yaml, tokenizer_config, write_images

from finetune.data.cache import _image_digests, images_key, prepare
from finetune.data.collate import collate
from finetune.data.image_files import DEFAULT_MAX_IMAGE_PIXELS, open_image, stored
from finetune.data.images import RowImages
from finetune.data.pixels import load_image
from finetune.data.samples import build_samples
from finetune.data.sources import BadRow
from finetune.errors import UserError
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import DataConfig, Recipe, validate

BOMB = bomb_png(20000, 20000)  # over twice PIL's Image.MAX_IMAGE_PIXELS: Image.open raises DecompressionBombError
BIG = bomb_png(12000, 12000)  # over PIL's limit: Image.open warns, and decoding takes ~1.9 GB


def _bmp(color: str) -> bytes:
    """An 8 x 6 BMP: uncompressed, so two colors are two images of the same size in bytes."""
    out = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(out, format="BMP")
    return out.getvalue()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tokenizer_config(), model_config())


@pytest.fixture
def no_bomb_warnings():
    """Every warning recorded: PIL's DecompressionBombWarning must not be among them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]


def _row(image: object, answer: str = "ok") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "path": image} if isinstance(image, str)
                                                     else {"type": "image"}, {"type": "text", "text": "What?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            **({} if isinstance(image, str) else {"images": [image]})}


def _recipe(data: Path, **keys: object) -> Recipe:
    raw = json.loads(recipe_yaml(data, num_proc=1, cache_dir=str(data.parent / "cache"), **keys))
    raw["output_dir"] = str(data.parent / "run")
    return validate(raw)


def _path_rows(folder: Path) -> Path:
    write_images(folder / "images")
    (folder / "images" / "bomb.png").write_bytes(BOMB)
    (folder / "images" / "big.png").write_bytes(BIG)
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(_row(f"images/{name}")) + "\n" for name in ("red.png", "bomb.png", "big.png")))
    return data


def _parquet_rows(folder: Path, *images: bytes) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist([_row({"bytes": b, "path": None}) for b in images]), data)
    return data


def test_the_bombs_are_whole_pngs_of_a_few_kb():
    small = bomb_png(30, 2500)  # the same rows, repeated: decoded whole, every pixel black
    with Image.open(io.BytesIO(small)) as image:
        assert image.size == (30, 2500) and image.getextrema() == (0, 0)
    for data, side in ((BOMB, 20000), (BIG, 12000)):
        with open_image("w", "the image", data) as image:
            assert image.size == (side, side) and len(data) < 60_000
    assert DataConfig().max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS  # the schema's default is the code's


def test_open_image_leaves_pil_and_the_warning_filters_as_they_are(no_bomb_warnings):
    limit, filters = Image.MAX_IMAGE_PIXELS, list(warnings.filters)
    with open_image("w", "the image", BOMB) as image:
        assert image.size == (20000, 20000)
    assert limit == Image.MAX_IMAGE_PIXELS and filters == warnings.filters


def test_a_bomb_named_by_path_is_a_bad_row(tmp_path, tok, no_bomb_warnings):
    data = _path_rows(tmp_path)
    with pytest.raises(BadRow, match=r"train\.jsonl:2: message 0, part 0 \(image\): the image .*bomb\.png is "
                                     r"20000x20000 \(400,000,000 pixels\), over data\.max_image_pixels \(50,000,000\); "
                                     r"resize it, or raise data\.max_image_pixels"):
        build_samples(_recipe(data), tok)
    train, _, stats, _ = build_samples(_recipe(data, on_bad_row="skip"), tok)
    assert stats.rows_read == 3 and stats.bad_rows_skipped == 2 and len(train) == 1
    assert "big.png is 12000x12000 (144,000,000 pixels)" in stats.bad_row_examples[1]


def test_a_bomb_in_a_parquet_images_column_is_a_bad_row(tmp_path, tok, no_bomb_warnings):
    data = _parquet_rows(tmp_path, _bmp("red"), BOMB, BIG)
    with pytest.raises(BadRow, match=r"train\.parquet\[row 1\]: images\[0\]: the image is 20000x20000 "
                                     r"\(400,000,000 pixels\), over data\.max_image_pixels"):
        build_samples(_recipe(data), tok)
    train, _, stats, _ = build_samples(_recipe(data, on_bad_row="skip"), tok)
    assert stats.bad_rows_skipped == 2 and len(train) == 1
    assert len(list((tmp_path / "cache" / "images").iterdir())) == 1  # a bomb is never written into the store


def test_the_cap_is_the_recipes(tmp_path):
    """RowImages takes data.max_image_pixels: a lower cap refuses a small image, null lets a big one through."""
    def take(image: object, max_pixels: int | None) -> list[str]:
        images = RowImages("d:1", "images", [image], str(tmp_path), str(tmp_path / "cache"), max_pixels)
        images.take("d:1: message 0, part 0", {"type": "image"})
        return images.paths

    (tmp_path / "big.png").write_bytes(BIG)
    for image in ("big.png", {"bytes": BIG, "path": None}):
        assert len(take(image, None)) == 1
    for image in ({"bytes": _bmp("red"), "path": None}, Image.new("RGB", (8, 6))):
        with pytest.raises(BadRow, match=r"the image is 8x6 \(48 pixels\), over data\.max_image_pixels \(47\)"):
            take(image, 47)
    recipe = Recipe.model_validate({"model": {"path": "m"}, "datasets": [{"path": "d.jsonl"}],
                                    "data": {"max_image_pixels": None}})
    assert recipe.data.max_image_pixels is None


def test_collate_refuses_a_bomb_that_replaced_an_image_unread(tmp_path, tok, no_bomb_warnings):
    data = _path_rows(tmp_path)
    train, _, _, _ = build_samples(_recipe(data, on_bad_row="skip"), tok)
    (red,) = [Path(item["path"]) for item in train[0]["images"]["items"]]
    red.write_bytes(BOMB)
    with pytest.raises(UserError, match=r"red\.png is 20000x20000 \(400,000,000 pixels\) and its sample was laid "
                                        r"out for 1,200 pixels: the file changed since; it was not decoded"):
        collate(train, DataConfig(packing=False), tok.pad_token_id)


def test_a_damaged_stored_image_is_written_again(tmp_path, tok):
    """Same size, still an image, other bytes: rewritten from the row's bytes, and the right pixels are trained."""
    red, blue = _bmp("red"), _bmp("blue")
    assert len(red) == len(blue) and red != blue
    path = Path(stored("d:1", red, tmp_path))
    path.write_bytes(blue)
    assert stored("d:1", red, tmp_path) == str(path) and path.read_bytes() == red
    recipe = _recipe(_parquet_rows(tmp_path, red))
    cold = prepare(recipe, tok)
    (item,) = cold.train[0]["images"]["items"]
    pixels = collate(list(cold.train), recipe.data, tok.pad_token_id).vision.inputs["pixel_values"]
    Path(item["path"]).write_bytes(blue)
    again = prepare(recipe, tok)  # the entry sees other bytes: the rows are read again, the file written again
    assert not again.hit and "changed since the samples were made" in again.note
    assert Path(item["path"]).read_bytes() == red
    assert collate(list(again.train), recipe.data, tok.pad_token_id).vision.inputs["pixel_values"].equal(pixels)
    # An entry made from a damaged copy (its digest recorded as the copy's) is rebuilt, never used.
    meta_file = again.path / "meta.json"
    meta = json.loads(meta_file.read_text())
    Path(item["path"]).write_bytes(blue)
    meta["images"][item["path"]] = hashlib.sha256(blue).hexdigest()
    meta_file.write_text(json.dumps(meta))
    rebuilt = prepare(recipe, tok)
    assert not rebuilt.hit and "recorded with other bytes than the image store names it for" in rebuilt.note
    assert Path(item["path"]).read_bytes() == red


def test_a_damaged_stored_image_without_its_row_is_refused(tmp_path, tok):
    """Where the row's bytes are not at hand (collate, a new entry's digests, a run's images key), a stored file
    whose bytes are not those it is named for is refused, naming it."""
    red, blue = _bmp("red"), _bmp("blue")
    train, _, _, _ = build_samples(_recipe(_parquet_rows(tmp_path, red)), tok)
    (item,) = train[0]["images"]["items"]
    Path(item["path"]).write_bytes(blue)
    message = re.escape(f"the image {item['path']} in the image store does not hold the bytes it is named for")
    with pytest.raises(UserError, match=message):
        collate(train, DataConfig(packing=False), tok.pad_token_id)
    with pytest.raises(UserError, match=message):
        load_image(item["path"], item["size"])
    with pytest.raises(UserError, match=message):
        images_key(train)
    writer = SimpleNamespace(images=SimpleNamespace(sizes={item["path"]: tuple(item["size"])}))  # a SplitWriter's
    with pytest.raises(UserError, match=message):
        _image_digests([writer])


def test_the_recipes_cap_reaches_the_rows(tmp_path, tok):
    """null lets every image through (past PIL's own limit too); a low cap refuses a small one."""
    data = _path_rows(tmp_path)
    train, _, stats, _ = build_samples(_recipe(data, on_bad_row="skip", max_image_pixels=None), tok)
    assert stats.bad_rows_skipped == 0 and len(train) == 3
    with pytest.raises(BadRow, match=r"train\.jsonl:1: .*red\.png is 40x30 \(1,200 pixels\), over "
                                     r"data\.max_image_pixels \(1,000\)"):
        build_samples(_recipe(data, max_image_pixels=1000), tok)
