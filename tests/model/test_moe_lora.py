"""adapter.target_parameters (PEFT's target_parameters): LoRA on a mixture-of-experts model's fused 3-D expert weights
(transformers 5 keeps each layer's experts in one tensor, which no module name reaches: PEFT #3009, Unsloth #6936).
Checked on a tiny Qwen3-MoE: the adapter is trained by the loss, changes every routed expert's weights when merged,
and the merged model computes what the adapted one does; a name that reaches no parameter is refused."""

from __future__ import annotations

import pytest
import torch

from finetune.errors import UserError
from finetune.model.loading import load_model
from finetune.recipe import AdapterConfig, ModelConfig

MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
       "num_experts_per_tok": 2, "head_dim": 8, "max_position_embeddings": 256}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _moe_lora(tokenizer, targets: list[str], modules: list[str] | str = "all-linear") -> torch.nn.Module:
    adapter = AdapterConfig(type="lora", r=4, alpha=8, target_modules=modules, target_parameters=targets)
    return load_model(ModelConfig(init="random", config=dict(MOE)), adapter, tokenizer, seed=0,
                      device=torch.device("cpu"))


def test_the_loss_trains_a_lora_on_every_layers_experts(tokenizer):
    lm = _moe_lora(tokenizer, EXPERTS, modules=["q_proj"])
    ids = torch.randint(3, 500, (2, 24))
    lm(input_ids=ids, labels=ids).loss.backward()
    experts = {n: p for n, p in lm.named_parameters() if p.requires_grad and ".experts." in n}
    assert len(experts) == 2 * 2 * 2  # (A, B) x (gate_up_proj, down_proj) x 2 layers
    for name, p in experts.items():
        if "lora_A" in name:  # B starts at 0: A's gradient is 0 at step 0, B's is not
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_a_merged_expert_lora_changes_every_expert_and_computes_the_adapted_model(tokenizer):
    lm = _moe_lora(tokenizer, EXPERTS).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    plain = load_model(ModelConfig(init="random", config=dict(MOE)), AdapterConfig(), tokenizer, seed=0,
                       device=torch.device("cpu"))  # the same seed: the base's weights
    base = dict(plain.named_parameters())
    ids = torch.randint(3, 500, (1, 16))
    with torch.no_grad():
        adapted = lm(input_ids=ids).logits
    merged = lm.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
    changed = 0
    for name, weight in merged.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert weight.shape[0] == MOE["num_experts"]
            for e in range(MOE["num_experts"]):
                assert not torch.equal(weight[e], base[name][e]), (name, e)  # every expert reached
            changed += 1
        elif "norm" in name or "embed" in name:
            assert torch.equal(weight, base[name]), name  # what no LoRA targets did not move
    assert changed == 2 * 2


def test_a_target_parameter_that_names_nothing_is_refused_with_the_fused_ones(tokenizer):
    with pytest.raises(UserError, match=r"'mlp.experts.up_proj' names no parameter.*mlp.experts.down_proj, "
                                        r"mlp.experts.gate_up_proj"):
        _moe_lora(tokenizer, ["mlp.experts.up_proj"])


def test_rslora_scales_by_the_square_root_of_the_rank(tokenizer):
    """adapter.use_rslora: every LoRA layer's scale is alpha / sqrt(r) (PEFT's rsLoRA), not alpha / r."""
    from peft.tuners.lora import LoraLayer

    for rslora, scale in ((False, 8 / 16), (True, 8 / 4)):
        adapter = AdapterConfig(type="lora", r=16, alpha=8, target_modules=["q_proj"], use_rslora=rslora)
        lm = load_model(ModelConfig(init="random", config=dict(MOE)), adapter, tokenizer, seed=0,
                        device=torch.device("cpu"))
        layers = [m for m in lm.modules() if isinstance(m, LoraLayer)]
        assert len(layers) == 2 and all(m.scaling["default"] == pytest.approx(scale) for m in layers)
