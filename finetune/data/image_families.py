"""What each supported vision-language family does with an image, in one table (docs/vision.md).

For a family: the placeholder its chat template writes per image, the token its processor repeats once per image
feature, the vision tokens that are never trained, how many features an image of a given height and width gets
(the processor's own resize rule, from the size alone), how many the processed pixels give (checked in collate:
the two must agree), and the model's keyword inputs made from the processed images.

Qwen2-VL / Qwen2.5-VL: `smart_resize` to multiples of patch_size x merge_size within min/max_pixels, one feature
per merge_size**2 patches (Qwen2VLProcessor.replace_image_token). LLaVA: the processor resizes and center-crops to
crop_size, one feature per patch, plus the vision tower's CLS token, less one with the `default` feature select
strategy (LlavaProcessor.replace_image_token).
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
    processor writes `before + image_token * n + after` in its place (n: the image's features)."""

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

    def expansion(self, n: int) -> str:
        """What the processor writes in place of the placeholder for an image of n features."""
        return self.image_token * n


# --- Qwen2-VL, Qwen2.5-VL --------------------------------------------------------------------------------------

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


_QWEN_VL = Family("<|image_pad|>", "<|image_pad|>", ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                     "<|video_pad|>"),
                  _qwen_count, _qwen_processed, _qwen_inputs, before="<|vision_start|>", after="<|vision_end|>")
_LLAVA = Family("<image>", "<image>", ("<image>",), _llava_count, _llava_processed, _llava_inputs)
FAMILIES = {"qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL, "llava": _LLAVA}
