"""model.config_overrides (finetune/model/config_overrides.py): keys set on a pretrained model's config before its
weights load, each checked against the config (an unknown key named with the close ones, before any weight is read);
a vision-language model's sub-config merged key by key; refused with init: random."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL_CONFIG, TOKENIZER_DIR

from finetune.errors import UserError
from finetune.model.config_overrides import apply_overrides
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import AdapterConfig, ModelConfig, TokenizerConfig, validate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in TINY_MODEL_CONFIG.items() if k != "model_type"}
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("overrides")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **values, vocab_size=1024)).save_pretrained(path)
    return str(path)


def _tokenizer():
    return load_tokenizer(TokenizerConfig(path=str(TOKENIZER_DIR)), ModelConfig(init="random"))


def test_an_override_changes_the_loaded_config_and_not_the_weights(model_dir):
    tok = _tokenizer()
    plain = load_model(ModelConfig(path=model_dir), AdapterConfig(), tok, seed=0)
    overrides = {"attention_dropout": 0.25, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}
    lm = load_model(ModelConfig(path=model_dir, config_overrides=overrides), AdapterConfig(), tok, seed=0)
    assert plain.config.attention_dropout == 0.0 and lm.config.attention_dropout == 0.25
    assert lm.config.rope_parameters["rope_theta"] == 5000.0
    assert lm.model.layers[0].self_attn.attention_dropout == 0.25  # the model was built from the overridden config
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), lm.state_dict().values()))


def test_an_unknown_key_is_refused_before_any_weight_loads(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    def never(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    tok = _tokenizer()
    with pytest.raises(UserError, match=r"model\.config_overrides\.attention_dropot: LlamaConfig has no key "
                                        r"'attention_dropot'; did you mean attention_dropout"):
        load_model(ModelConfig(path=model_dir, config_overrides={"attention_dropot": 0.1}), AdapterConfig(), tok, 0)
    # transformers 5 keeps rope_theta inside rope_parameters: the message says so.
    with pytest.raises(UserError, match=r"rope_theta.*rope_parameters has it: write \{rope_parameters: "):
        load_model(ModelConfig(path=model_dir, config_overrides={"rope_theta": 1e6}), AdapterConfig(), tok, 0)
    with pytest.raises(UserError, match=r"attention_dropout: 'high' is refused by LlamaConfig"):
        load_model(ModelConfig(path=model_dir, config_overrides={"attention_dropout": "high"}), AdapterConfig(), tok, 0)


def test_a_sub_config_is_merged_and_a_nested_key_is_pointed_to():
    from transformers import Qwen2VLConfig

    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    config = Qwen2VLConfig(text_config=text, vision_config={"depth": 1, "embed_dim": 32, "num_heads": 2})
    apply_overrides(config, {"text_config": {"attention_dropout": 0.5}})
    assert config.text_config.attention_dropout == 0.5 and config.text_config.hidden_size == 32  # merged, kept
    with pytest.raises(UserError, match=r"config_overrides\.attention_dropout: Qwen2VLConfig has no key "
                                        r"'attention_dropout'; its text_config has it: write \{text_config: "):
        apply_overrides(config, {"attention_dropout": 0.5})
    with pytest.raises(UserError, match=r"text_config: text_config is a sub-config"):
        apply_overrides(config, {"text_config": 3})
    with pytest.raises(UserError, match=r"config_overrides\.text_config\.hiden_size: .*did you mean hidden_size"):
        apply_overrides(config, {"text_config": {"hiden_size": 3}})


def test_overrides_are_refused_with_random_init():
    raw = {"model": {"init": "random", "config": dict(TINY_MODEL_CONFIG), "config_overrides": {"rope_theta": 1.0}},
           "tokenizer": {"path": str(TOKENIZER_DIR)}, "datasets": [{"path": "x.jsonl"}]}
    with pytest.raises(UserError, match=r"model\.config_overrides: only with init: pretrained"):
        validate(raw)
