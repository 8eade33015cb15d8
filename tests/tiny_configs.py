"""Tiny configs for every causal LM architecture of the pinned transformers: generic sizes applied to the keys a
config has (hidden 32, 2 layers, 4 heads of 8, ...), head knobs set away from their defaults so that a transform
the fused loss ignored shows, and what the generic sizes cannot say, with why (tests/model_matrix.py uses them).
"""

from __future__ import annotations

import re

VOCAB = 256  # the tiny models' vocabulary
TOKENS = 200  # the stub tokenizer's length: ids below it (Inkling's vocabulary slice is 200 of the 256)

# Generic sizes, applied to the keys a config has: hidden 32, 2 layers, 4 heads of 8, 2 key/value heads, 4 experts
# (top 2, one shared), MLA ranks 16, Mamba state 8 with heads of 8, per-layer lists cut to 2 keeping both kinds.
H, FF = 32, 64
_SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embedding_dim", "emb_dim", "dim", "lru_width",
                     "attention_hidden_size", "router_hidden_size", "output_embedding_size", "input_embedding_size",
                     "word_embed_proj_dim", "embedding_size"), H),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_blocks", "decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "attention_heads", "swa_num_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads"), 2),
    **dict.fromkeys(("head_dim", "attention_head_dim", "d_head", "kv_channels", "dim_head", "swa_head_dim"), 8),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "d_inner", "dff", "ffn_hidden_size",
                     "n_inner", "dim_ff", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "shared_experts_intermediate_size", "shared_intermediate_size",
                     "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size", "dense_intermediate_size",
                     "intermediate_size_mlp", "mamba_d_ssm"), FF),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k_experts"), 2),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group", "n_shared_experts", "num_shared_experts",
                     "moe_num_shared_experts", "first_k_dense_replace", "mamba_n_groups", "n_groups",
                     "mamba_ngroups"), 1),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank", "qk_head_dim", "index_head_dim",
                     "chunk_size", "mamba_chunk_size"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "mamba_d_state", "ssm_state_size",
                     "state_size", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "mamba_d_head",
                     "mamba_head_dim", "mamba_headdim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_head_dim", "hidden_size_per_layer_input", "ple_embed_dim"), 8),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 512),
    **dict.fromkeys(("index_n_heads", "linear_num_key_heads"), 2),
    **dict.fromkeys(("linear_num_value_heads", "linear_num_heads", "mamba_dt_rank", "time_step_rank",
                     "laurel_rank", "adapter_rank", "rotary_dim"), 4),
}
_KEEP_NONE = {"q_lora_rank", "o_lora_rank", "max_seq_len"}  # None means "off" for these
_LAYER_LISTS = ("layer_types", "mlp_layer_types", "attention_layers", "indexer_types", "no_rope_layers",
                "layer_rope_theta", "num_attention_heads_per_layer", "activation_sparsity_pattern",
                "layers_block_type", "block_types")
# Head and loss knobs set away from their defaults, so that a transform the fused loss ignored shows in the loss.
# The last three act inside the backbone and need no honouring: set too, to show it.
_PROBES = {"logits_scaling": 3.0, "logit_scale": 0.37, "lm_head_multiplier": 0.7, "final_logit_softcapping": 4.0,
           "logits_soft_cap": 4.0, "output_logit_soft_cap": 4.0, "logits_mup_width_multiplier": 2.0,
           "unpadded_vocab_size": TOKENS, "embedding_multiplier": 2.0, "scale_emb": 2.0, "residual_multiplier": 0.5}
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# What the generic sizes cannot say, with why.
_SPECIAL: dict[str, dict] = {
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # the default is all attention
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # the default None fails
    "mamba2": {"num_heads": 8, "head_dim": 8},  # hidden * expand == heads * head_dim
    "zaya": {"num_experts_per_tok": 1},  # the only value ZAYA supports
    # MLA (with a sparse-attention indexer, or next to linear attention): as many key heads as query heads, as
    # their defaults have (with fewer, their masked attention fails)
    **dict.fromkeys(("axk2", "deepseek_v32", "glm_moe_dsa", "kimi_linear", "bailing_hybrid"),
                    {"num_key_value_heads": 4}),
    "dots3_note_text": {"num_key_value_heads": 4, "per_layer_config": {"1": {  # default: a 37M-parameter layer
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "head_dim": 16,
        "qk_nope_head_dim": 8, "v_head_dim": 8, "qk_rope_head_dim": 8}}},
    "longcat_flash": {"zero_expert_num": 2},  # 256 identity experts by default
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # the default is all Mamba
    "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"], "num_hidden_layers": 4},
    "roc_bert": {"shape_vocab_size": 64, "pronunciation_vocab_size": 64, "shape_embed_dim": 16,
                 "pronunciation_embed_dim": 16},
    "gemma3n_text": {"num_kv_shared_layers": 0, "intermediate_size": [FF, FF]},  # a per-layer list
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},  # all five or none
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    # transformers 5.23.0 reads attn_config.rope_theta, which DbrxAttentionConfig does not define
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": FF, "moe_num_experts": 4, "moe_top_k": 2}},
    # the shared attention block reads [hidden, embeddings]: twice the hidden size
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 2 * H, "attention_head_dim": 2 * H // 4},
    "zamba2": {"attention_hidden_size": 2 * H, "attention_head_dim": 2 * H // 4, "kv_channels": 2 * H // 4},
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_shape": [16, 32], "axial_pos_embds_dim": [16, 16],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 4,
                 "attention_head_size": 8, "feed_forward_size": FF},
    # byte-level: an entropy patcher, local encoder and decoder, and a global transformer, each a sub-config
    "blt": {"max_position_embeddings": 512, "encoder_hash_byte_group_size": [3, 4],
            "encoder_hash_byte_group_vocab": 64, "local_attention_window_len": 64, "cross_attn_k": 2,
            **{f"{part}_config": {"num_hidden_layers": 1, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
                                  "max_position_embeddings": 512, **sizes} for part, sizes in (
                ("patcher", {"hidden_size": H, "intermediate_size": FF}),
                ("encoder", {"hidden_size": H, "hidden_size_global": 2 * H}),
                ("decoder", {"hidden_size": H, "hidden_size_global": 2 * H, "intermediate_size": FF}),
                ("global", {"hidden_size": 2 * H, "intermediate_size": 2 * FF}))}},
}
# Encoders that are causal LMs only as decoders (else bidirectional).
for _mt in ("bert", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert", "rembert",
            "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
            "reformer"):
    _SPECIAL.setdefault(_mt, {})["is_decoder"] = True


def _cut(values: list) -> list:
    """A per-layer list cut to 2 entries: the first and the first different one (both kinds of a hybrid)."""
    other = [v for v in values if v != values[0]][:1]
    return [values[0], *(other or [values[0]])]


def tiny_kwargs(model_type: str, vocab: int = VOCAB) -> dict:
    """The config of a tiny `model_type` (model.config of a recipe, less model_type)."""
    from transformers import AutoConfig

    if model_type == "llama4":  # a multimodal config around the text model
        return {"text_config": {"model_type": "llama4_text", **tiny_kwargs("llama4_text", vocab)}}
    kwargs: dict = {}
    for key, value in AutoConfig.for_model(model_type).to_dict().items():
        if key in _SIZES and (type(value) is int or value is None and key not in _KEEP_NONE):
            kwargs[key] = _SIZES[key]
        elif key in ("vocab_size", "vocab_size_per_layer_input"):
            kwargs[key] = vocab
        elif key == "mlp_only_layers" and isinstance(value, list) and value:
            kwargs[key] = [0]  # the first layer dense, the second MoE
        elif key in _LAYER_LISTS and isinstance(value, list) and value:
            kwargs[key] = _cut(value)
        elif re.search(r"dropout|pdrop|_drop$", key) and isinstance(value, float):
            kwargs[key] = 0.0
        elif key in _PROBES and (value is None or type(value) in (int, float)):
            kwargs[key] = _PROBES[key] if key != "unpadded_vocab_size" or vocab == VOCAB else vocab
        elif key in IDS:
            kwargs[key] = IDS[key]
    kwargs.update(_SPECIAL.get(model_type, {}))
    if model_type == "blt":  # bytes (256 and 4 special ids), or a tokenizer's ids, in every part
        kwargs["vocab_size"] = max(vocab, 260)
        for part in ("patcher_config", "encoder_config", "decoder_config"):
            kwargs[part] = {**kwargs[part], "vocab_size": kwargs["vocab_size"]}
    return kwargs


class StubTokenizer:
    """What finetune.model.loading reads from a tokenizer when it builds a random-init model."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return TOKENS
