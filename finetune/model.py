"""Load the tokenizer and the model: an HF directory or hub id, a GGUF file, or random init from a config.

Adapters (LoRA, QLoRA) are applied here through PEFT. Training always runs with `use_cache=False`: with
the cache on, transformers lets packed documents attend to each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError
from finetune.recipe import AdapterConfig, ModelConfig, TokenizerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gguf_location(cfg: ModelConfig) -> tuple[str | None, str | None]:
    """(directory or hub id, gguf file name) when the model comes from a GGUF file, else (path, None)."""
    if cfg.gguf_file:
        return cfg.path, cfg.gguf_file
    if cfg.path and cfg.path.endswith(".gguf"):
        file = Path(cfg.path)
        return str(file.parent), file.name
    return cfg.path, None


def load_tokenizer(tok: TokenizerConfig, model: ModelConfig) -> Any:
    """The tokenizer (from tokenizer.path, else model.path), with a pad token and the recipe's chat template."""
    from transformers import AutoTokenizer

    path, gguf = (tok.path, None) if tok.path else _gguf_location(model)
    kwargs: dict[str, Any] = {"trust_remote_code": model.trust_remote_code}
    if gguf:
        kwargs["gguf_file"] = gguf
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # OSError offline / missing files, ValueError for unknown formats
        raise UserError(f"tokenizer {path!r} could not be loaded ({type(e).__name__}: {_first_line(e)}).\n"
                        "  Point tokenizer.path (or model.path) at a local tokenizer directory.") from None
    if tok.chat_template:
        tokenizer.chat_template = tok.chat_template
    if tokenizer.pad_token_id is None:
        # Padding tokens never carry a label, so reusing eos for padding cannot teach the model anything.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        raise UserError(f"tokenizer {path!r} has neither a pad nor an eos token; it cannot batch sequences")
    return tokenizer


def load_model(cfg: ModelConfig, adapter: AdapterConfig, tokenizer: Any, seed: int) -> torch.nn.Module:
    """The causal LM, on the CPU, in the recipe's dtype, with its adapter applied (if any)."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[cfg.dtype]
    attn = "sdpa" if cfg.attn_implementation == "auto" else cfg.attn_implementation
    common = {"attn_implementation": attn, "trust_remote_code": cfg.trust_remote_code}
    if cfg.init == "random":
        config = _random_init_config(cfg, tokenizer)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **common)
    else:
        path, gguf = _gguf_location(cfg)
        kwargs: dict[str, Any] = {"dtype": dtype, **common}
        if gguf:
            kwargs["gguf_file"] = gguf
        if adapter.type == "qlora":
            kwargs["quantization_config"] = _nf4_config(dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as e:
            raise UserError(f"model.path {path!r} could not be loaded ({type(e).__name__}: {_first_line(e)}).\n"
                            "  Use a local HF model directory, a .gguf file, or model.init: random.") from None
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen embeddings (LoRA) without enable_input_require_grads.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapter.type != "none":
        model = _apply_adapter(model, adapter)
    return model


def _random_init_config(cfg: ModelConfig, tokenizer: Any) -> Any:
    from transformers import AutoConfig

    if cfg.config:
        values = dict(cfg.config)
        model_type = values.pop("model_type", None)
        if not model_type:
            raise UserError("model.config needs a model_type (e.g. llama, qwen2, mistral)")
        try:
            config = AutoConfig.for_model(model_type, **values)
        except ValueError as e:
            raise UserError(f"model.config: {e}") from None
        if "vocab_size" not in values:
            config.vocab_size = len(tokenizer)
    else:
        config = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    if config.vocab_size < len(tokenizer):
        raise UserError(f"model.config.vocab_size {config.vocab_size} is smaller than the tokenizer's "
                        f"{len(tokenizer)} tokens")
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    return config


def _nf4_config(dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


def _apply_adapter(model: torch.nn.Module, adapter: AdapterConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    if adapter.type == "qlora":
        _prepare_kbit(model)
    config = LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                        target_modules=adapter.target_modules, modules_to_save=adapter.modules_to_save,
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UserError(f"adapter.target_modules: {e}") from None


def _prepare_kbit(model: torch.nn.Module) -> None:
    """What peft's prepare_model_for_kbit_training does, minus the implicit gradient checkpointing:
    freeze the base, keep non-quantized float16/bfloat16 parameters (norms, embeddings) in float32."""
    for param in model.parameters():
        param.requires_grad_(False)
        if param.dtype in (torch.float16, torch.bfloat16) and param.__class__.__name__ == "Parameter":
            param.data = param.data.float()


def output_layer(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder backbone, output layer) of a causal LM, looking through a PEFT wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    if decoder is None or head is None:
        raise UserError(f"{type(base).__name__} has no separate decoder/output layer; the fused loss needs both")
    return decoder, head


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def save_final(model: torch.nn.Module, tokenizer: Any, out_dir: Path, state_dict: dict | None = None) -> None:
    """HF-format output: model.safetensors (or the PEFT adapter), config, tokenizer and chat template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
