"""What each supported vision-language family does with an image, in one table (docs/vision.md).

For a family: the placeholder its chat template writes per image, the token its processor repeats once per image
feature, the vision tokens that are never trained, how many features an image of a given height and width gets
(the processor's own resize rule, from the size alone), how many the processed pixels give (checked in collate:
the two must agree), and the model's keyword inputs made from the processed images.

Qwen2-VL / Qwen2.5-VL: `smart_resize` to multiples of patch_size x merge_size within min/max_pixels, one feature
per merge_size**2 patches (Qwen2VLProcessor.replace_image_token). LLaVA: the processor resizes and center-crops to
crop_size, one feature per patch, plus the vision tower's CLS token, less one with the `default` feature select
strategy (LlavaProcessor.replace_image_token). Gemma 3: the template writes `<start_of_image>`, the processor
writes "\n\n<start_of_image>" + `<image_soft_token>` x mm_tokens_per_image + "<end_of_image>\n\n" in its place
(Gemma3Processor.full_image_sequence): every image resized to the SigLIP tower's square, pan-and-scan refused.
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
    processor writes `prefix + image_token * n + suffix` in its place (n: the image's features)."""

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

    def expansion(self, n: int) -> str:
        """What the processor writes in place of the placeholder for an image of n features."""
        return self.prefix + self.image_token * n + self.suffix


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


_QWEN_VL = Family("<|image_pad|>", "<|image_pad|>", ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                     "<|video_pad|>"),
                  _qwen_count, _qwen_processed, _qwen_inputs, before="<|vision_start|>", after="<|vision_end|>")
_LLAVA = Family("<image>", "<image>", ("<image>",), _llava_count, _llava_processed, _llava_inputs)
_GEMMA3 = Family("<start_of_image>", "<image_soft_token>", ("<start_of_image>", "<end_of_image>",
                                                            "<image_soft_token>"),
                 _gemma3_count, _gemma3_processed, _gemma3_inputs, before="<start_of_image>", after="<end_of_image>",
                 prefix="\n\n<start_of_image>", suffix="<end_of_image>\n\n")
FAMILIES = {"qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL, "llava": _LLAVA, "gemma3": _GEMMA3}
