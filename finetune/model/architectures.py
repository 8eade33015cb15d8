"""What finetune knows about individual transformers architectures, keyed by `config.model_type`, in one place.

- The output head (`head_spec`): how a model turns its last hidden state into logits. The fused loss never calls
  the model's own head, so every scale, soft-cap and vocabulary slice that `*ForCausalLM.forward` applies must be
  applied here too, or the run would train on other logits than the model's.
- What the fused loss cannot reproduce (`loss_refusal`), refused when the model loads.
- What packing cannot keep apart (`packing_refusal`): layers that carry state along the sequence, attention that
  transformers does not isolate, padding the model cannot differentiate through, vision-language families whose
  packed documents do not equal themselves alone (VLM_PACKED: those that do).
- The linear layers that LoRA's `all-linear` must leave alone (`lora_exclusions`).

Read from the modeling code of transformers 5.23.0 and checked against it for every causal LM architecture by
tests/model/test_models.py, whose results are docs/models.md. A new transformers pin reruns that test: a new head or a
new kind of layer shows up there, and is added here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from finetune.model import router_loss
from finetune.model.vision import family as vision_family


@dataclass(frozen=True)
class HeadSpec:
    """The model's logits as `softcap(scale * (hidden @ W[:vocab].T + b[:vocab]))` (softcap: c * tanh(x / c))."""

    scale: float = 1.0
    softcap: float | None = None
    vocab: int | None = None  # only the first `vocab` rows of the output layer are logits

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(hidden, weight, bias) whose plain linear map is the model's logits before the soft-cap. The scale goes
        on the hidden rows and the bias, which is exact with or without a bias and never builds the logits."""
        if self.vocab is not None:
            weight = weight[:self.vocab]
            bias = bias[:self.vocab] if bias is not None else None
        if self.scale != 1.0:
            hidden = hidden * self.scale
            bias = bias * self.scale if bias is not None else None
        return hidden, weight, bias


# model_type -> the factor its forward multiplies the logits by. Keyed by model_type, not by attribute: Granite
# divides by `logits_scaling` and HyperCLOVAX multiplies by an attribute of the same name.
_SCALE = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"),
                    lambda c: c.logit_scale),  # logits * config.logit_scale
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                     "granitemoeshared"), lambda c: 1.0 / c.logits_scaling),  # logits / config.logits_scaling
    "hyperclovax": lambda c: c.logits_scaling,  # logits * config.logits_scaling
    "minicpm3": lambda c: 1.0 / c.logits_scaling,  # hidden / logits_scaling (a property: hidden / dim_model_base)
    "falcon_h1": lambda c: c.lm_head_multiplier,  # logits * model.lm_head_multiplier (= the config's)
    "inkling_text": lambda c: 1.0 / c.logits_mup_width_multiplier,  # hidden / config.logits_mup_width_multiplier
}
# The soft-cap's attribute where it is not `final_logit_softcapping` (Gemma 2/3/3n/4, VaultGemma, Beam, nanochat).
_SOFTCAP = {"recurrent_gemma": "logits_soft_cap", "xlstm": "output_logit_soft_cap"}
# logits[..., :config.unpadded_vocab_size]
_VOCAB_SLICE = {"inkling_text", "inkling2_text"}


def head_spec(config: Any, output_rows: int) -> HeadSpec:
    """How `config`'s model makes its logits from the last hidden state and an output layer of `output_rows`."""
    model_type = getattr(config, "model_type", None)
    scale = float(_SCALE[model_type](config)) if model_type in _SCALE else 1.0
    cap = getattr(config, _SOFTCAP.get(model_type, "final_logit_softcapping"), None)
    vocab = getattr(config, "unpadded_vocab_size", None) if model_type in _VOCAB_SLICE else None
    return HeadSpec(scale=scale, softcap=float(cap) if cap else None,
                    vocab=vocab if vocab is not None and vocab < output_rows else None)


# Encoders that are causal LMs only as decoders: their prediction head is dense + activation + LayerNorm before the
# output layer (get_output_embeddings() is only that last layer), and they are bidirectional unless is_decoder.
_MLM_HEADS = {"bert", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert", "rembert",
              "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod"}
_NOT_SUPPORTED = {
    **dict.fromkeys(_MLM_HEADS, "its prediction head applies dense + activation + LayerNorm before the output "
                                "layer, which the fused loss does not, and it is an encoder made causal"),
    "modernbert-decoder": "its head is decoder(lm_head(hidden)), two layers the fused loss does not chain",
    **dict.fromkeys(("cpmant", "xlnet", "xlm"), "it is not a left-to-right causal LM here: its own loss takes "
                                                "labels already shifted and its attention is not causal"),
    "reformer": "training needs every sequence to be exactly prod(axial_pos_shape) tokens long",
}


def loss_refusal(config: Any) -> str | None:
    """Why the fused loss cannot train this model as its own loss would (a message), or None."""
    model_type = getattr(config, "model_type", None)
    if model_type in _NOT_SUPPORTED:
        return (f"model_type {model_type!r} is not supported: {_NOT_SUPPORTED[model_type]}. See docs/models.md "
                "for the architectures that are")
    router = router_loss.refusal(config)  # the supported ones get their load-balancing loss added (router_loss.py)
    if router:
        return router
    if model_type == "bamba" and getattr(config, "z_loss_coefficient", 0):
        return ("model.config.z_loss_coefficient > 0: bamba adds mean(logsumexp(logits)^2) over every position, "
                "padding and unlabelled ones included, to its loss. Set it to 0 (loss.z_loss is the z-loss over "
                "the target tokens)")
    return None


# Mixers that carry a state along the sequence without an nn.Conv1d to find them by (the others all have one).
_RECURRENT_CLASSES = re.compile(r"RwkvSelfAttention|xLSTMLayer|LightningAttention|Rglru|Mixer$|GatedDeltaNet|"
                                r"DeltaAttention")
# Attention that transformers 5.23.0 does not keep within a packed document, with eager, sdpa or ours (measured).
_LEAKING_ATTENTION = {
    "gpt_oss": "its mask is built without position_ids, and its attention sinks are not in the per-document path",
    "falcon": "its mask is built without position_ids and it calls sdpa itself",
    "bloom": "ALiBi attention whose mask is built without position_ids",
    "mpt": "ALiBi attention whose mask is built without position_ids",
    "openai-gpt": "its attention does not detect packed documents",
    "xglm": "its attention does not detect packed documents",
    "deepseek_v4": "its compressed key/value blocks span document boundaries",
    "blt": "its entropy patcher and byte n-gram hashes span document boundaries",
}
_PACKING_OFF = "Set data.packing: false (padded batches keep samples apart)."
# Vision-language families whose packed rows are proven to equal each document alone, images included
# (tests/model/test_vision_packing.py): 1D positions, each image (tile) encoded on its own, features scattered over
# the image tokens in order; transformers' sdpa mask finds the documents from the restarting positions.
VLM_PACKED = ("llava", "smolvlm")
# Why the other supported families are refused (transformers 5.23.0, read and measured on tiny models: the logits of
# a packed document against the same document alone).
_QWEN_MROPE = ("its 3D M-RoPE positions come from get_rope_index only when no position_ids are given; packed rows "
               "give 1D per-document position_ids (how the documents are found), so its image tokens would get 1D "
               "positions instead of their 3D ones (measured: 3e-3 on a row's first document, 0.4 on the next), and "
               "without them get_rope_index numbers the whole row as one sequence, whose positions never restart at a "
               "document (per-document 3D positions, transformers' [4, batch, length] packed form, are not made yet)")
_VLM_NOT_PACKED = {
    "qwen2_vl": _QWEN_MROPE,
    "qwen2_5_vl": _QWEN_MROPE,
    "gemma3": ("its image tokens attend both ways within an image (token_type_ids), and in its sliding-window layers "
               "transformers applies that image-block mask before remapping the mask to each packed document's "
               "positions, so a later document reads the first document's image pattern at its own positions "
               "(measured: 0.2-0.3 on the second and third documents of a packed row, with or without images)"),
}


def packing_refusal(model: torch.nn.Module, pad_token_id: int | None) -> str | None:
    """Why packed rows would let this model's documents see each other, or train to NaN (a message), or None.
    Found from the model's structure, so it holds in every dtype and on every device; the start-of-run
    isolation check (finetune/model/isolation.py) measures the rest."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if vision_family(config) is not None and model_type not in VLM_PACKED:
        # A family is packed only once a test shows its packed documents equal themselves alone.
        why = _VLM_NOT_PACKED.get(model_type, "that its packed documents equal themselves alone (image tokens, "
                                              "positions) is not checked yet")
        return (f"data.packing: {model_type} is a vision-language model whose packed documents are not kept apart as "
                f"they are alone: {why}. Packing is proven for {', '.join(VLM_PACKED)} (docs/vision.md). "
                f"{_PACKING_OFF}")
    stateful = stateful_layer(model)
    if stateful:
        return (f"data.packing: {model_type} has layers that carry a state along the sequence ({stateful}); in a "
                "packed row that state runs from one document into the next (transformers passes these layers no "
                f"document boundaries), so samples would see each other. {_PACKING_OFF}")
    if model_type in _LEAKING_ATTENTION:
        return (f"data.packing: transformers does not keep packed documents apart in {model_type}: "
                f"{_LEAKING_ATTENTION[model_type]}. {_PACKING_OFF}")
    if model_type == "gemma3n_text" and _zero_embedding(model, pad_token_id):
        return ("data.packing: the pad token's embedding is all zeros, so the padding at the end of a packed row "
                "stays a zero vector through every layer; Gemma 3n takes its root-mean-square (AltUp), whose "
                f"gradient at zero is NaN, and every step would be skipped. {_PACKING_OFF}")
    return None


def stateful_layer(model: torch.nn.Module) -> str | None:
    """The first layer that mixes positions outside attention, said in words: one holding a causal convolution
    over the sequence (Mamba, Gated DeltaNet, short convolutions, RG-LRU, CCA), or a recurrence without one (RWKV,
    xLSTM, lightning attention)."""
    for module in model.modules():
        name = type(module).__name__
        convs = [c for c in module.children() if isinstance(c, torch.nn.Conv1d) and c.kernel_size[0] > 1]
        if convs:
            return f"{name}: a causal convolution of width {convs[0].kernel_size[0]}"
        if _RECURRENT_CLASSES.search(name):
            return f"{name}: a recurrence"
    return None


def _zero_embedding(model: torch.nn.Module, token_id: int | None) -> bool:
    weight = getattr(model.get_input_embeddings(), "weight", None)
    if token_id is None or weight is None or not 0 <= token_id < weight.shape[0]:
        return False
    return bool((weight[token_id] == 0).all())


# Linear layers whose weight the CUDA fast path (mamba-ssm) hands to a fused kernel itself, so a LoRA on them is
# silently left out there; peft refuses out_proj outright for mamba, mamba2, falcon_mamba, falcon_h1, nemotron_h.
_FUSED_LINEARS = {
    **dict.fromkeys(("mamba", "falcon_mamba"), ("x_proj", "dt_proj", "out_proj")),  # mamba_inner_fn
    **dict.fromkeys(("mamba2", "bamba", "granitemoehybrid", "zamba2", "falcon_h1", "nemotron_h"),
                    ("out_proj",)),  # mamba_split_conv1d_scan_combined
}
_MAMBA_MIXER = re.compile(r"Mamba|Mixer")


def lora_exclusions(model: torch.nn.Module) -> list[str]:
    """Full names of the nn.Linear modules that `target_modules: all-linear` must skip: a LoRA adds x @ A @ B to a
    module's output, which is right only for a module that computes x @ W.T + b. Some nn.Linear subclasses do
    something else (PhiMoE's and Llama4's routers return tuples; DeepSeek-V4's grouped projection), and some
    linears are used by a fused kernel instead of being called (_FUSED_LINEARS)."""
    fused = _FUSED_LINEARS.get(getattr(model.config, "model_type", None), ())
    excluded = []
    for name, module in model.named_modules():
        if fused and _MAMBA_MIXER.search(type(module).__name__):
            excluded += [f"{name}.{child}" for child in fused if isinstance(getattr(module, child, None),
                                                                            torch.nn.Linear)]
        elif _overrides_linear(module) and not _is_linear_map(module):
            excluded.append(name)
    return excluded


def _overrides_linear(module: torch.nn.Module) -> bool:
    # A transformers subclass of nn.Linear with its own forward (quantized layers, e.g. bitsandbytes', are PEFT's
    # to handle and never reach here).
    cls = type(module)
    return (isinstance(module, torch.nn.Linear) and cls.forward is not torch.nn.Linear.forward
            and cls.__module__.startswith("transformers."))


def _is_linear_map(module: torch.nn.Linear) -> bool:
    """Whether the module's forward is x @ W.T + b, tried on 3 fixed rows (FalconLinear is; routers are not)."""
    weight = module.weight
    x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0)).to(weight.device,
                                                                                          weight.dtype)
    try:
        with torch.no_grad():
            out = module(x)
            expected = F.linear(x, weight, module.bias)
    except Exception:  # noqa: BLE001 - any failure on a plain [rows, in_features] input: not a plain linear map
        return False
    return isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(out, expected)
