"""Adapters (LoRA, QLoRA, full), the optimizers, saving, `finetune merge`, and model sources (pkg://, GGUF).

Tiny random-init Llama models from the quickstart recipe, trained in-process (no subprocess: importing torch,
transformers and peft costs more than the training here). Logit comparisons are fp32 <= 1e-5.

Device-aware: a QLoRA base is quantized onto DEVICE (the GPU on a CUDA machine, as training does), and inputs go
to the device of the model they are fed to (on a CUDA machine these tests once fed CPU batches to GPU models).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import needs
from helpers import QUICKSTART, TINY

from finetune.data import build_samples, collate, epoch_rows
from finetune.dist import default_device
from finetune.errors import UserError
from finetune.model.loading import load_base, load_model, save_final
from finetune.model.tokenizer import load_tokenizer, resolve_path
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import load_recipe
from finetune.train.optim import build_optimizer, parameter_groups

# Fewer rows than the quickstart's 3000 (tokenizing them would dominate), no packing check (tested elsewhere).
FAST = [*TINY, "datasets.0.max_rows=48", "eval_datasets.0.max_rows=8", "data.packing_check=false",
        "train.micro_batch_size=2", "train.gradient_accumulation_steps=1", "train.warmup_steps=0"]


# Where a QLoRA base goes (and where `finetune generate` puts a model): the GPU on a CUDA machine.
DEVICE = default_device()


def _recipe(*overrides: str):
    return load_recipe(QUICKSTART, [*FAST, *overrides])


@pytest.fixture(scope="module")
def data():
    """(tokenizer, one micro-batch of 2 packed rows) shared by the in-memory tests."""
    recipe = _recipe()
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    train, _, _, _ = build_samples(recipe, tokenizer)
    rows = epoch_rows(train, recipe.data, recipe.seed, 0)[:2]
    return tokenizer, collate(rows, recipe.data, tokenizer.pad_token_id)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _on(model, batch):
    """The micro-batch on the model's device."""
    return batch.to(_device(model))


def _steps(lm, batch, recipe, n: int) -> list[float]:
    """n optimizer steps on one batch through the trainer's path (fused chunked loss, build_optimizer)."""
    batch = _on(lm, batch)
    net = CausalLMWithLoss(lm, "chunked", 64, 0.0, None)
    optimizer = build_optimizer(lm.named_parameters(), recipe.train)
    net.train()
    losses = []
    for _ in range(n):
        loss_sum, count = net(input_ids=batch.input_ids, labels=batch.labels,
                              position_ids=batch.position_ids)
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss_sum / count))
    return losses


def _assert_fused_loss_is_the_models(lm, batch) -> None:
    """Our fused chunked loss through the (adapted) model equals the model's own loss on the batch (1e-5)."""
    batch = _on(lm, batch)
    lm.eval()
    with torch.no_grad():
        loss_sum, n = CausalLMWithLoss(lm, "chunked", 64, 0.0, None)(
            input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids)
        own = lm(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids).loss
    assert abs(float(loss_sum / n) - float(own)) <= 1e-5


def _logits(model, batch) -> torch.Tensor:
    """The model's logits on the batch, computed on the model's device, returned on the CPU."""
    batch = _on(model, batch)
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits.cpu()


def _base_state(model) -> dict[str, torch.Tensor]:
    """Every parameter of a PEFT model that is not part of the adapter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_lora_trains_only_the_adapter_and_reloads_with_peft(data, tmp_path):
    from peft import PeftModel

    tokenizer, batch = data
    recipe = _recipe("adapter.type=lora", "adapter.r=4", "train.lr=1e-2")
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed)
    base_before = _base_state(lm)
    lora_before = {n: p.detach().clone() for n, p in lm.named_parameters() if "lora_" in n}
    assert all(p.requires_grad == ("lora_" in n) for n, p in lm.named_parameters())
    losses = _steps(lm, batch, recipe, 3)
    assert losses[-1] < losses[0]
    for name, value in _base_state(lm).items():
        assert torch.equal(value, base_before[name]), f"base weight {name} changed"
    changed = [n for n, p in lm.named_parameters() if "lora_B" in n and not torch.equal(p, lora_before[n])]
    assert changed, "no LoRA weight changed"

    save_final(lm, tokenizer, tmp_path / "final")
    files = {p.name for p in (tmp_path / "final").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
    assert "model.safetensors" not in files
    config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 32)
    # A fresh base (rebuilt from config + seed, as `finetune merge` does) + the saved adapter == the trained model.
    reloaded = PeftModel.from_pretrained(load_base(recipe.model, tokenizer, recipe.seed), tmp_path / "final")
    assert (_logits(reloaded, batch) - _logits(lm, batch)).abs().max() <= 1e-5


def test_modules_to_save_on_tied_embeddings_loss_save_and_merge(data, tmp_path):
    """modules_to_save: [lm_head] on tied embeddings: head and embedding stay one trained tensor, the fused loss
    uses it (equals the model's own loss), and the merged model reproduces the trained one."""
    from transformers import AutoModelForCausalLM

    from finetune import versions
    from finetune.commands.merge import merge_run
    from finetune.recipe import to_yaml

    tokenizer, batch = data
    recipe = _recipe("adapter.type=lora", "adapter.modules_to_save=[lm_head]", "train.lr=1e-2")
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed)
    head_before = lm.get_base_model().get_output_embeddings().weight.detach().clone()
    _steps(lm, batch, recipe, 2)
    base = lm.get_base_model()
    head, embed = base.get_output_embeddings().weight, base.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr() and not torch.equal(head, head_before)
    _assert_fused_loss_is_the_models(lm, batch)

    # A run directory as the trainer writes it, then `finetune merge`.
    (tmp_path / "recipe.yaml").write_text(to_yaml(recipe))
    (tmp_path / "versions.json").write_text(json.dumps(versions.snapshot([])))
    save_final(lm, tokenizer, tmp_path / "final")
    merged = AutoModelForCausalLM.from_pretrained(merge_run(str(tmp_path), str(tmp_path / "out")))
    assert (_logits(merged, batch) - _logits(lm, batch)).abs().max() <= 1e-5


def test_lora_on_the_output_layer_is_refused(data):
    tokenizer, _ = data
    recipe = _recipe("adapter.type=lora", "adapter.target_modules=[q_proj,lm_head]")
    with pytest.raises(UserError, match="modules_to_save"):
        load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed)


def test_qlora_quantizes_the_base_and_the_loss_falls(data):
    """4-bit NF4 linear layers (on CPU), an unquantized output layer for the fused loss, gradient checkpointing,
    and training that lowers the loss."""
    bnb = needs("bitsandbytes")
    tokenizer, batch = data
    recipe = _recipe("adapter.type=qlora", "adapter.r=8", "train.lr=1e-2", "model.gradient_checkpointing=true")
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, DEVICE)
    assert _device(lm).type == DEVICE.type  # quantized straight onto the training device
    base = lm.get_base_model()
    assert isinstance(base.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    head = base.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    assert head.weight is base.get_input_embeddings().weight  # still tied after the 4-bit reload
    assert base.is_activation_checkpointing
    losses = _steps(lm, batch, recipe, 5)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    _assert_fused_loss_is_the_models(lm, batch)


def test_full_fine_tune_with_gradient_checkpointing_and_adamw_8bit(data):
    needs("bitsandbytes")  # AdamW8bit
    tokenizer, batch = data
    recipe = _recipe("model.gradient_checkpointing=true", "train.optimizer=adamw_8bit", "train.lr=1e-2")
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed)
    assert all(p.requires_grad for p in lm.parameters())
    before = lm.model.layers[0].mlp.up_proj.weight.detach().clone()
    optimizer = build_optimizer(lm.named_parameters(), recipe.train)
    assert type(optimizer).__name__ == "AdamW8bit"
    losses = _steps(lm, batch, recipe, 3)
    assert losses[-1] < losses[0]
    assert not torch.equal(before, lm.model.layers[0].mlp.up_proj.weight)


def test_norms_and_biases_get_no_weight_decay():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = parameter_groups(layer.named_parameters(), 0.1)
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    assert decayed == {id(layer[0].weight)}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A real LoRA run through the trainer (3 steps), for merge and generate."""
    from finetune.train.loop import train

    out = tmp_path_factory.mktemp("lora-run")
    recipe = _recipe(f"output_dir={out}", "adapter.type=lora", "adapter.r=4", "train.max_steps=3",
                     "train.lr=1e-2")
    train(recipe)
    return out, recipe


def test_merge_equals_base_plus_adapter(lora_run, data):
    from transformers import AutoModelForCausalLM

    from finetune.commands.generate import load_for_inference
    from finetune.commands.merge import merge_run

    out, recipe = lora_run
    _, batch = data
    merged_dir = merge_run(str(out), None)
    assert merged_dir == out / "merged"
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= \
        {p.name for p in merged_dir.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert merged.config.use_cache
    adapted, _ = load_for_inference(str(out))  # base rebuilt from the recipe + final/ adapter, on DEVICE
    merged.to(_device(adapted))  # both on one device: the same kernels, so the 1e-5 compares the merge alone
    assert (_logits(merged, batch) - _logits(adapted, batch)).abs().max() <= 1e-5
    # The adapter did something: the merged model is not the bare base.
    base = load_base(recipe.model, load_tokenizer(recipe.tokenizer, recipe.model), recipe.seed)
    assert (_logits(merged, batch) - _logits(base, batch)).abs().max() > 1e-4


def test_generate_through_an_adapter_run(lora_run, capsys):
    from finetune.commands.generate import GenerationOptions, generate

    out, _ = lora_run
    text = generate(str(out / "final"), "What is 2 + 3?", GenerationOptions(max_new_tokens=8, min_new_tokens=8))
    printed = capsys.readouterr().out
    assert text and text in printed


def test_merge_errors_are_clear(lora_run, tmp_path):
    from finetune.commands.merge import merge_run

    out, _ = lora_run
    with pytest.raises(UserError, match="not a run directory"):
        merge_run(str(tmp_path), None)
    (tmp_path / "recipe.yaml").write_text((out / "recipe.yaml").read_text())
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="nothing to merge"):
        merge_run(str(tmp_path), None)
    with pytest.raises(UserError, match="overwrite the run"):
        merge_run(str(out), str(out / "final"))
    versions = json.loads((out / "versions.json").read_text())
    (tmp_path / "final").rename(tmp_path / "old")
    (tmp_path / "final").symlink_to(out / "final")
    (tmp_path / "versions.json").write_text(json.dumps({**versions, "transformers": "4.0.0"}))
    with pytest.raises(UserError, match="random-init"):
        merge_run(str(tmp_path), None)


def test_pkg_paths_resolve_inside_installed_packages():
    import json as json_module

    expected = Path(json_module.__file__).parent / "decoder.py"
    assert resolve_path("pkg://json/decoder.py") == str(expected)
    assert resolve_path("/abs/model.gguf") == "/abs/model.gguf"
    with pytest.raises(UserError, match="(?s)not installed.*pip install no-such-package-xyz"):
        resolve_path("pkg://no_such_package_xyz/model.gguf")
    with pytest.raises(UserError, match="has no file"):
        resolve_path("pkg://json/no-such.gguf")


def _write_llama_gguf(model, path: Path) -> None:
    """A float32 GGUF of a tiny HF Llama, laid out the way llama.cpp's converter writes one (q/k rows permuted
    for its rope kernel; transformers undoes that on load). No tokenizer inside: recipes give tokenizer.path."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_embedding_length(c.hidden_size)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)

    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    for i, layer in enumerate(model.model.layers):
        for hf, gg in names.items():
            w = layer.get_submodule(hf).weight.detach()
            if gg == "attn_q":
                w = permute(w, c.num_attention_heads)
            elif gg == "attn_k":
                w = permute(w, c.num_key_value_heads)
            tensors[f"blk.{i}.{gg}.weight"] = w
    for name, w in tensors.items():  # tied embeddings: no output.weight, which tells transformers they are tied
        writer.add_tensor(name, w.detach().float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_model_loads_plain_saves_and_adapts(data, tmp_path):
    """A .gguf model.path: same logits as the model it was written from, a plain (savable) model whose saved
    copy reloads identically, and LoRA/QLoRA on it."""
    from transformers import AutoModelForCausalLM

    needs("gguf")  # transformers' GGUF loader and our writer
    tokenizer, batch = data
    source = load_model(_recipe().model, _recipe().adapter, tokenizer, 0).eval()
    _write_llama_gguf(source, tmp_path / "tiny.gguf")
    recipe = _recipe(f"model.path={tmp_path / 'tiny.gguf'}", "model.init=pretrained", "model.config=null")
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed)
    assert getattr(lm.config, "quantization_config", None) is None
    assert lm.get_output_embeddings().weight.data_ptr() == lm.get_input_embeddings().weight.data_ptr()
    assert (_logits(lm, batch) - _logits(source, batch)).abs().max() <= 1e-5
    save_final(lm, tokenizer, tmp_path / "final")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert (_logits(reloaded, batch) - _logits(source, batch)).abs().max() <= 1e-5
    for kind in ("lora", "qlora"):
        adapted = _recipe(f"model.path={tmp_path / 'tiny.gguf'}", "model.init=pretrained", "model.config=null",
                          f"adapter.type={kind}")
        peft_model = load_model(adapted.model, adapted.adapter, tokenizer, adapted.seed, DEVICE)
        assert _steps(peft_model, batch, adapted, 1)[0] > 0


def test_qlora_gradients_survive_an_eval_forward(data):
    """An eval-mode forward (the packing isolation check, a periodic eval) must not change the training math.
    On a CPU with AVX512-BF16, bitsandbytes would repack the 4-bit weights for inference on it, one way, and the
    adapter's gradients afterwards were 0.79 (relative) off. Where the CPU lacks it, this holds trivially."""
    needs("bitsandbytes")
    tokenizer, batch = data
    batch = batch.to(DEVICE)
    recipe = _recipe("adapter.type=qlora", "adapter.r=8")
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, DEVICE)

    def grads() -> torch.Tensor:
        lm.train()
        lm.zero_grad(set_to_none=True)
        net = CausalLMWithLoss(lm, "chunked", 64, 0.0, None)
        loss_sum, count = net(input_ids=batch.input_ids, labels=batch.labels,
                              position_ids=batch.position_ids)
        (loss_sum / count).backward()
        return torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None])

    before = grads()
    lm.eval()
    with torch.no_grad():
        lm(input_ids=batch.input_ids[:1, :8], use_cache=False)
    after = grads()
    assert before.numel() > 0 and torch.equal(before, after)
    # load_model itself runs an eval forward (the attention probe): so check the cause too, not only the effect.
    states = [m.weight.quant_state for m in lm.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert states and not any(getattr(q, "packing_format_for_cpu", False) for q in states)


# --- QLoRA in bf16 on each device (the CUDA variants run where there is a GPU: `make test-gpu`) -------------------

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs CUDA")])]


def _dequantized_reference(qlora, tokenizer):
    """A plain float32 LoRA model on the CPU holding exactly the QLoRA model's weights: every 4-bit weight
    dequantized, every other weight (adapter included) copied."""
    import bitsandbytes.functional as bnbf

    recipe = _recipe("adapter.type=lora", "adapter.r=8", "model.dtype=float32")
    ref = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed)
    own = dict(ref.named_parameters())
    for name, p in qlora.named_parameters():
        value = bnbf.dequantize_4bit(p.data, p.quant_state) if type(p).__name__ == "Params4bit" else p.data
        own[name].data.copy_(value.float().cpu().reshape(own[name].shape))
    return ref


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_bf16_adapter_gradients_equal_a_dequantized_fp32_reference(data, device):
    """QLoRA in bf16 (NF4 base, bf16 compute, the device's training loss) gives the adapter the gradients of plain
    float32 math on the dequantized weights, within bf16 tolerance (relative Frobenius <= 3e-2 per tensor)."""
    needs("bitsandbytes")
    from finetune.loss.fused import resolve_impl

    tokenizer, batch = data
    recipe = _recipe("adapter.type=qlora", "adapter.r=8", "model.dtype=bfloat16")
    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, torch.device(device))
    gen = torch.Generator().manual_seed(0)
    for name, p in lm.named_parameters():  # lora_B starts at 0 (so A's gradient would be 0): give both values
        if "lora_" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen).mul(0.05).to(p.device, p.dtype))
    ref = _dequantized_reference(lm, tokenizer)

    def lora_grads(model, impl: str) -> dict[str, torch.Tensor]:
        model.train()
        b = _on(model, batch)
        loss_sum, count = CausalLMWithLoss(model, impl, 64, 0.0, None)(
            input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids)
        (loss_sum / count).backward()
        return {n: p.grad.float().cpu() for n, p in model.named_parameters() if "lora_" in n}

    got = lora_grads(lm, resolve_impl("auto", torch.device(device)))
    want = lora_grads(ref, "torch")
    assert set(got) == set(want) and len(want) > 0
    errors = {n: float((got[n] - want[n]).norm() / want[n].norm()) for n in want}
    assert max(errors.values()) <= 3e-2, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_bf16_run_merges_into_base_plus_adapter(data, tmp_path, monkeypatch, device):
    """A QLoRA run trained in bf16 on the device, then `finetune merge`: every merged weight is base + scale x B @ A
    within bf16 rounding, every other weight is the base's, and the merged model computes what the base with the
    adapter computes."""
    needs("bitsandbytes")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.commands.generate import load_for_inference
    from finetune.commands.merge import merge_run
    from finetune.train.loop import train

    tokenizer, batch = data
    monkeypatch.setenv("FINETUNE_DEVICE", device)
    recipe = _recipe(f"output_dir={tmp_path / 'run'}", "adapter.type=qlora", "adapter.r=8", "model.dtype=bfloat16",
                     "train.max_steps=3", "train.lr=1e-2")
    out = train(recipe)
    merged = AutoModelForCausalLM.from_pretrained(merge_run(str(out), None))
    base = load_base(recipe.model, tokenizer, recipe.seed)
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    scale = recipe.adapter.alpha / recipe.adapter.r
    merged_w, base_w = merged.state_dict(), base.state_dict()
    adapted = set()
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        delta = scale * adapter[key.replace(".lora_A.", ".lora_B.")].float() @ a.float()
        expected = base_w[name].float() + delta
        # bf16 keeps 8 significant bits: the delta and the sum are each rounded once (<= 2^-8 relative each).
        bound = 2.0 ** -7 * (expected.abs() + delta.abs()) + 1e-6
        assert bool(((merged_w[name].float() - expected).abs() <= bound).all()), name
        assert float(delta.abs().max()) > 0, f"{name}: the adapter did not train"
        adapted.add(name)
    assert adapted
    for name in set(base_w) - adapted:
        assert torch.equal(merged_w[name], base_w[name]), name
    with_adapter, _ = load_for_inference(str(out))
    merged.to(_device(with_adapter))
    a, b = _logits(merged, batch).float(), _logits(with_adapter, batch).float()
    base_logits = _logits(base.to(_device(with_adapter)), batch).float()
    # Measured on a CPU: merged vs base + adapter 0.008 (bf16 noise), base alone vs base + adapter 0.88, of 0.65.
    assert float((a - b).abs().max()) <= 5e-2 * float(b.abs().max()), float((a - b).abs().max())
    assert float((a - base_logits).abs().max()) > 5e-2 * float(b.abs().max())  # the adapter changed the model
