"""Rules for Axolotl's vision-language configs: `processor_type` set, Axolotl's multimodal path (keys.MAPPED
documents them; docs/vision.md says what finetune trains).

Axolotl's multimodal collator (MultiModalChatDataCollator with a ProcessingStrategy) reads every row as chat
messages, neither truncates nor drops a sample (sequence_len is not read), refuses packing, and masks by role only
for the chat templates whose strategy declares role markers; every other strategy trains every token but padding
and the image token. Images in the messages' parts go to the processor as they are; an `images`/`image`
column's first image is resized (image_size) and put in the first bare image part; finetune reads the column
(datasets[].images_field) and refuses a row whose image parts and images differ in number. Its full fine-tuning trains the
vision encoder unless freeze_mm_modules, which freezes every module whose name has one of _MM_MODULES as a part.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

from finetune.convert.context import Conversion, is_off

# Axolotl's chat templates whose processing strategy masks by role (processing_strategies.py: the classes with
# _build_role_boundaries); with any other template the base strategy trains every token but padding and images.
ROLE_MARKED = frozenset(("qwen2_vl", "qwen3_5", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "llama3_2_vision",
                         "llama4", "pixtral", "mistral_v7_tekken"))
# What freeze_mm_modules freezes: a parameter with one of these as a part of its dotted name (utils/freeze.py).
_MM_MODULES = ("vision_tower", "vision_model", "vision_encoder", "embed_vision", "multi_modal_projector", "visual",
               "audio_tower", "audio_model", "embed_audio")
# Matched at the start of a name (re.match, PEFT's re.fullmatch): the names freeze_mm_modules leaves alone.
OUTSIDE_MM = r"(?!(?:.*\.)?(?:" + "|".join(_MM_MODULES) + r")(?:\.|$))"
_AUDIO = ("Voxtral", "Whisper", "Audio", "Speech", "Wav2Vec")
# The image processor's own settings (transformers' image processors), which model.image_processor sets.
_IMAGE_SETTINGS = frozenset(("min_pixels", "max_pixels", "size", "crop_size", "do_resize", "do_center_crop",
                             "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                             "do_convert_rgb", "patch_size", "merge_size", "temporal_patch_size"))
# Dataset keys the multimodal collator never reads: it takes role and content (or ShareGPT's from and value) as is.
_UNREAD = ("message_property_mappings", "message_field_role", "message_field_content", "roles",
           "message_field_training", "field_thinking", "template_thinking_key", "train_on_eot")
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_ROLES = ("system", "user", "assistant")


def is_vision(c: Conversion) -> bool:
    """Whether the config takes Axolotl's multimodal path (processor_type set)."""
    return isinstance(c.get("processor_type"), str) and not is_off(c.get("processor_type"))


def vision_rules(c: Conversion) -> None:
    """processor_type, processor_kwargs, role_boundaries, freeze_mm_modules; QLoRA and the LoRA targets of a
    vision-language model. After the adapter and unfrozen_parameters rules, whose results it adjusts."""
    if not is_vision(c):
        c.text("processor_type")  # a wrong type is a problem
        for key in ("processor_kwargs", "role_boundaries"):
            if c.has(key):
                c.drop(key, "read by Axolotl's multimodal path only (processor_type)")
        if c.boolean("freeze_mm_modules"):
            c.drop("freeze_mm_modules", "without processor_type finetune loads a text model, without vision or "
                                        "audio modules: nothing to freeze")
        return
    name = c.text("processor_type")
    if not name.endswith("Processor"):
        c.refuse("processor_type", f"{name!r}: Axolotl expects a transformers processor class (AutoProcessor)")
    elif any(word in name for word in _AUDIO):
        c.refuse("processor_type", f"{name}: audio models are not supported (finetune trains text and image-text "
                                   "models)")
    c.note(f"processor_type {name}: a vision-language model, loaded with AutoModelForImageTextToText and its own "
           "image processor; finetune trains the families docs/vision.md lists and refuses the others when the "
           "model loads. Images are read from local files named in the messages' image parts ({type: image, path: "
           "...}); a message's `train` flag, which Axolotl's multimodal collator ignores, is honoured here")
    _processor_kwargs(c)
    if c.has("role_boundaries"):
        c.approximate("role_boundaries", "finetune finds each message in the chat template's rendering, not by "
                                         "these markers (the same turns when they are the template's own)")
    if c.peek("train.objective", "sft") != "sft":
        c.refuse("rl", "preference and RL training with images is not supported yet; finetune trains "
                       "vision-language models with SFT (docs/vision.md)")
    if c.peek("adapter.type") is None:
        _full_finetuning(c)
    else:
        _adapter(c)


def _processor_kwargs(c: Conversion) -> None:
    kwargs = c.mapping("processor_kwargs")
    if not kwargs:
        return
    other = sorted(set(kwargs) - _IMAGE_SETTINGS)
    if other:
        c.refuse("processor_kwargs", f"{', '.join(other)}: finetune sets the image processor's own settings only "
                                     f"(model.image_processor: {', '.join(sorted(_IMAGE_SETTINGS))})")
    else:
        c.put("model.image_processor", dict(kwargs))


def _full_finetuning(c: Conversion) -> None:
    """Axolotl trains every parameter but those freeze_mm_modules (then unfrozen_parameters) freezes."""
    if not c.boolean("freeze_mm_modules"):
        c.default("model.freeze_vision", False, "Axolotl trains the vision encoder too, freeze_mm_modules unset")
        return
    patterns = c.peek("train.trainable_parameters") or [""]
    c.put("train.trainable_parameters", [OUTSIDE_MM + p for p in patterns])


def _adapter(c: Conversion) -> None:
    """QLoRA stays QLoRA, its vision side unquantized (approximated); the targets reach what PEFT reaches under
    Axolotl: names match in the vision modules too, unless freeze_mm_modules freezes whatever lands there."""
    if c.peek("adapter.type") == "qlora":
        # Axolotl's BitsAndBytesConfig names no llm_int8_skip_modules for a VLM (loaders/model.py), so transformers'
        # default quantizes every linear layer but the output layer, the vision encoder's and projector's included.
        c.approximate("adapter" if c.text("adapter") == "qlora" else "load_in_4bit",
                      "QLoRA with the vision encoder and projector unquantized: finetune rounds only the language "
                      "model's linear layers to 4-bit NF4; Axolotl's (transformers' default) rounds the vision "
                      "side's too")
    freeze = bool(c.boolean("freeze_mm_modules"))
    targets = c.peek("adapter.target_modules")
    if targets is None and not freeze and c.boolean("lora_target_linear"):
        c.approximate("lora_target_linear", "LoRA on the language model's linear layers only (all-linear); "
                      "Axolotl's also reaches the vision encoder's and projector's (freeze_mm_modules: true freezes "
                      "those, as here)")
    elif isinstance(targets, list) and not freeze:
        # PEFT takes a name as the module's name or its last parts: the same modules as this expression.
        c.put("adapter.target_modules", r"(?:.*\.)?(?:" + "|".join(map(re.escape, targets)) + ")")
    elif isinstance(targets, str) and freeze:
        c.put("adapter.target_modules", OUTSIDE_MM + f"(?:{targets})")


def vision_data(c: Conversion) -> None:
    """sequence_len, sample_packing, excess_length_strategy as the multimodal collator reads them."""
    c.integer("sequence_len", minimum=1)
    c.put("data.max_seq_len", None)
    c.note("data.max_seq_len: null: Axolotl's multimodal collator neither truncates nor drops a sample "
           "(sequence_len is not read)")
    if c.boolean("sample_packing"):
        c.refuse("sample_packing", "packing is refused for vision-language models by Axolotl's multimodal collator "
                                   "and by finetune; set sample_packing: false")
    c.put("data.packing", False)
    if c.has("excess_length_strategy"):
        c.drop("excess_length_strategy", "Axolotl's multimodal collator neither truncates nor drops a sample")


def vision_dataset(c: Conversion, where: str, entry: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A chat_template entry as the multimodal collator reads it: its messages field, the masking of the first
    training dataset (the collator's), no `system` column (it prepends none)."""
    out["format"] = "chat"
    if entry.get("field_messages") not in (None, "messages"):
        out["messages_field"] = str(entry["field_messages"])
    for name in _UNREAD:
        if entry.get(name) is not None:
            c.drop(f"{where}.{name}", "Axolotl's multimodal collator does not read it (a message's role and content, "
                                      "or from and value, as they are)")
    out.update(_masking(c, where, entry))
    path = PurePosixPath(out["path"])
    if path.suffix not in _LOCAL_SUFFIXES and not out["path"].startswith(("/", ".", "~")):
        c.note(f"{where}: {out['path']} is read as a hub dataset (not a .jsonl, .json, .parquet or .csv file); "
               "finetune takes a row's images from its `images` column (set datasets[].images_field: image for an "
               "`image` column), one per bare image part, all of them (Axolotl uses the first only); URLs and "
               "base64 images are not read (such rows are bad rows, each named) (docs/vision.md)")
    return out


def _masking(c: Conversion, where: str, entry: dict[str, Any]) -> dict[str, Any]:
    first = where == "datasets.0"
    template = c.get("chat_template") if isinstance(c.get("chat_template"), str) else None  # a wrong type: its rule
    if c.boolean("train_on_inputs"):
        return {"train_on_inputs": True}  # the collator then trains every token but padding and images
    if template not in ROLE_MARKED:
        if first:
            c.note(f"Axolotl's multimodal collator has no role markers for chat_template {template or '(unset)'}: "
                   "it trains every token but padding and the image token (unless the model is PaddleOCR-VL), as "
                   "train_on_inputs: true does here (which, unlike Axolotl, leaves an image's marker tokens such as "
                   "Qwen's <|vision_start|> untrained too)")
        for name in ("roles_to_train", "train_on_eos"):
            if entry.get(name) is not None:
                c.drop(f"{where}.{name}", f"not read by Axolotl's multimodal collator for chat_template {template}")
        return {"train_on_inputs": True}
    if not first:
        for name in ("roles_to_train", "train_on_eos"):
            if entry.get(name) is not None:
                c.drop(f"{where}.{name}", "Axolotl's multimodal collator takes it from the first dataset")
    datasets = c.get("datasets")
    source = datasets[0] if isinstance(datasets, list) and datasets and isinstance(datasets[0], dict) else entry
    roles, eos = source.get("roles_to_train"), source.get("train_on_eos")
    if first and eos not in (None, "turn"):
        c.approximate(f"{where}.train_on_eos", f"{eos}: finetune trains the end-of-turn marker of each trained turn "
                                               "(Axolotl's turn)")
    if roles is None or roles == ["assistant"]:
        return {}
    if not isinstance(roles, list) or not roles or any(r not in _ROLES for r in roles):
        if first:
            c.refuse(f"{where}.roles_to_train", f"{roles!r}: a non-empty list of system, user, assistant")
        return {}
    return {"roles_to_train": list(dict.fromkeys(roles))}
