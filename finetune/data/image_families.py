"""What each supported vision-language family does with an image, in one table (docs/vision.md).

For a family: the placeholder its chat template writes per image, the token its processor repeats once per image
feature, the vision tokens that are never trained, how many features an image of a given height and width gets
(the processor's own resize rule, from the size alone), how many the processed pixels give (checked in collate:
the two must agree), and the model's keyword inputs made from the processed images.

Qwen2-VL / Qwen2.5-VL / Qwen3-VL: `smart_resize` to multiples of patch_size x merge_size within min/max_pixels,
one feature per merge_size**2 patches (Qwen2VLProcessor.replace_image_token; Qwen3VLProcessor's is the same rule, and
its model reads the same inputs). LLaVA: the processor resizes and center-crops to crop_size, one feature per patch,
plus the vision tower's CLS token, less one with the `default` feature select
strategy (LlavaProcessor.replace_image_token). Gemma 3: the template writes `<start_of_image>`, the processor
writes "\n\n<start_of_image>" + `<image_soft_token>` x mm_tokens_per_image + "<end_of_image>\n\n" in its place
(Gemma3Processor.full_image_sequence): every image resized to the SigLIP tower's square, pan-and-scan refused.
SmolVLM: the processor resizes the longest edge to size["longest_edge"], then to whole tiles of max_image_size and
splits the image into rows x cols tiles plus a global image; each tile is image_seq_len `<image>` tokens, laid out by
transformers' own get_image_prompt_string (SmolVLMProcessor.replace_image_token) from the grid computed here.
Mistral 3 (Pixtral's layout): the template writes `[IMG]`; the image is resized within size to whole patches of
patch_size x spatial_merge_size (PixtralProcessor passes that patch size; model/vision.py fixes it so), and the
processor writes a row of `[IMG]` per row of merged patches, each row ended by `[IMG_BREAK]`, the last by `[IMG_END]`
(PixtralProcessor.replace_image_token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from finetune.errors import UserError


@dataclass(frozen=True)
class Family:
    """How one family's processor turns an image into tokens: the template writes `placeholder` once per image, the
    processor writes `prefix + image_token * n + suffix` in its place (n: the image's features), or `text` of the
    image's tile grid where the layout depends on it (SmolVLM)."""

    placeholder: str
    image_token: str
    specials: tuple[str, ...]
    """The vision tokens that are never trained."""
    count: Callable[[Any, Mapping[str, Any], int, int], int]
    """(image processor, model settings, height, width) -> the image's number of features."""
    processed: Callable[[Any, Mapping[str, Any], Any], list[int]]
    """(image processor, model settings, the processor's output) -> each image's number of features."""
    inputs: Callable[[Any, torch.Tensor, int], dict[str, torch.Tensor]]
    """(the processor's output, the micro-batch's input ids, the image token's id) -> the model's image inputs."""
    before: str = ""
    """A vision token written right before the image tokens, counted as the image's (truncation, --show)."""
    after: str = ""
    prefix: str = ""
    """Text the processor writes in place of the placeholder before the image tokens (Gemma 3: "\n\n" and its
    `before` token); the template's own text around the placeholder is kept as it is."""
    suffix: str = ""
    grid: Callable[[Any, Mapping[str, Any], int, int], list[int]] | None = None
    """(image processor, model settings, height, width) -> the image's tile grid, where the layout depends on it."""
    processed_grids: Callable[[Any, Mapping[str, Any], Any], list[list[int]]] | None = None
    """(image processor, model settings, the processor's output) -> each image's grid (checked in collate against the
    one laid out)."""
    text: Callable[[Mapping[str, Any], list[int]], str] | None = None
    """(model settings, the image's grid) -> what the processor writes in place of the placeholder."""

    def expansion(self, n: int, settings: Mapping[str, Any], grid: list[int] | None) -> str:
        """What the processor writes in place of the placeholder for an image of n features (and this grid)."""
        if self.text is not None and grid is not None:
            return self.text(settings, grid)
        return self.prefix + self.image_token * n + self.suffix


# --- Qwen2-VL, Qwen2.5-VL, Qwen3-VL ---------------------------------------------------------------------------

def _qwen_count(processor: Any, settings: Mapping[str, Any], height: int, width: int) -> int:
    return processor.get_number_of_image_patches(height, width, {}) // processor.merge_size ** 2


def _qwen_processed(processor: Any, settings: Mapping[str, Any], out: Any) -> list[int]:
    return [t * h * w // processor.merge_size ** 2 for t, h, w in out["image_grid_thw"].tolist()]


def _qwen_inputs(out: Any, input_ids: torch.Tensor, image_id: int) -> dict[str, torch.Tensor]:
    # mm_token_type_ids (1 at image tokens) is what Qwen's 3D M-RoPE positions are computed from.
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": (input_ids == image_id).to(torch.int32)}


# --- LLaVA ------------------------------------------------------------------------------------------------------

def _llava_features(settings: Mapping[str, Any], height: int, width: int) -> int:
    patch = settings["patch_size"]
    n = (height // patch) * (width // patch) + settings["cls_tokens"]
    return n - 1 if settings["strategy"] == "default" else n


def _llava_count(processor: Any, settings: Mapping[str, Any], height: int, width: int) -> int:
    if not processor.do_center_crop:  # the processed size would follow each image's: not supported yet
        raise UserError("model.image_processor: do_center_crop false is not supported for llava yet")
    return _llava_features(settings, processor.crop_size["height"], processor.crop_size["width"])


def _llava_processed(processor: Any, settings: Mapping[str, Any], out: Any) -> list[int]:
    height, width = out["pixel_values"].shape[-2:]
    return [_llava_features(settings, height, width)] * out["pixel_values"].shape[0]


def _llava_inputs(out: Any, input_ids: torch.Tensor, image_id: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": out["pixel_values"]}


# --- Gemma 3 ----------------------------------------------------------------------------------------------------

def _gemma3_count(processor: Any, settings: Mapping[str, Any], height: int, width: int) -> int:
    # Every image is resized to the tower's square and pooled to mm_tokens_per_image features, whatever its size;
    # pan-and-scan would add crops (and text between them) that this layout does not write.
    if processor.do_pan_and_scan:
        raise UserError("model.image_processor: do_pan_and_scan is not supported for gemma3 yet (its crops and the "
                        "text the processor writes between them are not laid out); set do_pan_and_scan: false")
    side = settings["image_size"]
    if not processor.do_resize or (processor.size.get("height"), processor.size.get("width")) != (side, side):
        raise UserError(f"model.image_processor: gemma3's vision tower takes {side}x{side} images; the image "
                        f"processor must resize to that size (do_resize: true, size: {processor.size})")
    return settings["tokens"]


def _gemma3_features(settings: Mapping[str, Any], height: int, width: int) -> int:
    patch, side = settings["patch_size"], settings["image_size"]
    if (height, width) == (side, side):
        return settings["tokens"]
    return (height // patch) * (width // patch) * settings["tokens"] // (side // patch) ** 2


def _gemma3_processed(processor: Any, settings: Mapping[str, Any], out: Any) -> list[int]:
    if any(out["num_crops"].tolist()):
        raise UserError("the gemma3 image processor made pan-and-scan crops; set model.image_processor."
                        "do_pan_and_scan: false")
    height, width = out["pixel_values"].shape[-2:]
    return [_gemma3_features(settings, height, width)] * out["pixel_values"].shape[0]


def _gemma3_inputs(out: Any, input_ids: torch.Tensor, image_id: int) -> dict[str, torch.Tensor]:
    # token_type_ids (1 at image tokens): Gemma 3 lets each image's tokens attend to each other both ways
    # (Gemma3Model.forward builds that mask from them; without them the image would be read causally).
    return {"pixel_values": out["pixel_values"], "token_type_ids": (input_ids == image_id).to(torch.long)}


# --- SmolVLM ---------------------------------------------------------------------------------------------------

def _smolvlm_grid(processor: Any, settings: Mapping[str, Any], height: int, width: int) -> list[int]:
    """[rows, cols] of tiles, as SmolVLMImageProcessorPil._preprocess makes them (resize, resize_for_vision_encoder,
    split_images); [0, 0] when the image is one tile (or splitting is off)."""
    import math

    from transformers.models.smolvlm import image_processing_pil_smolvlm as smol

    tile = settings["image_size"]
    if processor.max_image_size.get("longest_edge") != tile:  # the connector pools full tiles of the tower's size
        raise UserError(f"model.image_processor: smolvlm's vision tower takes {tile}x{tile} tiles; max_image_size must "
                        f"be {{longest_edge: {tile}}} (it is {processor.max_image_size})")
    if processor.do_resize:
        if not processor.size.get("longest_edge"):
            raise UserError("model.image_processor: smolvlm's size must be {longest_edge: N} (a height and width are "
                            "not laid out yet)")
        height, width = smol._resize_output_size_rescale_to_max_len(height, width, max_len=processor.size["longest_edge"])
        height, width = smol._resize_output_size_scale_below_upper_bound(height, width, max_len=smol.MAX_IMAGE_SIZE)
    if not processor.do_image_splitting:
        return [0, 0]
    ratio = width / height
    if width >= height:  # resize_for_vision_encoder: whole tiles, the aspect ratio kept
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    if height > tile or width > tile:  # split_images
        return [(height - tile) // tile + 1, (width - tile) // tile + 1]
    return [0, 0]


def _smolvlm_count(processor: Any, settings: Mapping[str, Any], height: int, width: int) -> int:
    rows, cols = _smolvlm_grid(processor, settings, height, width)
    return settings["tokens"] * (rows * cols + 1)


def _smolvlm_text(settings: Mapping[str, Any], grid: list[int]) -> str:
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    return get_image_prompt_string(grid[0], grid[1], settings["tokens"], fake_token_around_image=_FAKE,
                                   image_token="<image>", global_image_token="<global-img>")


def _smolvlm_grids(processor: Any, settings: Mapping[str, Any], out: Any) -> list[list[int]]:
    return [[r, c] for rows, cols in zip(out["rows"], out["cols"]) for r, c in zip(rows, cols)]


def _smolvlm_processed(processor: Any, settings: Mapping[str, Any], out: Any) -> list[int]:
    return [settings["tokens"] * (r * c + 1) for r, c in _smolvlm_grids(processor, settings, out)]


def _smolvlm_inputs(out: Any, input_ids: torch.Tensor, image_id: int) -> dict[str, torch.Tensor]:
    # One sample of all the micro-batch's tiles in order (the model scatters them over the image tokens in order);
    # every tile is a full square, so the pixel mask is all ones.
    return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}


# --- Mistral 3 (Pixtral's layout) --------------------------------------------------------------------------------

def _pixtral_grid(processor: Any, settings: Mapping[str, Any], height: int, width: int) -> list[int]:
    """[rows, cols] of the image's merged patches: PixtralImageProcessorPil's resize (within size, each side up to
    whole patches of patch_size x spatial_merge_size, the patch size PixtralProcessor passes it)."""
    import numpy as np
    from transformers.image_utils import ChannelDimension
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    if not processor.do_resize or processor.do_center_crop:  # the processed size would not be the resize rule's
        raise UserError("model.image_processor: mistral3 is laid out for do_resize: true and do_center_crop: false "
                        "(the processor's own settings)")
    size, patch = processor.size, settings["patch_size"]
    if size.get("longest_edge"):
        bound = (size["longest_edge"], size["longest_edge"])
    elif size.get("height") and size.get("width"):
        bound = (size["height"], size["width"])
    else:
        raise UserError(f"model.image_processor: mistral3's size must be {{longest_edge: N}} (it is {size})")
    shape = np.broadcast_to(np.zeros((), np.uint8), (3, height, width))  # only its shape is read: no memory
    resized = get_resize_output_image_size(shape, size=bound, patch_size=(patch, patch),
                                           input_data_format=ChannelDimension.FIRST)
    return [resized[0] // patch, resized[1] // patch]


def _pixtral_count(processor: Any, settings: Mapping[str, Any], height: int, width: int) -> int:
    rows, cols = _pixtral_grid(processor, settings, height, width)
    return rows * cols


def _pixtral_text(settings: Mapping[str, Any], grid: list[int]) -> str:
    # PixtralProcessor.replace_image_token: a row of [IMG] per row of merged patches, each ended by [IMG_BREAK], the
    # last one by [IMG_END] instead.
    rows, cols = grid
    return ("[IMG]" * cols + "[IMG_BREAK]") * (rows - 1) + "[IMG]" * cols + "[IMG_END]"


def _pixtral_grids(processor: Any, settings: Mapping[str, Any], out: Any) -> list[list[int]]:
    patch = settings["patch_size"]
    return [[height // patch, width // patch] for height, width in out["image_sizes"].tolist()]


def _pixtral_processed(processor: Any, settings: Mapping[str, Any], out: Any) -> list[int]:
    return [rows * cols for rows, cols in _pixtral_grids(processor, settings, out)]


def _pixtral_inputs(out: Any, input_ids: torch.Tensor, image_id: int) -> dict[str, torch.Tensor]:
    # The images padded to the micro-batch's largest; image_sizes says how much of each the tower reads.
    return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}


_FAKE = "<fake_token_around_image>"
_QWEN_VL = Family("<|image_pad|>", "<|image_pad|>", ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                     "<|video_pad|>"),
                  _qwen_count, _qwen_processed, _qwen_inputs, before="<|vision_start|>", after="<|vision_end|>")
_LLAVA = Family("<image>", "<image>", ("<image>",), _llava_count, _llava_processed, _llava_inputs)
_GEMMA3 = Family("<start_of_image>", "<image_soft_token>", ("<start_of_image>", "<end_of_image>",
                                                            "<image_soft_token>"),
                 _gemma3_count, _gemma3_processed, _gemma3_inputs, before="<start_of_image>", after="<end_of_image>",
                 prefix="\n\n<start_of_image>", suffix="<end_of_image>\n\n")
_SMOLVLM = Family("<image>", "<image>", (_FAKE, "<global-img>", "<image>"), _smolvlm_count, _smolvlm_processed,
                  _smolvlm_inputs, grid=_smolvlm_grid, processed_grids=_smolvlm_grids, text=_smolvlm_text)
_PIXTRAL = Family("[IMG]", "[IMG]", ("[IMG]", "[IMG_BREAK]", "[IMG_END]"), _pixtral_count, _pixtral_processed,
                  _pixtral_inputs, grid=_pixtral_grid, processed_grids=_pixtral_grids, text=_pixtral_text)
FAMILIES = {"qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL, "qwen3_vl": _QWEN_VL, "llava": _LLAVA, "gemma3": _GEMMA3,
            "smolvlm": _SMOLVLM, "mistral3": _PIXTRAL}
