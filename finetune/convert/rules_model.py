"""Rules for the model, its precision and attention, the tokenizer and the adapter (keys.MAPPED documents them)."""

from __future__ import annotations

import re

from finetune.convert.context import Conversion, is_off
from finetune.convert.rules_vision import is_vision


def model_rules(c: Conversion) -> None:
    """base_model, tokenizer_config, trust_remote_code, type_of_model, gradient_checkpointing,
    resize_token_embeddings_to_32x, mean_resizing_embeddings, tokenizer_type, tokenizer_use_fast."""
    base = c.text("base_model")
    if base is None:
        c.refuse("base_model", "required: the model to fine-tune (a hub id or a local directory)")
    else:
        c.put("model.path", base)
    if c.has("tokenizer_config"):
        c.put("tokenizer.path", c.text("tokenizer_config"))
    if c.boolean("trust_remote_code"):
        c.put("model.trust_remote_code", True)
    for key in ("type_of_model", "model_type"):
        _model_class(c, key)
    checkpointing = c.get("gradient_checkpointing")
    if checkpointing in (True, "offload", "offload_disk"):
        c.put("model.gradient_checkpointing", True)
    elif checkpointing not in (None, False):
        c.refuse("gradient_checkpointing", f"got {checkpointing!r}; Axolotl expects true, false, offload or "
                                           "offload_disk")
    if c.boolean("resize_token_embeddings_to_32x"):
        c.put("model.vocab_multiple_of", 32)
    if c.has("tokens") or c.has("special_tokens") or c.has("resize_token_embeddings_to_32x"):
        c.carry("mean_resizing_embeddings", "model.mean_resizing", bool(c.boolean("mean_resizing_embeddings", False)),
                "new embedding rows start at the model's own init")
    tokenizer_type = c.text("tokenizer_type")
    if tokenizer_type not in (None, "AutoTokenizer"):
        c.approximate("tokenizer_type", f"the tokenizer loads with AutoTokenizer, not {tokenizer_type} (transformers "
                                        "5 takes the class from tokenizer_config.json)")
    if c.boolean("tokenizer_use_fast") is False:
        c.approximate("tokenizer_use_fast", "the tokenizer loads as transformers 5 loads it (its fast backend)")
    _config_overrides(c)


def _config_overrides(c: Conversion) -> None:
    """model_config (overrides_of_model_config: Axolotl's field, model_config its alias) -> model.config_overrides:
    Axolotl sets each key on the loaded config before the weights load, as finetune does."""
    given = {key: c.mapping(key) for key in ("model_config", "overrides_of_model_config") if c.mapping(key)}
    if len(given) == 2 and given["model_config"] != given["overrides_of_model_config"]:
        c.refuse("overrides_of_model_config", "model_config is its other name, set to something else: keep one")
        return
    for overrides in given.values():
        c.put("model.config_overrides", dict(overrides))


def router_loss_rules(c: Conversion) -> None:
    """model_config: {output_router_logits: true}: the MoE router's load-balancing loss, added by finetune as the
    model's own forward adds it, for SFT only. Its weight in a step differs from Axolotl's, which trains with
    transformers' Trainer: there each micro-batch backpropagates the cross-entropy over the step's targets plus
    router_aux_loss_coef x its own load-balancing loss, undivided, times the number of processes
    (average_tokens_across_devices), so a step adds the coefficient times the SUM of its micro-batches' values over
    every rank; finetune adds their mean, weighted by target tokens (docs/models.md). After the objective and the
    batch rules (it reads what they wrote)."""
    if not (c.peek("model.config_overrides") or {}).get("output_router_logits"):
        return
    key = "model_config" if c.has("model_config") else "overrides_of_model_config"
    objective = c.peek("train.objective", "sft")
    if objective != "sft":
        c.refuse(key, f"output_router_logits: true with train.objective {objective}: finetune adds the MoE router's "
                      "load-balancing loss to supervised fine-tuning only; remove it, or set it false")
        return
    steps = c.peek("train.gradient_accumulation_steps", 1)
    if steps > 1:
        c.approximate(key, f"output_router_logits: true: a step of Axolotl (transformers' Trainer) adds "
                           f"router_aux_loss_coef x the sum of its {steps} micro-batches' load-balancing losses, "
                           "finetune x their mean weighted by target tokens (docs/models.md): the router term weighs "
                           f"{steps} times less here (model.config_overrides.router_aux_loss_coef: {steps} x the "
                           "model's weighs it as Axolotl does), and N times less again on N GPUs")
    else:
        c.note(f"{key}: output_router_logits: true: the MoE router's load-balancing loss is added as the model's own "
               "forward adds it; on N GPUs a step of Axolotl (transformers' Trainer) adds router_aux_loss_coef x the "
               "sum of the ranks' values, finetune x their mean weighted by target tokens, N times less "
               "(docs/models.md)")


def _model_class(c: Conversion, key: str) -> None:
    name = c.text(key)
    if name is None or name == "AutoModelForCausalLM" or name.endswith("ForCausalLM"):
        return
    if name.endswith("SequenceClassification") and c.get("reward_model") is True:
        return  # a reward model loads as one (train.objective: reward)
    if name.endswith(("SequenceClassification", "TokenClassification")):
        c.refuse(key, f"{name}: reward and classification models are not supported (finetune trains causal LMs)")
    elif name.endswith(("ConditionalGeneration", "ImageTextToText", "Vision2Seq")) and not is_vision(c):
        c.refuse(key, f"{name}: a multimodal model without processor_type, which Axolotl's multimodal path needs "
                      "(finetune then loads it with AutoModelForImageTextToText)")
    elif name.endswith(("ConditionalGeneration", "ImageTextToText", "Vision2Seq")):
        return  # finetune loads a vision-language model with AutoModelForImageTextToText
    else:
        c.refuse(key, f"{name}: finetune loads AutoModelForCausalLM only")


def precision_rules(c: Conversion) -> None:
    """bf16, bfloat16, fp16, float16, float32 -> model.dtype, as Axolotl's resolve_dtype picks the load dtype."""
    bf16 = c.get("bf16", "auto")
    if bf16 not in (True, False, "auto", "full"):
        c.refuse("bf16", f"got {bf16!r}; Axolotl expects true, false, auto or full")
        return
    fp16, float16, bfloat16 = c.boolean("fp16"), c.boolean("float16"), c.boolean("bfloat16")
    if bf16 == "auto":
        bf16 = not fp16  # Axolotl: bf16 wherever the GPU has it (Ampere and newer), else fp16
        if bf16:
            c.note("bf16: auto is bfloat16 here, as Axolotl picks it on Ampere or newer GPUs (float16 before)")
    if bfloat16 or bf16:
        dtype = "bfloat16"
    elif c.boolean("load_in_8bit") or fp16 or float16:
        dtype = "float16"
    else:
        dtype = "float32"
    c.put("model.dtype", dtype)
    c.boolean("float32")  # float32 is what is left when nothing else is set
    if dtype == "float16" and fp16 and not c.boolean("load_in_8bit"):
        c.approximate("fp16", "the model trains in float16 without Hugging Face's loss scaling (bf16: true is "
                              "exact where the GPU has it)")


def attention_rules(c: Conversion) -> None:
    """attn_implementation and the old flags: every exact kernel computes the same attention, so the recipe keeps
    finetune's auto (sdpa, one packed document at a time) and runs anywhere; sage (quantized) is approximate."""
    choice = c.text("attn_implementation")
    for flag, name in (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa"),
                       ("eager_attention", "eager")):
        if c.boolean(flag):
            choice = choice or name
    if choice == "sage":
        c.approximate("attn_implementation", "exact attention (SageAttention quantizes it)")
    elif choice == "eager":
        c.put("model.attn_implementation", "eager")
    elif choice is not None:
        c.note(f"attention {choice}: model.attn_implementation auto computes the same attention anywhere (set "
               "flash_attention_2 by hand for the flash-attn kernels on CUDA)")


def adapter_rules(c: Conversion) -> None:
    """adapter, load_in_4bit, load_in_8bit, lora_* , bnb_config_kwargs -> the adapter section."""
    adapter = c.text("adapter")
    four, eight = c.boolean("load_in_4bit", False), c.boolean("load_in_8bit", False)
    if adapter is None:
        for key, on in (("load_in_4bit", four), ("load_in_8bit", eight)):
            if on:
                c.refuse(key, "a quantized base without an adapter cannot be trained (Axolotl refuses it too)")
        return
    if adapter not in ("lora", "qlora"):
        c.refuse("adapter", f"{adapter!r}: finetune trains LoRA and QLoRA adapters only")
        return
    kind = "qlora" if adapter == "qlora" or four else "lora"
    if eight:
        c.approximate("load_in_8bit", "LoRA on the unquantized base (finetune has no 8-bit base; qlora is 4-bit)")
    c.put("adapter.type", kind)
    c.carry("lora_r", "adapter.r", c.integer("lora_r", 8, minimum=1), "PEFT's default rank")
    alpha = c.number("lora_alpha", 8)
    c.carry("lora_alpha", "adapter.alpha", int(alpha) if alpha == int(alpha) else alpha, "PEFT's default alpha")
    if c.number("lora_dropout", 0.0):
        c.put("adapter.dropout", c.number("lora_dropout"))
    if c.get("peft_use_rslora") is True:
        c.put("adapter.use_rslora", True)
    _targets(c)
    if c.has("lora_modules_to_save"):
        c.put("adapter.modules_to_save", c.texts("lora_modules_to_save"))
    if c.has("lora_target_parameters"):
        c.put("adapter.target_parameters", c.texts("lora_target_parameters"))
    _bnb(c, kind)
    if kind == "qlora" and c.peek("model.dtype") == "float16":
        c.approximate("fp16", "QLoRA computes in bfloat16 here (finetune's QLoRA takes float32 or bfloat16)")
        c.put("model.dtype", "bfloat16")


def _targets(c: Conversion) -> None:
    modules = c.get("lora_target_modules")
    if c.boolean("lora_target_linear"):
        if isinstance(modules, list) and {"lm_head", "embed_tokens"} & set(modules):
            c.refuse("lora_target_modules", "LoRA on the embedding or the output layer is not supported; train them "
                                            "in full with lora_modules_to_save")
        return  # all-linear, finetune's default
    if isinstance(modules, str):
        try:
            re.compile(modules)
        except re.error as e:
            c.refuse("lora_target_modules", f"{modules!r} is not a regular expression ({e})")
            return
        c.put("adapter.target_modules", modules)
    elif modules:
        c.put("adapter.target_modules", c.texts("lora_target_modules"))
    else:
        c.approximate("lora_target_modules", "adapter.target_modules: all-linear (Axolotl, given neither "
                      "lora_target_modules nor lora_target_linear, leaves PEFT's per-architecture default, e.g. "
                      "q_proj and v_proj for Llama)")


# What finetune's QLoRA base is (model._nf4_config); storage dtype and fp16-weight flags change nothing computed.
_NF4 = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
_NF4_HARMLESS = ("bnb_4bit_quant_storage", "llm_int8_has_fp16_weight", "bnb_4bit_compute_dtype")


def _bnb(c: Conversion, kind: str) -> None:
    kwargs = c.mapping("bnb_config_kwargs")
    if not kwargs:
        return
    different = {k: v for k, v in kwargs.items() if k not in _NF4_HARMLESS and _NF4.get(k, object()) != v}
    if kind != "qlora":
        c.drop("bnb_config_kwargs", "only read for a 4-bit base")
    elif different:
        c.refuse("bnb_config_kwargs", f"{different}: finetune's QLoRA base is NF4 with double quantization only")


def unfrozen_rules(c: Conversion) -> None:
    """unfrozen_parameters -> train.trainable_parameters, translated as Axolotl compiles them: every '.' not
    followed by '+' is a literal dot, the pattern matched from the start of the name (re.match)."""
    patterns = c.texts("unfrozen_parameters")
    if not patterns:
        return
    if not is_off(c.get("adapter")):
        c.refuse("unfrozen_parameters", "with an adapter, Axolotl matches these against names that start "
                 "base_model.model. and so freezes every parameter, the adapter's too; remove them (the adapter "
                 "chooses what trains) or train without an adapter")
        return
    out = []
    for pattern in patterns:
        if re.match(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$", pattern):
            c.refuse("unfrozen_parameters", f"{pattern!r}: training some rows of a parameter is not supported")
            continue
        out.append(re.sub(r"\.(?!\+)", r"\\.", pattern))
    c.put("train.trainable_parameters", out)


_QAT_DTYPES = {"weight_dtype": ("int4", "int8", "nvfp4", "mxfp4"), "activation_dtype": ("int8", "nvfp4", "mxfp4")}


def qat_rules(c: Conversion) -> None:
    """qat: -> the qat: section, key for key (Axolotl's weight_dtype defaults to int8, its group_size to 32, its
    fake_quant_after_n_steps null to 0); finetune checks the combination as for any recipe (recipe/qat.py)."""
    qat = c.mapping("qat")
    if not qat:
        return
    for key, value in qat.items():
        if value is None:
            continue
        if key in _QAT_DTYPES and value not in _QAT_DTYPES[key]:
            c.refuse(f"qat.{key}", f"{value!r}: finetune's QAT takes {', '.join(_QAT_DTYPES[key])}")
        elif key in _QAT_DTYPES or key in ("group_size", "quantize_embedding", "fake_quant_after_n_steps"):
            c.put(f"qat.{key}", value)
        else:
            c.refuse(f"qat.{key}", "not an Axolotl qat key (activation_dtype, weight_dtype, group_size, "
                                   "quantize_embedding, fake_quant_after_n_steps)")
    if qat.get("weight_dtype") is None:
        c.put("qat.weight_dtype", "int8")
    if qat.get("group_size") is None and c.peek("qat.weight_dtype") in ("int4", "int8"):
        c.put("qat.group_size", 32)
