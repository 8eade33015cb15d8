"""Vision-language models (finetune/model/vision.py): the fused loss is the model's own, what trains, what is
refused, and exact gradient accumulation through the real trainer with images of different sizes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import assert_same_steps, final_weights, max_rel_diff, one_thread, rel_diff, train_lines
from vision_fixtures import model_config, recipe_yaml, tokenizer_config, write_data

from finetune.data.collate import collate
from finetune.data.formats import MessageFields, to_example
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.errors import UserError
from finetune.model.architectures import packing_refusal
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import AdapterConfig, DataConfig, ModelConfig, load_recipe
from finetune.train.loop import train

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "gemma3", "smolvlm", "mistral3")
TOWER = {"qwen2_vl": "model.visual.", "qwen2_5_vl": "model.visual.", "qwen3_vl": "model.visual.",
         "qwen3_vl_moe": "model.visual.", "llava": "model.vision_tower.", "gemma3": "model.vision_tower.",
         "smolvlm": "model.vision_model.", "mistral3": "model.vision_tower."}
LANGUAGE = {"smolvlm": "model.text_model."}  # the others: model.language_model.


def _batch(tok, folder, n=6):
    """A padded micro-batch of n rows of vision_fixtures.image_rows: 0, 1 or 2 images each, of four sizes."""
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
    encoder's included (max |a - b| / max |b| per tensor; a key bias, whose gradient is zero but for float noise,
    against the largest gradient)."""
    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    model = load_model(model_config(family, freeze_vision=False), AdapterConfig(), tok, seed=0)
    if family == "gemma3":  # its projection starts at zero, which would pass the tower no gradient to compare
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2,
                                                                                 generator=torch.Generator().manual_seed(0))
    batch = _batch(tok, tmp_path)
    assert batch.vision is not None and batch.vision.images == 7
    if family == "smolvlm":  # images split into 1x2, 2x1 and 2x2 tiles, each with its global image
        assert batch.vision.inputs["pixel_values"].shape[1] > 7
    if family == "mistral3":  # images of three sizes, padded to the largest: image_sizes says what the tower reads
        assert len(set(map(tuple, batch.vision.inputs["image_sizes"].tolist()))) == 3
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
    vision_grads = [name for name in ours if name.startswith(TOWER[family]) and ours[name].abs().sum() > 0]
    assert vision_grads, "the vision encoder got no gradient: the comparison would not cover it"
    if family.startswith("qwen3"):  # the DeepStack mergers feed decoder layer 0: compared too
        assert any(".deepstack_merger_list." in name for name in vision_grads)
    top = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        if p.grad is None:  # unused by both (LLaVA reads the vision tower's second-to-last layer)
            assert name not in ours, name
            continue
        if name.endswith("k_proj.bias") and p.grad.abs().max() < 1e-7 * top:
            # Zero in exact arithmetic (CLIP's attention has no RoPE: q.b shifts every key's score alike, which the
            # softmax ignores); both sides are float noise (1e-11), held to the largest gradient's scale.
            assert (ours[name] - p.grad).abs().max() <= 1e-5 * top, name
            continue
        assert max_rel_diff(ours[name], p.grad) <= 1e-5, (name, max_rel_diff(ours[name], p.grad))


def test_mistral3_rows_alone_train_as_in_a_padded_batch(tmp_path):
    """Mistral 3's images are padded to the micro-batch's largest (image_sizes says how much of each the tower
    reads), so a row's images are other tensors in another micro-batch: each row alone gives the loss sum and the
    gradients it gives in the padded batch (summed over the rows, within 1e-9 in float64), which exact accumulation over
    micro-batches of other sizes rests on (the trainer's 8x1 = 1x8 = 2x4 runs the other families)."""
    tok = load_tokenizer(tokenizer_config("mistral3"), model_config("mistral3"))
    # In float64: the tower's key gradients cancel to 1e-5 of their scale in float32, whose rounding then differs
    # with the summation order (one row or six, one thread or two); float64 leaves only the order's own effect.
    model = load_model(model_config("mistral3", freeze_vision=False), AdapterConfig(), tok, seed=0).double()
    net = CausalLMWithLoss(model, "chunked", chunk_size=16, z_loss=0.0, softcap=None)
    batch = _batch(tok, tmp_path)
    loss_sum, _ = net(**_double(batch.model_inputs()))
    loss_sum.backward()
    together = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()  # the same rows, collated one at a time
    data = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    alone_sum = 0.0
    for i, row in enumerate(data):
        sample = tokenize_example(to_example(RawRow(row, f"t.jsonl:{i}"), "chat",
                                             fields=MessageFields(image_root=str(tmp_path))), tok)
        one = collate([sample], DataConfig(packing=False), tok.pad_token_id).to("cpu")
        row_sum, _ = net(**_double(one.model_inputs()))
        row_sum.backward()
        alone_sum += row_sum.item()
    assert abs(alone_sum - loss_sum.item()) <= 1e-9 * loss_sum.item()
    assert any(name.startswith("model.vision_tower.") for name in together)
    for name, p in model.named_parameters():
        if name in together:
            # Summed in another order (six rows, two threads): float32 noise reaches 1.4e-5 of the largest element
            # in the tower's attention, so per tensor as the weights are compared (||a - b|| / ||b||).
            assert rel_diff(p.grad, together[name]) <= 1e-5, (name, rel_diff(p.grad, together[name]))
            assert max_rel_diff(p.grad, together[name]) <= 1e-4, (name, max_rel_diff(p.grad, together[name]))


def _double(inputs: dict) -> dict:
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}


def test_gemma3_reads_each_image_both_ways_and_its_head_is_not_soft_capped(tmp_path):
    """Gemma 3 attends bidirectionally within an image's tokens: the token_type_ids collate gives change the model's
    own loss (so the fused loss, equal to it above, reads them too); and its head applies no final soft-cap (the tiny
    config sets final_logit_softcapping 0.05, which Gemma3ForConditionalGeneration ignores): the fused loss with the
    soft-cap put back differs from the model's own."""
    from finetune.data.images import layout_for

    tok = load_tokenizer(tokenizer_config("gemma3"), model_config("gemma3"))
    model = load_model(model_config("gemma3"), AdapterConfig(), tok, seed=0)
    with torch.no_grad():  # the projection starts at zero: images would add nothing to compare
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2,
                                                                             generator=torch.Generator().manual_seed(0))
    batch = _batch(tok, tmp_path)
    inputs = dict(batch.vision.inputs)
    with torch.no_grad():
        own = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                    **inputs).loss
        causal = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                       pixel_values=inputs["pixel_values"]).loss
        net = CausalLMWithLoss(model, "torch", chunk_size=16, z_loss=0.0, softcap=None)
        loss_sum, count = net(**batch.model_inputs())
        capped_sum, _ = CausalLMWithLoss(model, "torch", chunk_size=16, z_loss=0.0, softcap=0.05)(
            **batch.model_inputs())
    assert net.softcap is None and model.config.text_config.final_logit_softcapping == 0.05
    # random init: the vision token ids are the tokenizer's added tokens, the image processor the tower's size
    ids = tok.convert_tokens_to_ids(["<image_soft_token>", "<start_of_image>", "<end_of_image>"])
    assert [model.config.image_token_id, model.config.boi_token_id, model.config.eoi_token_id] == ids
    assert layout_for(tok).processor.size.height == layout_for(tok).processor.size.width == 32
    assert abs(loss_sum.item() / count - own.item()) <= 1e-5 * own.item()
    assert abs(own.item() - causal.item()) > 1e-4 * own.item(), (own.item(), causal.item())
    assert abs(capped_sum.item() / count - own.item()) > 1e-4 * own.item()


def test_gemma3_without_a_vision_tower_of_its_own_stays_a_text_model():
    """A gemma3 model.config without vision_config (transformers fills in its default SigLIP, and saves it so) is
    trained as text, as before: no image layout, no vision tokens needed, packing not refused for being a VLM; one
    that names its tower is a VLM, and the decision survives a save (the config's dict read back)."""
    from transformers import AutoConfig, Gemma3Config

    from finetune.data.images import layout_for
    from finetune.model.vision import family

    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16}
    plain = AutoConfig.for_model("gemma3", text_config=text)
    named = AutoConfig.for_model("gemma3", text_config=text, vision_config=model_config("gemma3").config[
        "vision_config"])
    assert family(plain) is None and family(Gemma3Config.from_dict(plain.to_dict())) is None
    assert family(named).layout == "gemma3" and family(Gemma3Config.from_dict(named.to_dict())).layout == "gemma3"
    tok = load_tokenizer(tokenizer_config(), ModelConfig(init="random", config={"model_type": "gemma3",
                                                                                "text_config": text}))
    assert layout_for(tok) is None  # the quickstart tokenizer has no Gemma 3 vision token, and needs none


def test_other_vision_language_models_are_refused_with_the_reason():
    supported = "qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, llava, gemma3, smolvlm, mistral3"
    for config, why in (({"model_type": "idefics3"}, "its image layout, its loss through the fused head"),
                        ({"model_type": "internvl"}, "not checked yet"),
                        ({"model_type": "idefics"}, "cross-attention layers")):
        with pytest.raises(UserError, match=f"model_type '{config['model_type']}' is an image-text-to-text model "
                                            f"finetune does not train yet: .*{why}.*Supported: {supported}"):
            load_tokenizer(tokenizer_config(), ModelConfig(init="random", config=config))
    # A MoE language model's router loss, which the fused loss does not add, is refused, as for text MoE models.
    moe = model_config("qwen3_vl_moe").config
    routed = {**moe, "text_config": {**moe["text_config"], "output_router_logits": True}}
    with pytest.raises(UserError, match="text_config.output_router_logits is true: qwen3_vl_moe would add its router"):
        load_tokenizer(tokenizer_config(), ModelConfig(init="random", config=routed))


def test_packing_is_refused_with_the_reason():
    tok = load_tokenizer(tokenizer_config(), model_config())
    model = load_model(model_config(), AdapterConfig(), tok, seed=0)
    why = packing_refusal(model, tok.pad_token_id)
    assert why and why.startswith("data.packing: qwen2_vl is a vision-language model") and "packing: false" in why


PROJECTOR = {"qwen2_vl": ("model.visual.merger.",), "llava": ("model.multi_modal_projector.",),
             "gemma3": ("model.multi_modal_projector.",), "smolvlm": ("model.connector.",),
             "qwen3_vl": ("model.visual.merger.", "model.visual.deepstack_merger_list."),
             "mistral3": ("model.multi_modal_projector.",)}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava", "gemma3", "smolvlm", "mistral3"])
def test_freeze_vision_keeps_the_encoder_frozen_and_trains_the_projector(family):
    """freeze_vision: the tower frozen, each projector and the language model training; QLoRA's skips (the modules
    kept unquantized) hold every vision-side parameter and nothing of the language model."""
    from finetune.model.vision import quantization_skips

    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    frozen = load_model(model_config(family), AdapterConfig(), tok, seed=0)
    training = {name for name, p in frozen.named_parameters() if p.requires_grad}
    tower, projector = TOWER[family], PROJECTOR[family]
    assert not any(n.startswith(tower) and not n.startswith(projector) for n in training)
    assert all(any(n.startswith(p) for n in training) for p in projector)
    skips = tuple(f"{s}." for s in quantization_skips(frozen.config))
    names = [n for n, _ in frozen.named_parameters()]
    assert all(n.startswith(skips) for n in names if n.startswith((tower, *projector)))
    assert not any(n.startswith(skips) for n in names if n.startswith(LANGUAGE.get(family, "model.language_model.")))
    assert any(n.startswith(LANGUAGE.get(family, "model.language_model.") + "layers.") for n in training)
    full = load_model(model_config(family, freeze_vision=False), AdapterConfig(), tok, seed=0)
    assert all(p.requires_grad for p in full.parameters())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava", "gemma3", "smolvlm", "mistral3"])
def test_lora_goes_on_the_language_model_unless_a_regex_names_vision_modules(family):
    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    vision_side = (TOWER[family], *PROJECTOR[family])
    for target in ("all-linear", ["qkv", "q_proj", "fc1", "down_proj", "linear_1"]):
        model = load_model(model_config(family), AdapterConfig(type="lora", r=4, target_modules=target), tok, seed=0)
        adapted = {n.removeprefix("base_model.model.") for n, p in model.named_parameters() if p.requires_grad}
        assert adapted and all("lora_" in n for n in adapted)
        assert not any(n.startswith(vision_side) for n in adapted), (target, sorted(adapted)[:3])
        assert any(n.startswith(LANGUAGE.get(family, "model.language_model.")) for n in adapted), target
    regex = {"qwen2_vl": r".*(visual\.blocks\.\d+\.attn\.qkv|q_proj)$",
             "qwen3_vl": r".*(visual\.blocks\.\d+\.attn\.qkv|q_proj)$",
             "llava": r".*(vision_tower\..*q_proj|language_model\..*q_proj)$",
             "gemma3": r".*(vision_tower\..*q_proj|language_model\..*q_proj)$",
             "mistral3": r".*(vision_tower\..*q_proj|language_model\..*q_proj)$",
             "smolvlm": r".*(vision_model\..*q_proj|text_model\..*q_proj)$"}[family]
    model = load_model(model_config(family), AdapterConfig(type="lora", r=4, target_modules=regex), tok, seed=0)
    adapted = {n.removeprefix("base_model.model.") for n, p in model.named_parameters() if p.requires_grad}
    language = LANGUAGE.get(family, "model.language_model.").removeprefix("model")
    assert any(n.startswith(TOWER[family]) for n in adapted) and any(language in f".{n}" for n in adapted)


_GEMMA_NORM = re.compile(r"(language_model\..*norm|mm_soft_emb_norm)\.weight$")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava", "gemma3", "smolvlm", "mistral3"])
def test_accumulation_factorizations_give_identical_training_with_images(tmp_path, family):
    """micro x accum = 8x1, 1x8, 2x4 for 2 steps of rows with 0, 1 or 2 images of four sizes, the vision encoder
    training too (model.freeze_vision: false): the same logged losses and grad norms within 1e-5, and the same
    final weights (||a - b|| / ||b|| <= 1e-5 per tensor, as for text: tests/test_train_cli.py says why)."""
    data = write_data(tmp_path / "data", n=16)
    recipe = tmp_path / "vlm.yaml"
    recipe.write_text(recipe_yaml(data, family))
    runs = {}
    for micro, accum in ((8, 1), (1, 8), (2, 4)):
        out = tmp_path / f"m{micro}a{accum}"
        # In-process (the trainer's own entry point, as `finetune train` calls it): no interpreter start per run.
        # One thread, as the CLI runs of the suite have (OMP_NUM_THREADS=1): with two, matmuls sum in an order
        # that depends on the micro-batch's shape, and small gradients (CLIP's q bias) move by 1.6e-5.
        with one_thread():
            train(load_recipe(recipe, [f"output_dir={out}", "model.freeze_vision=false", "train.max_steps=2",
                                       f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accum}"]))
        runs[(micro, accum)] = out
    ref = runs[(8, 1)]
    ref_lines, ref_weights = train_lines(ref), final_weights(ref)
    assert (ref / "final" / "preprocessor_config.json").is_file()  # the image processor travels with the model
    for key, out in runs.items():
        lines = train_lines(out)
        assert len(lines) == len(ref_lines) == 2
        assert_same_steps(lines, ref_lines)
        weights = final_weights(out)
        for name, tensor in ref_weights.items():
            if family in ("llava", "gemma3", "smolvlm") and name.endswith("k_proj.bias") and tensor.abs().max() < 1e-5:
                # CLIP's and SigLIP's key bias: its gradient is zero but for float noise (no RoPE, the softmax ignores q.b), and
                # Adam turns that noise into noise-sized steps (1e-7 after 2 steps of lr 1e-3): it never moved.
                assert weights[name].abs().max() < 1e-5, (key, name)
                continue
            if family == "gemma3" and _GEMMA_NORM.search(name):
                # Gemma's RMSNorm scales by 1 + weight (stored at zero): compared as that scale, as other models'
                # norm weights (at one) are. The stored offset is only the update, whose Adam step amplifies float
                # noise where two steps' gradients nearly cancel (2e-7 absolute here).
                weights[name], tensor = 1 + weights[name], 1 + tensor
            assert rel_diff(weights[name], tensor) <= 1e-5, (key, name, rel_diff(weights[name], tensor))
    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    start = load_model(model_config(family, freeze_vision=False), AdapterConfig(), tok, seed=0).state_dict()
    # The vision encoder trained (saved under the checkpoint's names): the comparison is not of its init.
    saved, loaded = {"qwen2_vl": ("visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv.weight"),
                     "qwen3_vl": ("model.visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv.weight"),
                     "mistral3": ("vision_tower.transformer.layers.0.attention.q_proj.weight",
                                  "model.vision_tower.transformer.layers.0.attention.q_proj.weight"),
                     "llava": ("vision_tower.encoder.layers.0.self_attn.q_proj.weight",
                               "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"),
                     "gemma3": ("vision_tower.encoder.layers.0.self_attn.q_proj.weight",
                                "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"),
                     "smolvlm": ("model.vision_model.encoder.layers.0.self_attn.q_proj.weight",
                                 "model.vision_model.encoder.layers.0.self_attn.q_proj.weight")}[family]
    assert rel_diff(ref_weights[saved], start[loaded]) > 1e-3
