"""model.experts_implementation: transformers' ways of running a mixture-of-experts model's fused experts, chosen in
the recipe. Each is set on the loaded model and trains the same numbers (a tiny Qwen3-MoE); a setting on a model
without fused experts is refused rather than ignored."""

from __future__ import annotations

import pytest
import torch

from finetune.errors import UserError
from finetune.model.experts import experts_implementation
from finetune.model.loading import load_model
from finetune.recipe import AdapterConfig, ModelConfig

MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
       "num_experts_per_tok": 2, "head_dim": 8, "max_position_embeddings": 256}
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _loss_and_grads(lm: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    loss = lm(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in lm.parameters()])


def test_each_implementation_is_set_and_trains_the_same_numbers(tokenizer):
    ids = torch.randint(3, 500, (2, 24))
    results = {}
    for setting in ("auto", "eager", "grouped_mm", "batched_mm"):
        lm = load_model(ModelConfig(init="random", config=dict(MOE), experts_implementation=setting), AdapterConfig(),
                        tokenizer, seed=0)
        assert experts_implementation(lm) == ("grouped_mm" if setting == "auto" else setting)
        results[setting] = _loss_and_grads(lm, ids)
    loss, grads = results["eager"]
    for setting, (other_loss, other_grads) in results.items():
        assert abs(other_loss - loss) <= 1e-5 * abs(loss), setting
        assert float((other_grads - grads).norm() / grads.norm()) <= 1e-5, setting


def test_a_model_without_fused_experts_has_none_and_refuses_a_setting(tokenizer):
    assert experts_implementation(load_model(ModelConfig(init="random", config=dict(LLAMA)), AdapterConfig(),
                                             tokenizer, seed=0)) is None
    with pytest.raises(UserError, match="model.experts_implementation: eager, but LlamaForCausalLM has no fused "
                                        "experts"):
        load_model(ModelConfig(init="random", config=dict(LLAMA), experts_implementation="eager"), AdapterConfig(),
                   tokenizer, seed=0)
