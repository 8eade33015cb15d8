"""Vision-language models (finetune/model/vision.py): the fused loss is the model's own, what trains, what is
refused, and exact gradient accumulation through the real trainer with images of different sizes."""

from __future__ import annotations

import json

import pytest
from helpers import final_weights, max_rel_diff, rel_diff, run_cli, train_lines
from vision_fixtures import model_config, recipe_yaml, tokenizer_config, write_data

from finetune.data.collate import collate
from finetune.data.formats import MessageFields, to_example
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.errors import UserError
from finetune.model.architectures import packing_refusal
from finetune.model.loading import load_model, load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import AdapterConfig, DataConfig, ModelConfig

FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def _batch(tok, folder, n=6):
    data = write_data(folder, n=n)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    samples = [tokenize_example(to_example(RawRow(row, f"t.jsonl:{i}"), "chat",
                                           fields=MessageFields(image_root=str(folder))), tok)
               for i, row in enumerate(rows)]
    return collate(samples, DataConfig(packing=False), tok.pad_token_id).to("cpu")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["chunked", "torch"])
def test_fused_loss_and_gradients_are_the_models_own(tmp_path, family, impl):
    """The fused loss over the language model's head (a padded batch of rows with 0, 1 and 2 images of different
    sizes) equals the model's own `model(..., labels=...)` loss within 1e-5, and so does every gradient, the vision
    encoder's included (max |a - b| / max |b| per tensor)."""
    tok = load_tokenizer(tokenizer_config(), model_config(family))
    model = load_model(model_config(family, freeze_vision=False), AdapterConfig(), tok, seed=0)
    batch = _batch(tok, tmp_path)
    assert batch.vision is not None and batch.vision.images == 7
    net = CausalLMWithLoss(model, impl, chunk_size=16, z_loss=0.0, softcap=None)
    loss_sum, count = net(**batch.model_inputs())
    fused = loss_sum / count
    fused.backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    own = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                **batch.vision.inputs).loss
    own.backward()
    assert count == batch.targets
    assert abs(fused.item() - own.item()) <= 1e-5 * own.item(), (fused.item(), own.item())
    vision_grads = [name for name in ours if ".visual." in name and ours[name].abs().sum() > 0]
    assert vision_grads, "the vision encoder got no gradient: the comparison would not cover it"
    for name, p in model.named_parameters():
        assert max_rel_diff(ours[name], p.grad) <= 1e-5, (name, max_rel_diff(ours[name], p.grad))


def test_other_vision_language_models_are_refused_with_the_reason():
    for config, why in (({"model_type": "llava"}, "its image layout, its loss through the fused head"),
                        ({"model_type": "smolvlm"}, "not checked yet"),
                        ({"model_type": "idefics"}, "cross-attention layers")):
        with pytest.raises(UserError, match=f"model_type '{config['model_type']}' is an image-text-to-text model "
                                            f"finetune does not train yet: .*{why}.*Supported: qwen2_vl, qwen2_5_vl"):
            load_tokenizer(tokenizer_config(), ModelConfig(init="random", config=config))
    tok = load_tokenizer(tokenizer_config(), model_config())
    with pytest.raises(UserError, match="adapter.type: qlora is not supported for vision-language models"):
        load_model(model_config(), AdapterConfig(type="qlora"), tok, seed=0)


def test_packing_is_refused_with_the_reason():
    tok = load_tokenizer(tokenizer_config(), model_config())
    model = load_model(model_config(), AdapterConfig(), tok, seed=0)
    why = packing_refusal(model, tok.pad_token_id)
    assert why and why.startswith("data.packing: qwen2_vl is a vision-language model") and "packing: false" in why


def test_freeze_vision_keeps_the_encoder_frozen_and_trains_the_projector():
    tok = load_tokenizer(tokenizer_config(), model_config())
    frozen = load_model(model_config(), AdapterConfig(), tok, seed=0)
    training = {name for name, p in frozen.named_parameters() if p.requires_grad}
    assert not any(n.startswith("model.visual.") and not n.startswith("model.visual.merger.") for n in training)
    assert any(n.startswith("model.visual.merger.") for n in training)
    assert any(n.startswith("model.language_model.layers.") for n in training)
    full = load_model(model_config(freeze_vision=False), AdapterConfig(), tok, seed=0)
    assert all(p.requires_grad for p in full.parameters())


def test_lora_goes_on_the_language_model_unless_a_regex_names_vision_modules():
    tok = load_tokenizer(tokenizer_config(), model_config())
    for target in ("all-linear", ["qkv", "q_proj", "fc1", "down_proj"]):
        model = load_model(model_config(), AdapterConfig(type="lora", r=4, target_modules=target), tok, seed=0)
        adapted = {n for n, p in model.named_parameters() if p.requires_grad}
        assert adapted and all("lora_" in n for n in adapted)
        assert not any(".visual." in n for n in adapted), target
        assert any(".language_model." in n for n in adapted), target
    regex = r".*(visual\.blocks\.\d+\.attn\.qkv|q_proj)$"
    model = load_model(model_config(), AdapterConfig(type="lora", r=4, target_modules=regex), tok, seed=0)
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".visual.blocks." in n for n in adapted) and any(".language_model." in n for n in adapted)


def test_accumulation_factorizations_give_identical_training_with_images(tmp_path):
    """micro x accum = 8x1, 1x8, 2x4 for 2 steps of rows with 0, 1 or 2 images of four sizes, the vision encoder
    training too (model.freeze_vision: false): the same logged losses and grad norms within 1e-5, and the same
    final weights (||a - b|| / ||b|| <= 1e-5 per tensor, as for text: tests/test_train_cli.py says why)."""
    data = write_data(tmp_path / "data", n=16)
    recipe = tmp_path / "vlm.yaml"
    recipe.write_text(recipe_yaml(data))
    runs = {}
    for micro, accum in ((8, 1), (1, 8), (2, 4)):
        out = tmp_path / f"m{micro}a{accum}"
        result = run_cli("train", str(recipe), f"output_dir={out}", "model.freeze_vision=false", "train.max_steps=2",
                         f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accum}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[(micro, accum)] = out
    ref = runs[(8, 1)]
    ref_lines, ref_weights = train_lines(ref), final_weights(ref)
    assert (ref / "final" / "preprocessor_config.json").is_file()  # the image processor travels with the model
    assert any(name.startswith("visual.blocks.") for name in ref_weights)  # saved under the checkpoint's names
    for key, out in runs.items():
        lines = train_lines(out)
        assert len(lines) == len(ref_lines) == 2
        for a, b in zip(lines, ref_lines):
            assert a["tokens"] == b["tokens"]
            assert abs(a["loss"] - b["loss"]) / abs(b["loss"]) <= 1e-5, (key, a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] <= 1e-5, (key, a["grad_norm"])
        weights = final_weights(out)
        for name, tensor in ref_weights.items():
            assert rel_diff(weights[name], tensor) <= 1e-5, (key, name, rel_diff(weights[name], tensor))
    tok = load_tokenizer(tokenizer_config(), model_config())
    start = load_model(model_config(freeze_vision=False), AdapterConfig(), tok, seed=0).state_dict()
    qkv = "visual.blocks.0.attn.qkv.weight"  # the vision encoder trained: the comparison is not of its init
    assert rel_diff(ref_weights[qkv], start[f"model.{qkv}"]) > 1e-3
