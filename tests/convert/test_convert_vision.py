"""`finetune convert axolotl` on vision-language configs (processor_type set): what Axolotl's multimodal path
trains, as a recipe that validates; approximations only with --allow-approx; refusals with their reasons.

The configs are written here, modelled on the kinds Axolotl ships (Qwen2-VL and LLaVA LoRA, full fine-tuning with
freeze_mm_modules); the names of modules below are those of transformers 5's Qwen2-VL and LLaVA."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from finetune.convert import convert_axolotl
from finetune.convert.rules_vision import OUTSIDE_MM
from finetune.errors import UserError
from finetune.recipe import validate

QWEN = """base_model: Qwen/Qwen2-VL-2B-Instruct
processor_type: AutoProcessor
skip_prepare_dataset: true
remove_unused_columns: false
sample_packing: false
chat_template: qwen2_vl
datasets:
  - path: HuggingFaceH4/llava-instruct-mix-vsft
    type: chat_template
    split: train[:1%]
sequence_len: 8192
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_modules: 'model.language_model.layers.[\\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj'
micro_batch_size: 1
gradient_accumulation_steps: 4
num_epochs: 1
learning_rate: 0.0002
bf16: true
"""

LLAVA = """base_model: llava-hf/llava-1.5-7b-hf
processor_type: AutoProcessor
chat_template: llava
datasets:
  - path: data/vqa.jsonl
    type: chat_template
    field_messages: conversation
    roles_to_train: [assistant]
adapter: lora
lora_target_modules: [q_proj, v_proj]
"""

FULL = """base_model: Qwen/Qwen2-VL-2B-Instruct
processor_type: AutoProcessor
chat_template: qwen2_vl
datasets:
  - {path: data/vqa.jsonl, type: chat_template}
"""

# Parameter names of transformers 5's Qwen2-VL and LLaVA: the language model's, the vision side's.
LANGUAGE = ["model.language_model.layers.0.mlp.up_proj.weight", "model.language_model.embed_tokens.weight",
            "lm_head.weight"]
VISION = ["model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.mlp.0.weight",
          "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
          "model.multi_modal_projector.linear_1.weight"]


def _convert(tmp_path: Path, text: str, allow_approx: bool = False):
    config = tmp_path / "config.yml"
    config.write_text(text, encoding="utf-8")
    converted = convert_axolotl(config, allow_approx=allow_approx)
    recipe = yaml.safe_load(converted.text)
    validate(recipe)  # what `finetune validate` checks, local data files aside
    return recipe, converted


def _error(tmp_path: Path, text: str, allow_approx: bool = False) -> str:
    with pytest.raises(UserError) as e:
        _convert(tmp_path, text, allow_approx)
    return str(e.value)


def test_a_qwen2_vl_lora_config_converts_exactly(tmp_path):
    recipe, converted = _convert(tmp_path, QWEN)
    assert recipe["model"] == {"path": "Qwen/Qwen2-VL-2B-Instruct", "dtype": "bfloat16"}
    assert recipe["tokenizer"] == {"chat_template": "qwen2_vl"}  # Axolotl's template is the one finetune ships
    assert recipe["datasets"] == [{"path": "HuggingFaceH4/llava-instruct-mix-vsft", "split": "train[:1%]",
                                   "format": "chat"}]  # assistant turns only (Qwen's role markers); no system column
    # Axolotl's multimodal collator neither truncates nor drops, and refuses packing.
    assert recipe["data"] == {"max_seq_len": None, "packing": False}
    assert recipe["adapter"]["target_modules"] == \
        r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"
    assert converted.conversion.approximations == []
    assert "skip_prepare_dataset" in dict(converted.conversion.dropped)
    notes = " ".join(converted.conversion.notes)
    assert "HuggingFaceH4/llava-instruct-mix-vsft is read as a hub dataset" in notes and "`images` column" in notes
    assert "processor_type AutoProcessor: a vision-language model" in converted.text  # the header says so too


def test_a_template_without_role_markers_trains_every_token(tmp_path):
    """Axolotl's base strategy (chat_template llava, or none) trains every token but padding and images:
    train_on_inputs: true; its roles_to_train is not read. The llava template itself is approximate."""
    assert "chat_template: only approximately: llava" in _error(tmp_path, LLAVA)
    recipe, converted = _convert(tmp_path, LLAVA, allow_approx=True)
    assert recipe["datasets"] == [{"path": "data/vqa.jsonl", "format": "chat", "messages_field": "conversation",
                                   "train_on_inputs": True}]
    assert "datasets.0.roles_to_train" in dict(converted.conversion.dropped)
    assert any("no role markers for chat_template llava" in n for n in converted.conversion.notes)
    assert not any("hub dataset" in n for n in converted.conversion.notes)  # a local file


def test_a_list_of_lora_names_reaches_what_peft_reaches(tmp_path):
    """PEFT matches a name as a module's name or its last parts, the vision tower's too (CLIP's q_proj): the
    recipe's expression (re.fullmatch, as PEFT applies it) matches exactly those modules."""
    recipe, _ = _convert(tmp_path, LLAVA, allow_approx=True)
    pattern = recipe["adapter"]["target_modules"]
    names = ["model.language_model.layers.0.self_attn.q_proj", "model.vision_tower.vision_model.encoder.layers.0."
             "self_attn.q_proj", "model.language_model.layers.0.self_attn.k_proj", "v_proj", "x.not_v_proj",
             "model.language_model.layers.0.self_attn.v_proj.lora"]
    for name in names:
        peft = any(name == t or name.endswith("." + t) for t in ("q_proj", "v_proj"))
        assert bool(re.fullmatch(pattern, name)) == peft, name


def test_full_finetuning_trains_the_vision_encoder_unless_freeze_mm_modules(tmp_path):
    recipe, converted = _convert(tmp_path, FULL)
    assert recipe["model"]["freeze_vision"] is False
    assert any(d.startswith("model.freeze_vision: false") for d in converted.conversion.defaults)
    recipe, _ = _convert(tmp_path, FULL + "freeze_mm_modules: true\n")
    assert "freeze_vision" not in recipe["model"]
    (pattern,) = recipe["train"]["trainable_parameters"]
    assert all(re.match(pattern, n) for n in LANGUAGE)  # everything but the vision side trains (re.match)
    assert not any(re.match(pattern, n) for n in VISION)
    # With unfrozen_parameters, what Axolotl leaves trainable after both: the intersection.
    unfrozen = "unfrozen_parameters: ['model.language_model.layers.\\d+.self_attn.q_proj']\n"
    recipe, _ = _convert(tmp_path, FULL + "freeze_mm_modules: true\n" + unfrozen)
    (pattern,) = recipe["train"]["trainable_parameters"]
    trained = [n for n in LANGUAGE + VISION + ["model.language_model.layers.0.self_attn.q_proj.weight"]
               if re.match(pattern, n)]
    assert trained == ["model.language_model.layers.0.self_attn.q_proj.weight"]


def test_outside_mm_is_axolotls_freeze_rule():
    """Axolotl's freeze_mm_modules freezes a name with one of its prefixes as a dotted part (utils/freeze.py)."""
    prefixes = ("vision_tower", "vision_model", "vision_encoder", "embed_vision", "multi_modal_projector", "visual",
                "audio_tower", "audio_model", "embed_audio")
    names = [*LANGUAGE, *VISION, "visual", "visual.x", "a.visual", "model.visualize.w", "model.my_visual.w",
             "base_model.model.model.visual.blocks.0.lora_A.default.weight", "embed_audio.w", "audio.w"]
    for name in names:
        frozen = any(part in prefixes for part in name.split("."))
        assert (re.match(OUTSIDE_MM, name) is None) == frozen, name


def test_lora_targets_under_freeze_mm_modules(tmp_path):
    """freeze_mm_modules freezes whatever LoRA lands on the vision side: a list of names keeps finetune's rule (the
    vision side left out), an expression is kept off the vision modules, all-linear is then exact."""
    base = FULL + "adapter: lora\nfreeze_mm_modules: true\n"
    recipe, _ = _convert(tmp_path, base + "lora_target_modules: [q_proj, v_proj]\n")
    assert recipe["adapter"]["target_modules"] == ["q_proj", "v_proj"]
    recipe, _ = _convert(tmp_path, base + "lora_target_modules: '.*\\.(q_proj|qkv)'\n")
    pattern = recipe["adapter"]["target_modules"]
    assert re.fullmatch(pattern, "model.language_model.layers.0.self_attn.q_proj")
    assert not re.fullmatch(pattern, "model.visual.blocks.0.attn.qkv")
    recipe, converted = _convert(tmp_path, base + "lora_target_linear: true\n")
    assert "target_modules" not in recipe["adapter"] and converted.conversion.approximations == []
    message = _error(tmp_path, FULL + "adapter: lora\nlora_target_linear: true\n")
    assert "lora_target_linear: only approximately: LoRA on the language model's linear layers only" in message


def test_image_size_is_an_approximation(tmp_path):
    """Axolotl resizes a column's images to image_size before the processor; finetune leaves them to the processor."""
    text = QWEN + "image_size: 512\nimage_resize_algorithm: bilinear\n"
    assert "image_size: only approximately: an image reaches the model's image processor" in _error(tmp_path, text)
    _, converted = _convert(tmp_path, text, allow_approx=True)
    assert [a.split(":")[0] for a in converted.conversion.approximations] == ["image_size", "image_resize_algorithm"]


def test_qlora_stays_qlora_its_vision_side_unquantized_only_with_allow_approx(tmp_path):
    """finetune's VLM QLoRA keeps the vision encoder and projector unquantized; Axolotl's rounds them to 4 bits too."""
    text = QWEN.replace("adapter: lora", "adapter: qlora\nload_in_4bit: true")
    assert "adapter: only approximately: QLoRA with the vision encoder and projector unquantized" in _error(tmp_path,
                                                                                                            text)
    recipe, converted = _convert(tmp_path, text, allow_approx=True)
    assert recipe["adapter"]["type"] == "qlora"
    assert recipe["adapter"]["target_modules"] == r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"
    assert [a.split(":")[0] for a in converted.conversion.approximations] == ["adapter"]


def test_processor_kwargs_roles_and_boundaries(tmp_path):
    recipe, _ = _convert(tmp_path, FULL + "processor_kwargs: {min_pixels: 3136, max_pixels: 200704}\n")
    assert recipe["model"]["image_processor"] == {"min_pixels": 3136, "max_pixels": 200704}
    two = FULL.replace("type: chat_template}", "type: chat_template, roles_to_train: [user, assistant], "
                       "train_on_eos: turn}\n  - {path: data/more.jsonl, type: chat_template, roles_to_train: [user]}")
    recipe, converted = _convert(tmp_path, two)  # the collator takes the first dataset's masking for all
    assert [d.get("roles_to_train") for d in recipe["datasets"]] == [["user", "assistant"]] * 2
    assert "datasets.1.roles_to_train" in dict(converted.conversion.dropped)
    assert "train_on_eos: only approximately: all" in _error(tmp_path, FULL.replace(
        "type: chat_template}", "type: chat_template, train_on_eos: all}"))
    boundaries = "role_boundaries: [{role: assistant, start: '<|im_start|>assistant\\n'}]\n"
    assert "role_boundaries: only approximately" in _error(tmp_path, FULL + boundaries)
    recipe, converted = _convert(tmp_path, FULL + "train_on_inputs: true\n")
    assert recipe["datasets"][0]["train_on_inputs"] is True


@pytest.mark.parametrize(("extra", "expected"), [
    ("sample_packing: true\n", "sample_packing: packing is refused for vision-language models"),
    ("rl: dpo\n", "rl: preference and RL training with images is not supported yet"),
    ("processor_kwargs: {image_seq_length: 256}\n", "processor_kwargs: image_seq_length: finetune sets the image "
                                                    "processor's own settings only"),
])
def test_refusals_with_reasons(tmp_path, extra, expected):
    text = FULL.replace("type: chat_template", "type: chat_template.default") if "rl" in extra else FULL
    assert expected in _error(tmp_path, text + extra, allow_approx=True)


def test_refused_processors_and_dataset_types(tmp_path):
    audio = FULL.replace("AutoProcessor", "VoxtralProcessor")
    assert "processor_type: VoxtralProcessor: audio models are not supported" in _error(tmp_path, audio)
    assert "Axolotl expects a transformers processor class" in _error(tmp_path, FULL.replace("AutoProcessor",
                                                                                            "AutoTokenizer"))
    alpaca = FULL.replace("type: chat_template", "type: alpaca")
    assert "datasets.0.type: alpaca: Axolotl's multimodal collator reads every row as chat messages" in \
        _error(tmp_path, alpaca)


def test_model_classes_and_keys_without_processor_type(tmp_path):
    recipe, _ = _convert(tmp_path, FULL + "model_type: Qwen2VLForConditionalGeneration\n")
    assert recipe["model"]["path"] == "Qwen/Qwen2-VL-2B-Instruct"
    text = FULL.replace("processor_type: AutoProcessor\n", "")
    assert "model_type: Qwen2VLForConditionalGeneration: a multimodal model without processor_type" in \
        _error(tmp_path, text + "model_type: Qwen2VLForConditionalGeneration\n")
    recipe, converted = _convert(tmp_path, text + "freeze_mm_modules: true\nprocessor_kwargs: {max_pixels: 1}\n")
    dropped = dict(converted.conversion.dropped)
    assert "nothing to freeze" in dropped["freeze_mm_modules"] and "processor_kwargs" in dropped
    assert recipe["data"]["max_seq_len"] == 512 and "image_processor" not in recipe["model"]  # a text recipe
