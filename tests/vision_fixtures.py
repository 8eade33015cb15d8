"""Tiny vision-language models and image rows for the tests: random Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) /
LLaVA / Gemma 3 / SmolVLM / Mistral 3 configs over the quickstart tokenizer (with each family's vision tokens added),
small generated images of different sizes."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tokenizer"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 100.0}}
TEXT3 = {**{k: v for k, v in TEXT.items() if k != "rope_scaling"}, "head_dim": 16,
         "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True}}
QWEN3_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0]}
LLAVA_TOKENS = ["<image>"]
# ChatML with image parts written as LLaVA's placeholder (a template of this project's, for the tests).
LLAVA_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                  "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}"
                  "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOLVLM_TOKENS = ["<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>",
                  *[f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]]
# SmolVLMProcessor's own template (DEFAULT_CHAT_TEMPLATE, its video part left out), which writes <image> for an
# image, with string contents written too (the original iterates a string's characters and writes nothing).
SMOLVLM_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] "
                    "is not string and message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
                    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for line in "
                    "message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == "
                    "'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
                    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# ChatML with image parts written as Mistral's templates write them: [IMG], nothing around it.
MISTRAL3_TEMPLATE = LLAVA_TEMPLATE.replace("<image>\n", "[IMG]")
GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"model_type": "qwen2_vl", "text_config": TEXT,
                 "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 8,
                                   "spatial_merge_size": 2, "temporal_patch_size": 2, "mlp_ratio": 2}},
    "qwen2_5_vl": {"model_type": "qwen2_5_vl", "text_config": TEXT,
                   "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                     "out_hidden_size": 64, "patch_size": 8, "spatial_merge_size": 2,
                                     "temporal_patch_size": 2, "window_size": 32, "fullatt_block_indexes": [1]}},
    # Qwen3-VL: the same layout as Qwen2-VL; interleaved M-RoPE over head_dim 16, a learned 4x4 position grid
    # resampled to each image's, one DeepStack merger (tower layer 0 into decoder layer 0).
    "qwen3_vl": {"model_type": "qwen3_vl", "text_config": TEXT3, "vision_config": QWEN3_VISION},
    # Its MoE: 4 experts, 2 per token, in both decoder layers.
    "qwen3_vl_moe": {"model_type": "qwen3_vl_moe", "vision_config": QWEN3_VISION,
                     "text_config": {**TEXT3, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}},
    # CLIP tower on 32x32 crops: 16 patches + CLS, less one (the default strategy): 16 image tokens per image.
    "llava": {"model_type": "llava",
              "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                                "projection_dim": 32}},
    # SigLIP tower on 32x32 images: 16 patches pooled 2x2 to mm_tokens_per_image 4. A sliding layer narrower than
    # the rows and a full one; a final soft-cap small enough to change a random model's logits (which are near 0),
    # which Gemma3ForConditionalGeneration does not apply.
    "gemma3": {"model_type": "gemma3", "mm_tokens_per_image": 4,
               "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                               "query_pre_attn_scalar": 16, "sliding_window": 24, "final_logit_softcapping": 0.05,
                               "layer_types": ["sliding_attention", "full_attention"]},
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32,
                                 "patch_size": 8}},
    # SmolVLM tower on 32x32 tiles: 16 patches, pixel-shuffled by scale_factor 2 into 4 features per tile; images up
    # to 64 pixels on their longest edge (image_processor below), so 2 x 2 tiles at most, plus the global image.
    "smolvlm": {"model_type": "smolvlm", "scale_factor": 2,
                "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
                "vision_config": {"model_type": "smolvlm_vision", "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32,
                                  "patch_size": 8}},
    # Pixtral tower (patch 8, images up to 64 pixels a side), 2 x 2 patches merged into each [IMG]: 16 x 16 pixels a
    # token, at most 4 x 4 per image, each row ended by [IMG_BREAK], the last by [IMG_END].
    "mistral3": {"model_type": "mistral3", "spatial_merge_size": 2,
                 "text_config": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 16},
                 "vision_config": {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
                                   "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64,
                                   "patch_size": 8}},
}
SMOLVLM_PROCESSOR = {"size": {"longest_edge": 64}}
# 16 x 16 pixels make one image token (patch 8, merge 2); at most 64 x 64 pixels (16 tokens) per image.
IMAGE_PROCESSOR = {"min_pixels": 256, "max_pixels": 4096}
# (file, size, color): four sizes, so rows of a micro-batch have images of different token counts.
IMAGES = [("red.png", (40, 30), "red"), ("blue.png", (64, 20), "blue"), ("green.png", (100, 90), "green"),
          ("yellow.png", (16, 48), "yellow")]


def write_images(folder: Path) -> None:
    """The IMAGES: their color with seeded noise over it. Not flat: in a flat image every patch is the same, so the
    vision encoder's attention is uniform and its query and key weights get no gradient, which would leave the
    accumulation test nothing but float noise to compare there."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, (width, height), color in IMAGES:
        base = np.array(Image.new("RGB", (1, 1), color), dtype=np.int16)
        noisy = base + rng.integers(-60, 60, size=(height, width, 3))
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / name)


def image_rows(n: int = 8) -> list[dict[str, Any]]:
    """n chat rows: one or two images (relative paths), a question, an answer; every fourth row has no image."""
    rows = []
    for i in range(n):
        name, _, color = IMAGES[i % len(IMAGES)]
        other, _, color2 = IMAGES[(i + 1) % len(IMAGES)]
        if i % 4 == 3:
            user: Any = f"Say {color} {i} times."
            answer = " ".join([color] * (i % 5 + 1))
        elif i % 2:
            user = [{"type": "text", "text": "Which colors?"}, {"type": "image", "path": f"images/{name}"},
                    {"type": "image", "path": f"images/{other}"}]
            answer = f"{color} and {color2}"
        else:
            user = [{"type": "image", "path": f"images/{name}"}, {"type": "text", "text": "What color is this?"}]
            answer = [{"type": "text", "text": f"It is {color}."}]
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return rows


def write_data(folder: Path, n: int = 8) -> Path:
    """Images under folder/images and n rows in folder/train.jsonl; returns the data file."""
    write_images(folder / "images")
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in image_rows(n)))
    return data


def _processor(family: str) -> dict[str, Any]:
    return IMAGE_PROCESSOR if family.startswith("qwen") else SMOLVLM_PROCESSOR if family == "smolvlm" else {}


def model_config(family: str = "qwen2_vl", **overrides: Any) -> Any:
    """The recipe's model section for a tiny random VLM of `family`."""
    from finetune.recipe import ModelConfig

    return ModelConfig(init="random", config=CONFIGS[family], image_processor=_processor(family), **overrides)


def _tokenizer_keys(family: str) -> dict[str, Any]:
    if family == "llava":
        return {"path": str(TOKENIZER), "chat_template": LLAVA_TEMPLATE, "added_special_tokens": LLAVA_TOKENS}
    if family == "smolvlm":
        return {"path": str(TOKENIZER), "chat_template": SMOLVLM_TEMPLATE,
                "special_tokens": {"eos_token": "<end_of_utterance>"}, "added_special_tokens": SMOLVLM_TOKENS}
    if family == "mistral3":
        return {"path": str(TOKENIZER), "chat_template": MISTRAL3_TEMPLATE, "added_special_tokens": MISTRAL3_TOKENS}
    if family == "gemma3":  # Gemma 3's own template (shipped), which writes <start_of_image> for an image
        return {"path": str(TOKENIZER), "chat_template": "gemma3", "special_tokens": {"bos_token": "<bos>"},
                "added_special_tokens": GEMMA3_TOKENS}
    return {"path": str(TOKENIZER), "chat_template": "qwen2_vl", "added_special_tokens": VISION_TOKENS}


def tokenizer_config(family: str = "qwen2_vl") -> Any:
    from finetune.recipe import TokenizerConfig

    return TokenizerConfig(**_tokenizer_keys(family))


def recipe_yaml(data: Path, family: str = "qwen2_vl", **data_keys: Any) -> str:
    """A recipe (YAML text) training a tiny random VLM of `family` on `data`, padded batches."""
    recipe = {
        "seed": 0,
        "model": {"init": "random", "config": CONFIGS[family], "image_processor": _processor(family)},
        "tokenizer": _tokenizer_keys(family),
        "datasets": [{"path": str(data), "format": "chat"}],
        "data": {"max_seq_len": 256, "packing": False, **data_keys},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "epochs": 1, "lr": 1e-3},
        "eval": {"at_start": False, "every_steps": None},
        "logging": {"every_steps": 1},
    }
    return json.dumps(recipe)  # JSON is YAML


def bomb_png(width: int, height: int) -> bytes:
    """A PNG of width x height black pixels, 1 bit each, in a few KB (20000 x 20000: 49 KB for 400 million pixels),
    made in milliseconds: one deflate block of up to 1,000 zero rows, flushed whole (Z_FULL_FLUSH: it depends on
    nothing before it), repeated, with the checksum of all the rows."""
    line = 1 + (width + 7) // 8  # a filter byte, then the row's bits
    per = min(height, 1000)
    count, rest = divmod(height, per)
    block, last = bytes(line * per), bytes(line * rest)
    deflate = zlib.compressobj(9)
    first = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)  # with the zlib header
    again = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    tail = deflate.compress(last) + deflate.flush()
    checksum = 1
    for _ in range(count):
        checksum = zlib.adler32(block, checksum)
    stream = first + again * (count - 1) + tail[:-4] + zlib.adler32(last, checksum).to_bytes(4, "big")

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", stream) + chunk(b"IEND", b""))
