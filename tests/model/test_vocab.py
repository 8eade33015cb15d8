"""The vocabulary a recipe asks for (finetune/model/vocab.py): special-token overrides and added tokens, the embedding
resized for them, the new rows trained (full fine-tuning, LoRA with modules_to_save: through the fused loss, tied
or not) and a run that would leave them untrained refused; shipped chat templates by name."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL_CONFIG, TOKENIZER_DIR

from finetune import templates
from finetune.errors import UserError
from finetune.model.loading import load_model, output_layer
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import AdapterConfig, ModelConfig, TokenizerConfig, validate

BASE_ROWS = 1024  # the example tokenizer's length, and so the tiny model's vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Two tiny pretrained-style models with the example tokenizer's 1024 rows: tied and untied embeddings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = {}
    for tie in (True, False):
        values = {k: v for k, v in TINY_MODEL_CONFIG.items() if k != "model_type"}
        config = AutoConfig.for_model("llama", **{**values, "tie_word_embeddings": tie, "vocab_size": BASE_ROWS})
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"tied{tie}")
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        dirs[tie] = str(path)
    return dirs


def _tokenizer(**kwargs):
    return load_tokenizer(TokenizerConfig(path=str(TOKENIZER_DIR), **kwargs), ModelConfig(init="random"))


def test_special_tokens_and_added_tokens_change_the_tokenizer():
    tok = _tokenizer(special_tokens={"eos_token": "<|turn_end|>", "bos_token": "<|im_start|>"},
                     added_tokens=["<tool>", "<|im_start|>"], added_special_tokens=["<x>"])
    assert tok.eos_token == "<|turn_end|>" and tok.eos_token_id == BASE_ROWS  # new: the next id
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id < BASE_ROWS  # already there: its own id
    assert len(tok) == BASE_ROWS + 3  # <|turn_end|>, <tool>, <x>; <|im_start|> was in the vocabulary
    assert tok("a<tool>b")["input_ids"][1] == tok.convert_tokens_to_ids("<tool>")  # kept whole, never split


@pytest.mark.parametrize("tie", [True, False])
def test_lora_with_modules_to_save_trains_the_new_rows_through_the_fused_loss(model_dir, tie):
    tok = _tokenizer(added_tokens=["<new1>", "<new2>"])
    cfg = ModelConfig(path=model_dir[tie], vocab_multiple_of=8)
    lm = load_model(cfg, AdapterConfig(type="lora", modules_to_save=["embed_tokens", "lm_head"]), tok, seed=0)
    embed, head = lm.get_input_embeddings(), output_layer(lm)[1]
    assert embed.weight.shape[0] == head.weight.shape[0] == 1032  # 1026 rounded up to a multiple of 8
    assert (embed.weight.data_ptr() == head.weight.data_ptr()) == tie  # a tied model stays tied
    ids = torch.tensor([[5, BASE_ROWS, BASE_ROWS + 1, 7]])
    loss, _ = CausalLMWithLoss(lm, "chunked", 64, 0.0, None)(ids, ids.clone())
    loss.backward()
    # The input rows of the new tokens and the output rows they are predicted from both get gradients.
    assert embed.weight.grad[BASE_ROWS:BASE_ROWS + 2].abs().sum() > 0
    assert head.weight.grad[BASE_ROWS:BASE_ROWS + 2].abs().sum() > 0


@pytest.mark.parametrize("modules", [None, ["embed_tokens"]])
def test_lora_that_would_leave_new_rows_untrained_is_refused(model_dir, modules):
    tok = _tokenizer(special_tokens={"eos_token": "<|turn_end|>"})
    with pytest.raises(UserError, match=r"adds 1 tokens \('<\|turn_end\|>'\).*modules_to_save: \[embed_tokens, "
                                        r"lm_head\]"):
        load_model(ModelConfig(path=model_dir[False]), AdapterConfig(type="lora", modules_to_save=modules), tok, 0)


def test_full_fine_tuning_trains_new_rows_unless_trainable_parameters_leaves_them_out(model_dir):
    tok = _tokenizer(added_tokens=["<new1>"])
    lm = load_model(ModelConfig(path=model_dir[True]), AdapterConfig(), tok, 0)
    assert lm.get_input_embeddings().weight.shape[0] == BASE_ROWS + 1 and lm.get_input_embeddings().weight.requires_grad
    with pytest.raises(UserError, match="would never train"):
        load_model(ModelConfig(path=model_dir[True]), AdapterConfig(), tok, 0, trainable=[r"model\.layers\."])


def test_a_new_pad_token_needs_no_training_and_spare_rows_are_not_resized(model_dir):
    tok = _tokenizer(special_tokens={"pad_token": "<pad>"})  # never a target nor attended to
    lm = load_model(ModelConfig(path=model_dir[False]), AdapterConfig(type="lora"), tok, 0)
    assert lm.get_input_embeddings().weight.shape[0] == BASE_ROWS + 1
    # A model with rows to spare keeps its size (Axolotl's rule): no resize, nothing to refuse.
    tok = _tokenizer()
    lm = load_model(ModelConfig(path=model_dir[False], vocab_multiple_of=16), AdapterConfig(type="lora"), tok, 0)
    assert lm.get_input_embeddings().weight.shape[0] == BASE_ROWS


def test_mean_resizing_off_gives_the_models_own_init(model_dir):
    tok = _tokenizer(added_tokens=["<new1>"])
    means = {}
    for mean in (True, False):
        lm = load_model(ModelConfig(path=model_dir[False], mean_resizing=mean), AdapterConfig(), tok, 0)
        weight = lm.get_input_embeddings().weight.detach()
        means[mean] = (weight[BASE_ROWS] - weight[:BASE_ROWS].mean(0)).norm().item()
    assert means[True] < means[False]  # the mean of the others (and their spread), or an ordinary random row


def test_shipped_templates_render_and_names_are_checked():
    tok = _tokenizer(special_tokens={"bos_token": "<|endoftext|>"})  # Llama's and Gemma's templates start with it
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for name in templates.TEMPLATES:
        text = tok.apply_chat_template(conversation, chat_template=templates.chat_template(name), tokenize=False)
        assert "Hi" in text and "Hello" in text, name
    assert _tokenizer(chat_template="chatml").chat_template == templates.chat_template("chatml")
    raw = {"model": {"path": "m"}, "datasets": [{"path": "d.jsonl"}], "tokenizer": {"chat_template": "qwen25"}}
    with pytest.raises(UserError, match="'qwen25' is no chat template shipped with finetune.*did you mean 'qwen2_5'"):
        validate(raw)
    raw["tokenizer"]["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    validate(raw)  # Jinja text is taken as it is
