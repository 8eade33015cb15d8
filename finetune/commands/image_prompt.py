"""The images of a `finetune generate --image` prompt, laid out exactly as training laid out a row's images.

The user message holds the images as image parts, then the text (the order of a training row's parts); the chat
template renders it, and the rendering goes through the same steps as a training sample's: each image's
placeholder expanded to the tokens its size gives under the run's image layout (finetune/data/images.py: place,
finish), and the pixels loaded and processed as collate does (finetune/data/pixels.py). What the model's generate
gets is what its forward got in training: input ids with one image token per image feature, and the model's own
image inputs (Qwen2-VL: pixel_values, image_grid_thw, mm_token_type_ids; LLaVA: pixel_values). An image of more
pixels than data.max_image_pixels' default (its header says, before any pixel is decoded) is refused: a
decompression bomb would otherwise take gigabytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from finetune.data.image_files import DEFAULT_MAX_IMAGE_PIXELS, check_pixels, open_image
from finetune.data.images import finish, layout_for, place
from finetune.data.pixels import vision_fields
from finetune.data.sources import BadRow
from finetune.errors import UserError

_ORIGIN = "the prompt"


def image_files(paths: Sequence[str], max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> list[str]:
    """The --image paths as absolute paths (relative ones to the working directory); a UserError naming the first
    that is not a file, or whose header says it has more than `max_pixels` pixels. Checked before the model loads:
    a typo fails at once."""
    found = []
    for value in paths:
        path = Path(value).expanduser()
        if not path.is_file():
            why = "is a directory" if path.is_dir() else "does not exist"
            raise UserError(f"--image {value}: {why}; give an image file (PNG, JPEG, ...)")
        check_image_pixels(value, str(path), max_pixels)
        found.append(str(path.resolve()))
    return found


def check_image_pixels(value: str, path: str, max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> None:
    """A UserError naming `--image value` when the image's header says it has more than `max_pixels` pixels (read
    before any pixel is decoded). A file that is no image passes: laying the prompt out says why."""
    from PIL import UnidentifiedImageError

    where = f"--image {value}"
    try:
        with open_image(where, "the image", path) as image:
            check_pixels(where, "the image", image.size, max_pixels, "resize it", "data.max_image_pixels' default")
    except BadRow as e:  # not a data row here: the command's error
        raise UserError(str(e)) from None
    except (OSError, UnidentifiedImageError, ValueError):
        pass


def user_content(prompt: str, images: int) -> str | list[dict[str, str]]:
    """The user message's content: the text alone, or the images as image parts followed by the text."""
    if not images:
        return prompt
    return [*({"type": "image"} for _ in range(images)), {"type": "text", "text": prompt}]


def check_images_allowed(tokenizer: Any, images: Sequence[str]) -> None:
    """A UserError for images given to a text-only model (checked before its chat template sees image parts)."""
    if images and layout_for(tokenizer) is None:
        raise UserError("--image: this model is text-only (no image processor was loaded with it); images need a "
                        "vision-language model run (docs/vision.md lists the supported families)")


def prompt_inputs(tokenizer: Any, rendered: str, images: Sequence[str]) -> dict[str, torch.Tensor]:
    """The model's inputs for a rendered prompt (a batch of one): input_ids and attention_mask, and with images their
    tokens laid out and their pixels processed as in training, with the model's image inputs. A UserError when the
    model is text-only or the rendering does not hold one placeholder per image."""
    check_images_allowed(tokenizer, images)
    for path in images:  # also when given here directly (complete), not through image_files
        check_image_pixels(path, path)
    layout = layout_for(tokenizer)
    if layout is None:
        return _text_inputs(tokenizer, rendered)
    # Without images too: a prompt whose text spells the image placeholder is refused, as a training row is.
    placed = place(_ORIGIN, rendered, images, layout)
    if not images:
        return _text_inputs(tokenizer, rendered)
    encoded = tokenizer(placed.text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    # finish also masks a training sample's labels: a prompt has none, so a throwaway list takes that.
    entry = finish(_ORIGIN, ids, list(ids), encoded["offset_mapping"], images, placed, layout)
    input_ids = torch.tensor([ids])
    fields = vision_fields([{"images": entry}], input_ids)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **(fields.inputs if fields else {})}


def _text_inputs(tokenizer: Any, rendered: str) -> dict[str, torch.Tensor]:
    # The template writes the special tokens itself: adding them again would double the bos.
    ids = tokenizer(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def image_tokens(tokenizer: Any, input_ids: torch.Tensor) -> int:
    """How many of the prompt's tokens are image tokens (0 for a text-only model)."""
    layout = layout_for(tokenizer)
    return 0 if layout is None else int((input_ids == layout.image_id).sum())
