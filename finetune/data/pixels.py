"""The images of a micro-batch, loaded and processed when it is collated: pixel values are never cached.

Each sample names its image layout (finetune/data/images.py) and, per image, its file, its size and its number of
features as preprocessing counted them. Here the files are read (EXIF rotation applied, RGB, as transformers'
load_image does), the micro-batch's images go through the image processor in row order, and each image's grid must
give the number of features its tokens were laid out for: a file replaced by an image of another size since the
samples were made is an error naming it, never a silent misalignment of image features and tokens. Two checks come
before any pixel is decoded: a file of the image store must hold the bytes it is named for (image_files.py: its
source bytes are not at hand here to write it again), and an image over data.max_image_pixels' default is decoded
only when its sample was laid out for that many pixels (a file replaced by a decompression bomb is refused unread).

Packed rows (finetune/data/pack.py) carry their documents' entries in order, so the images are listed in the order
their tokens appear across the flattened rows (row by row, document by document), which is the order the model
scatters image features over its image tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from finetune.batch import VisionFields
from finetune.data.image_files import DEFAULT_MAX_IMAGE_PIXELS, check_stored, open_image, stored_digest
from finetune.data.images import layout_named
from finetune.errors import UserError


def load_image(path: str, laid_out: Sequence[int]) -> Any:
    """The image at `path` as the processor takes it: EXIF rotation applied, RGB. `laid_out`: the (height, width)
    its sample was laid out for; an image of more pixels than that and than data.max_image_pixels' default is
    refused before it is decoded."""
    from PIL import ImageOps, UnidentifiedImageError

    try:
        source: str | bytes = path
        if stored_digest(path) is not None:  # read once: hashed, then decoded from memory
            source = Path(path).read_bytes()
            check_stored(path, hashlib.sha256(source).hexdigest())
        with open_image("loading a micro-batch's images", f"the image {path}", source) as image:
            width, height = image.size
            expected = laid_out[0] * laid_out[1]
            if width * height > max(expected, DEFAULT_MAX_IMAGE_PIXELS):
                raise UserError(f"the image {path} is {width}x{height} ({width * height:,} pixels) and its sample "
                                f"was laid out for {expected:,} pixels: the file changed since; it was not decoded. "
                                "Rerun `finetune preprocess --rebuild`")
            return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise UserError(f"the image {path} cannot be read ({type(e).__name__}: {e})") from None


def _entries(row: dict) -> list[dict]:
    """A row's image entries: a sample's one, or a packed row's list (one per document with images, in order)."""
    images = row.get("images")
    if not images:
        return []
    return list(images) if isinstance(images, list) else [images]


def vision_fields(rows: Sequence[dict], input_ids: torch.Tensor) -> VisionFields | None:
    """The model's image inputs for these collated rows (None when no row has an image)."""
    entries = [entry for row in rows for entry in _entries(row)]
    if not entries:
        return None
    keys = {entry["layout"] for entry in entries}
    if len(keys) > 1:  # one model, one processor: two layouts in a batch are samples of two preprocessings
        raise UserError("a micro-batch holds samples laid out for two different image processors; rerun "
                        "`finetune preprocess --rebuild`")
    layout = layout_named(keys.pop())
    items = [item for entry in entries for item in entry["items"]]
    processed = layout.processor(images=[load_image(item["path"], item["size"]) for item in items],
                                 return_tensors="pt")
    features = layout.family.processed(layout.processor, layout.settings, processed)
    for item, got in zip(items, features):
        if got != item["features"]:
            raise UserError(f"the image {item['path']} gives {got} image features and its sample was laid out for "
                            f"{item['features']} (size {item['size'][0]}x{item['size'][1]} when preprocessed): the "
                            "file changed since; rerun `finetune preprocess --rebuild`")
    grids = layout.family.processed_grids
    for item, got in zip(items, grids(layout.processor, layout.settings, processed) if grids is not None else ()):
        if got != item["grid"]:  # SmolVLM, Mistral 3: the same features in another grid would be laid out otherwise
            raise UserError(f"the image {item['path']} is split into a {got[0]}x{got[1]} grid and its sample was laid "
                            f"out for {item['grid'][0]}x{item['grid'][1]}: the file changed since; rerun `finetune "
                            "preprocess --rebuild`")
    return VisionFields(layout.family.inputs(processed, input_ids, layout.image_id), len(items))
