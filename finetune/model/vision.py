"""Vision-language models: which ones finetune trains, their image processor and layout, what trains in them.

A model is loaded as an image-text-to-text model (AutoModelForImageTextToText) when its model_type is one of
SUPPORTED (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, LLaVA, Gemma 3, SmolVLM, Mistral 3), each checked like the text models
(tests/model/test_vision_model.py): the fused loss over the language model's head equals the model's own loss and gradients, the token layout equals what the
model's processor writes, and gradient accumulation is exact with images of different sizes. Every other
image-text-to-text architecture of the pinned transformers that the causal-LM path cannot load is refused when it
loads, with the reason (`refusal`). docs/vision.md says what is supported. A gemma3 config without a vision tower of
its own (transformers fills in a default one) stays a text model, as before (`family`).

The image processor is the model's own (preprocessor_config.json, through its Pillow/numpy class: torchvision stays
out of the dependencies), or with init: random the family's class made from model.config's vision_config (Qwen:
patch, merge and temporal sizes; LLaVA, Gemma 3, SmolVLM, Mistral 3: the tower's image size), with model.image_processor over
either. It is attached to the tokenizer as an image
layout (finetune/data/images.py), which preprocessing and collate read.

What trains: the language model and the projector that feeds it; the vision encoder too only with
model.freeze_vision: false (full fine-tuning). A LoRA goes on the language model only, unless
adapter.target_modules is a regular expression (it then reaches whatever it matches, vision modules included).
QLoRA quantizes the language model's linear layers to 4-bit NF4 and keeps the vision encoder and projector as they
are (quantization_skips); its LoRA goes where a LoRA goes.
Packing is allowed for the families whose packed documents are shown to equal themselves alone (LLaVA, SmolVLM:
architectures.VLM_PACKED) and refused for the others with the reason (architectures.packing_refusal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune.data.images import attach, layout_for, make_layout
from finetune.errors import UserError, first_line
from finetune.model.config_overrides import apply_overrides
from finetune.recipe import AdapterConfig, ModelConfig


@dataclass(frozen=True)
class VisionModel:
    """What finetune knows of one supported VLM family: its layout family (data/image_families.py), its image
    processor's Pillow class, where its vision encoder and projector are, the config's token id fields with their
    tokens, the processor's settings for a random-init model, and what the layout needs from the config."""

    layout: str
    processor_class: str
    tower: str
    projector: tuple[str, ...]
    """The modules that carry the tower's features into the language model (Qwen3-VL: its merger and DeepStack
    mergers), trained with the language model."""
    token_ids: tuple[tuple[str, str], ...]
    random_processor: Callable[[Any], dict[str, Any]]
    layout_settings: Callable[[Any], dict[str, Any]] = lambda config: {}
    head_softcap: bool = True
    """Whether the model's forward applies its text config's final_logit_softcapping to the logits."""
    processor_fixed: Callable[[Any], dict[str, Any]] = lambda config: {}
    """Image processor settings the layout needs, from the model's config, over the model's processor (SmolVLM: the
    tile grid; Mistral 3: the merged patch size its processor class passes); a recipe's other value is refused."""


def _qwen_processor(config: Any) -> dict[str, Any]:
    vision = config.vision_config
    return {"patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size,
            "temporal_patch_size": vision.temporal_patch_size}


def _qwen3_processor(config: Any) -> dict[str, Any]:
    # Qwen3-VL's checkpoints normalize to [-1, 1] (preprocessor_config.json), not with CLIP's mean and std.
    return {**_qwen_processor(config), "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


def _llava_processor(config: Any) -> dict[str, Any]:
    side = config.vision_config.image_size
    return {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}


def _llava_settings(config: Any) -> dict[str, Any]:
    # CLIP towers put a CLS token before the patches; the default strategy drops the first feature either way.
    vision = config.vision_config
    return {"patch_size": vision.patch_size, "cls_tokens": int(vision.model_type == "clip_vision_model"),
            "strategy": config.vision_feature_select_strategy}


def _gemma3_processor(config: Any) -> dict[str, Any]:
    side = config.vision_config.image_size
    return {"size": {"height": side, "width": side}}


def _gemma3_settings(config: Any) -> dict[str, Any]:
    # Each image is mm_tokens_per_image features (the projector pools the tower's patches to that many).
    vision = config.vision_config
    return {"tokens": config.mm_tokens_per_image, "image_size": vision.image_size, "patch_size": vision.patch_size}


def _smolvlm_processor(config: Any) -> dict[str, Any]:
    side = config.vision_config.image_size  # tiles of the tower's size, images up to 4 x 4 of them (the default)
    return {"size": {"longest_edge": 4 * side}, "max_image_size": {"longest_edge": side}}


def _smolvlm_settings(config: Any) -> dict[str, Any]:
    # image_seq_len: a tile's patches, pixel-shuffled by scale_factor**2 into fewer, wider features (SmolVLMConnector).
    vision = config.vision_config
    tokens = int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor ** 2)
    return {"tokens": tokens, "image_size": vision.image_size}


def _pixtral_processor(config: Any) -> dict[str, Any]:
    # Images within the tower's image_size (its rotary table's extent), as Mistral's checkpoints set it.
    vision = config.vision_config
    return {"size": {"longest_edge": vision.image_size}, "patch_size": {"height": vision.patch_size,
                                                                         "width": vision.patch_size}}


def _pixtral_settings(config: Any) -> dict[str, Any]:
    # One [IMG] per spatial_merge_size x spatial_merge_size patches (Mistral3PatchMerger).
    return {"patch_size": config.vision_config.patch_size * config.spatial_merge_size}


def _pixtral_fixed(config: Any) -> dict[str, Any]:
    # PixtralProcessor calls its image processor with this patch size, whatever preprocessor_config.json says: the
    # image is resized to whole merged patches.
    patch = _pixtral_settings(config)["patch_size"]
    return {"patch_size": {"height": patch, "width": patch}}


_QWEN_IDS = (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
             ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))
SUPPORTED = {
    "qwen2_vl": VisionModel("qwen2_vl", "Qwen2VLImageProcessorPil", "model.visual", ("model.visual.merger",),
                            _QWEN_IDS, _qwen_processor),
    "qwen2_5_vl": VisionModel("qwen2_5_vl", "Qwen2VLImageProcessorPil", "model.visual", ("model.visual.merger",),
                              _QWEN_IDS, _qwen_processor),
    # Qwen3-VL's DeepStack mergers project intermediate tower layers into the first decoder layers' hidden states:
    # projectors, like its merger (they train with freeze_vision and stay out of a LoRA by names).
    **{name: VisionModel("qwen3_vl", "Qwen2VLImageProcessorPil", "model.visual",
                         ("model.visual.merger", "model.visual.deepstack_merger_list"), _QWEN_IDS, _qwen3_processor)
       for name in ("qwen3_vl", "qwen3_vl_moe")},
    "llava": VisionModel("llava", "LlavaImageProcessorPil", "model.vision_tower", ("model.multi_modal_projector",),
                         (("image_token_id", "<image>"),), _llava_processor, _llava_settings),
    # Gemma3ForConditionalGeneration applies no final_logit_softcapping (Gemma3ForCausalLM does): head_softcap off.
    "gemma3": VisionModel("gemma3", "Gemma3ImageProcessorPil", "model.vision_tower", ("model.multi_modal_projector",),
                          (("image_token_id", "<image_soft_token>"), ("boi_token_id", "<start_of_image>"),
                           ("eoi_token_id", "<end_of_image>")), _gemma3_processor, _gemma3_settings,
                          head_softcap=False),
    "smolvlm": VisionModel("smolvlm", "SmolVLMImageProcessorPil", "model.vision_model", ("model.connector",),
                           (("image_token_id", "<image>"),), _smolvlm_processor, _smolvlm_settings,
                           processor_fixed=lambda config: {"return_row_col_info": True}),
    "mistral3": VisionModel("mistral3", "PixtralImageProcessorPil", "model.vision_tower",
                            ("model.multi_modal_projector",), (("image_token_id", "[IMG]"),), _pixtral_processor,
                            _pixtral_settings, processor_fixed=_pixtral_fixed),
}
# Why some are refused, where it is more than "not checked yet".
_REASONS = {
    "idefics": "its images enter through cross-attention layers, not as tokens in the sequence",
    "vision-encoder-decoder": "it is an encoder-decoder model, not a decoder reading image tokens",
}


def family(config: Any) -> VisionModel | None:
    """The supported VLM family of this config, None for any other model (a gemma3 config without a vision tower of
    its own is a text model, as before)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3" and not _own_tower(config):
        return None
    return SUPPORTED.get(model_type)


# What a SigLIP tower's shape is made of: a gemma3 vision_config equal to transformers' default in all of them is one
# nobody wrote (Gemma3Config fills it in when none is given, and saves it so).
_TOWER_SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size", "num_channels")


def _own_tower(config: Any) -> bool:
    """Whether a gemma3 config names its vision tower: with none (a text-only recipe's model.config, or a config.json
    without vision_config) transformers builds its default SigLIP, and finetune keeps training the model as text."""
    from transformers import SiglipVisionConfig

    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(vision, "model_type", None) != "siglip_vision_model":
        return vision is not None
    default = SiglipVisionConfig()
    return any(getattr(vision, key, None) != getattr(default, key) for key in _TOWER_SHAPE)


def support(model_type: str) -> str:
    """How finetune takes an image-text-to-text model_type, in a sentence (docs/models.md): trained as a
    vision-language model, loaded as a text model (transformers maps it to a causal LM too), or refused, and why."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in SUPPORTED:
        return "trained with images (docs/vision.md)"
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return ("loaded as a causal LM, as transformers maps it too (not checked: out of the matrix above); rows with "
                "images are refused")
    return "refused when it loads: " + _REASONS.get(model_type, "its image layout, its loss through the fused head "
                                                               "and its image processor without torchvision are not "
                                                               "checked yet")


def refusal(config: Any) -> str | None:
    """Why this image-text-to-text model is not trained (a message), None when it is supported or not one."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED:
        # A MoE language model (qwen3_vl_moe) adds its router's load-balancing loss to the cross-entropy when asked;
        # the fused loss adds it for text models only (model/router_loss.py: a VLM's forward reads its text_config's
        # settings, not checked here), and architectures.loss_refusal reads the top-level config only.
        if getattr(getattr(config, "text_config", None), "output_router_logits", False):
            return (f"model.config.text_config.output_router_logits is true: {model_type} would add its router "
                    "load-balancing loss to the cross-entropy, which the fused loss adds for text models only "
                    "(docs/models.md). Set it to false (the router is still trained through the cross-entropy)")
        return None
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None  # loaded as a causal LM, as before; rows with images are refused when they are tokenized
    why = support(model_type).removeprefix("refused when it loads: ")
    return (f"model_type {model_type!r} is an image-text-to-text model finetune does not train yet: {why}. "
            f"Supported: {', '.join(SUPPORTED)} (docs/vision.md)")


def text_config(config: Any) -> Any:
    """The language model's config of a supported VLM (where its head's settings are), else the config itself."""
    return config.text_config if family(config) is not None else config


def head_softcapped(config: Any) -> bool:
    """Whether the model's own head soft-caps its logits by the text config's final_logit_softcapping (a text model:
    architectures.head_spec decides)."""
    vlm = family(config)
    return vlm is None or vlm.head_softcap


def model_config(cfg: ModelConfig) -> Any | None:
    """The config model.path or model.config gives, or None when there is none to read (GGUF, no path)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if cfg.config:
        values = dict(cfg.config)
        model_type = values.pop("model_type", None)
        if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return None  # text models are configured by loading.py
        try:
            return AutoConfig.for_model(model_type, **values)
        except Exception:  # noqa: BLE001 - a bad model.config: loading.py words the error
            return None
    if not cfg.path or cfg.gguf_file or cfg.path.endswith(".gguf") or cfg.path.startswith("pkg://"):
        return None
    try:
        config = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        return None  # loading the model says why
    return apply_overrides(config, cfg.config_overrides)  # its refusals see them (output_router_logits: false)


# --- the image processor and the layout ------------------------------------------------------------------------

def attach_layout(tokenizer: Any, cfg: ModelConfig) -> None:
    """When model.path (or model.config) is a supported VLM: its image processor and token layout, attached to the
    tokenizer (data/images.py); nothing for a text model. A UserError for an unsupported VLM."""
    config = model_config(cfg)
    if config is None:
        return
    why = refusal(config)
    if why:
        raise UserError(why)
    vlm = family(config)
    if vlm is None:
        return
    attach(tokenizer, make_layout(vlm.layout, _image_processor(cfg, config, vlm), tokenizer,
                                  vlm.layout_settings(config)))


def _image_processor(cfg: ModelConfig, config: Any, vlm: VisionModel) -> Any:
    import transformers

    fixed = vlm.processor_fixed(config)
    for key, value in cfg.image_processor.items():
        if key in fixed and value != fixed[key]:
            raise UserError(f"model.image_processor.{key}: {config.model_type}'s layout needs {fixed[key]!r} (from the "
                            f"model's config), not {value!r}; leave it out")
    overrides = {**dict(cfg.image_processor), **fixed}
    try:
        if cfg.init == "random" or not cfg.path:
            return getattr(transformers, vlm.processor_class)(**{**vlm.random_processor(config), **overrides})
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(cfg.path, backend="pil", **overrides)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"model.image_processor: the image processor of {cfg.path or config.model_type} could not "
                        f"be made ({type(e).__name__}: {first_line(e)})") from None


def random_config(config: Any, values: dict[str, Any], tokenizer: Any) -> Any:
    """A supported VLM's config for random init: the language model's vocabulary the tokenizer's (unless
    model.config.text_config sets it), its special and vision token ids the tokenizer's."""
    vlm = family(config)
    text = config.text_config
    if "vocab_size" not in (values.get("text_config") or {}):
        text.vocab_size = len(tokenizer)
    if text.vocab_size < len(tokenizer):
        raise UserError(f"model.config.text_config.vocab_size {text.vocab_size} is smaller than the tokenizer's "
                        f"{len(tokenizer)} tokens")
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(text, name, getattr(tokenizer, name))
    for field, token in vlm.token_ids:
        found = tokenizer.convert_tokens_to_ids(token)
        given = field in values or config.attribute_map.get(field) in values  # gemma3: image_token_index
        if not given and found is not None and tokenizer.convert_ids_to_tokens(found) == token:
            setattr(config, field, found)
    return config


def check_token_ids(model: torch.nn.Module, tokenizer: Any) -> None:
    """The model's image token ids are the tokenizer's: else the model would look for its image features at other
    tokens than the layout put them."""
    vlm = family(model.config)
    for field, token in vlm.token_ids if vlm else ():
        found = tokenizer.convert_tokens_to_ids(token)
        want = getattr(model.config, field, None)
        if found is not None and tokenizer.convert_ids_to_tokens(found) == token and want != found:
            raise UserError(f"model.config.{field} is {want} and the tokenizer's {token} is {found}: use the model's "
                            "own tokenizer")


# --- what trains -----------------------------------------------------------------------------------------------

def _tower_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the vision encoder's modules, the projector's left out."""
    vlm = family(model.config)
    if vlm is None:
        return []
    return [(name, module) for name, module in model.named_modules()
            if _under(name, (vlm.tower,)) and not _under(name, vlm.projector)]


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module `name` is one of `prefixes` or inside one."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def freeze_tower(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """model.freeze_vision (full fine-tuning): the vision encoder's parameters do not train; its projector does."""
    if cfg.freeze_vision:
        for _, module in _tower_modules(model):
            for param in module.parameters(recurse=False):
                param.requires_grad_(False)


def lora_exclusions(model: torch.nn.Module, adapter: AdapterConfig) -> list[str]:
    """The full names of the vision side's linear layers (encoder and projector), which a LoRA given by names or
    all-linear leaves alone; none when adapter.target_modules is a regular expression (it says what it means)."""
    vlm = family(model.config)
    if vlm is None or (isinstance(adapter.target_modules, str) and adapter.target_modules != "all-linear"):
        return []
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
            and _under(name, (vlm.tower, *vlm.projector))]


def quantization_skips(config: Any) -> list[str]:
    """The modules a QLoRA base keeps unquantized in a supported VLM: its vision encoder and projector (small next to
    the language model, and 4-bit rounding there would blur every image feature; Unsloth too keeps projectors and
    vision towers unquantized, Axolotl passes no skips and rounds them), and its output layer `lm_head` (every
    family's), which the fused loss reads: naming any skip replaces transformers' defaults, which keep it. Only the
    language model's linear layers are 4-bit. None for any other model."""
    vlm = family(config) if config is not None else None
    return [vlm.tower, *vlm.projector, "lm_head"] if vlm is not None else []


def backbone(model: torch.nn.Module) -> torch.nn.Module | None:
    """The multimodal backbone of a supported VLM (vision encoder, projector and language model, whose last hidden
    state the head reads), None for any other model."""
    return getattr(model, "model", None) if family(model.config) is not None else None


def save_processor(tokenizer: Any, out_dir: Any) -> None:
    """A VLM run's image processor beside its tokenizer in final/ (preprocessor_config.json)."""
    layout = layout_for(tokenizer)
    if layout is not None:
        layout.processor.save_pretrained(out_dir)
