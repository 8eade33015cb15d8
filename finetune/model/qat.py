"""Quantization-aware training (the recipe's `qat:` section) through torchao's own QAT API.

`prepare` swaps the language model's linear layers (and, with qat.quantize_embedding, its input embedding) for
torchao's fake-quantized ones: `quantize_(decoder, QATConfig(base, step="prepare"))`, where `base` is torchao's
post-training config of the scheme, from which torchao derives the fake quantization itself. So what trains is what
the conversion at the end produces: `convert` (`step="convert"`) gives the same layers torchao's quantized tensors
(the converted model's forward equals the fake-quantized one's: tests/model/test_qat.py), and attaches the
TorchAoConfig through which transformers writes those tensors to safetensors and reads them back. `at_step` switches
the fake quantization on from qat.fake_quant_after_n_steps, with torchao's own switches.

Under FSDP2 the model is prepared before fully_shard (the fake-quantized layers run on the all-gathered weights), and
rank 0 converts at the end in `unsharded_copy`, filled with the gathered full state (`final_model`): final/ is what
one process saves from the same weights (tests/model/test_qat_fsdp.py).

Parameter names do not change (a fake-quantized linear keeps its weight and bias), so checkpoints, resumes and
train.trainable_parameters see the model they would without QAT. The output layer is never quantized: the fused
loss multiplies by its weight directly (docs/design.md, section 7), so a fake-quantized head would not be the one
that trains.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Any

import torch

from finetune.errors import UserError
from finetune.recipe.qat import FP4_BLOCK, INT_GROUP, QATConfig

_SCHEMES = {
    ("int4", "int8"): "int8 dynamic activations, int4 weights",
    ("int8", "int8"): "int8 dynamic activations, int8 weights",
    ("int4", None): "int4 weights",
    ("int8", None): "int8 weights",
    ("nvfp4", "nvfp4"): "NVFP4 activations and weights",
    ("mxfp4", "mxfp4"): "MXFP4 activations and weights",
}


def _torchao() -> Any:
    """torchao.quantization; a UserError with the install line when torchao is missing (the CLI
    says so when the recipe loads, through the recipe's features: this is for callers of the library)."""
    try:  # its import's noise is filtered by progress.log_friendly_libraries, before transformers imports it
        import torchao.quantization as quantization
        import torchao.quantization.qat  # noqa: F401  (the QAT API, a submodule)
    except ImportError as e:
        raise UserError(f"qat: needs torchao ({e}): pip install 'finetune[qat]'") from None
    return quantization


def effective_group(cfg: QATConfig) -> int:
    """The group size that runs: qat.group_size, or the scheme's own (INT_GROUP, the FP4 formats' blocks)."""
    return cfg.group_size or FP4_BLOCK.get(cfg.weight_dtype or "", INT_GROUP)


def describe(cfg: QATConfig) -> str:
    """The scheme in words, e.g. "int8 dynamic activations, int4 weights, groups of 32"."""
    return f"{_SCHEMES[(cfg.weight_dtype, cfg.activation_dtype)]}, groups of {effective_group(cfg)}"


def base_config(cfg: QATConfig) -> Any:
    """torchao's post-training config of the scheme: what `prepare` derives the fake quantization from and `convert`
    applies. int4/int8 weights are torchao's IntX tensors (symmetric, per group, stored unpacked in int8: they run and
    save on any device); NVFP4 without its per-tensor scales: torchao computes the activations' one over the whole
    input, which would make a row's rounding depend on the other rows of its micro-batch (and on the other documents
    of its packed row), against the loss contract."""
    q = _torchao()
    if cfg.weight_dtype in ("int4", "int8"):
        dtype, group = getattr(torch, cfg.weight_dtype), q.PerGroup(effective_group(cfg))
        if cfg.activation_dtype == "int8":
            return q.Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=group)
        return q.IntxWeightOnlyConfig(weight_dtype=dtype, granularity=group)
    from torchao.prototype import mx_formats

    if cfg.weight_dtype == "nvfp4":
        return mx_formats.NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=False,
                                                                  use_triton_kernel=False)
    return mx_formats.MXDynamicActivationMXWeightConfig(activation_dtype=torch.float4_e2m1fn_x2,
                                                        weight_dtype=torch.float4_e2m1fn_x2,
                                                        block_size=FP4_BLOCK["mxfp4"])


def embedding_config(cfg: QATConfig) -> Any:
    """The input embedding's scheme (qat.quantize_embedding): its weight only, as the linear layers' weights."""
    q = _torchao()
    return q.IntxWeightOnlyConfig(weight_dtype=getattr(torch, cfg.weight_dtype), granularity=q.PerGroup(
        effective_group(cfg)))


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder whose layers QAT quantizes: a causal LM's backbone (its output layer is outside it), a
    vision-language model's language model (its vision encoder and projector too)."""
    decoder = model.get_decoder()
    return model.model if decoder is model else decoder


def check_device(cfg: QATConfig, device: torch.device) -> None:
    """The FP4 formats run where torchao runs them: its NVFP4 and MX QAT compute the forward with FP4 kernels that
    need an NVIDIA GPU of compute capability 10.0 or newer (torchao's docs; on a CPU, measured: "CPU does not
    support swizzle", and no FP4 matmul)."""
    if cfg.weight_dtype not in FP4_BLOCK:
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (10, 0):
            return
        here = f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    else:
        here = str(device)
    raise UserError(f"qat.weight_dtype: {cfg.weight_dtype} trains on NVIDIA GPUs of compute capability 10.0 or newer "
                    f"(Blackwell): torchao computes its {cfg.weight_dtype} QAT forward with FP4 kernels, and this run's "
                    f"device is {here}. Here, use weight_dtype int4 (with activation_dtype int8)")


def prepare(model: torch.nn.Module, cfg: QATConfig, device: torch.device) -> None:
    """Fake-quantize `model` in place for training with `cfg` (a no-op without QAT), fake quantization switched as
    for the first step (at_step)."""
    if cfg.weight_dtype is None:
        return
    check_device(cfg, device)
    q = _torchao()
    decoder = language_model(model)
    _check_sizes(decoder, cfg)
    embedding = _embedding(model, cfg)
    q.quantize_(decoder, q.qat.QATConfig(base_config(cfg), step="prepare"))
    if embedding is not None:
        q.quantize_(decoder, q.qat.QATConfig(embedding_config(cfg), step="prepare"),
                    filter_fn=lambda module, _: module is embedding)
    at_step(model, cfg, 0)


def _embedding(model: torch.nn.Module, cfg: QATConfig) -> torch.nn.Module | None:
    """The input embedding qat.quantize_embedding fake-quantizes, checked: its own weight, of a width the groups
    divide."""
    if not cfg.quantize_embedding:
        return None
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embedding.weight:
        raise UserError("qat.quantize_embedding: this model's output layer shares the input embedding's weight "
                        "(tie_word_embeddings), and the output layer stays in model.dtype (the fused loss multiplies "
                        "by its weight): one tensor cannot be both; set qat.quantize_embedding: false")
    group = effective_group(cfg)
    if embedding.embedding_dim % group:
        raise UserError(f"qat.group_size: {group} does not divide the embedding's width {embedding.embedding_dim} "
                        f"(qat.quantize_embedding); use one that divides it, e.g. {_suggestion(embedding.embedding_dim)}")
    return embedding


def _check_sizes(decoder: torch.nn.Module, cfg: QATConfig) -> None:
    """Every linear layer's input features split into whole groups (NVFP4 also needs its output features in
    multiples of 16): said before training, naming a layer, rather than by torchao mid-setup or at the end."""
    group = effective_group(cfg)
    linears = [(name, m) for name, m in decoder.named_modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise UserError(f"qat: {type(decoder).__name__} has no linear layers for QAT to quantize")
    bad = [(name, m.in_features) for name, m in linears if m.in_features % group]
    if bad and cfg.weight_dtype in FP4_BLOCK:
        raise UserError(f"qat.weight_dtype: {cfg.weight_dtype} quantizes blocks of {group} input features, which do "
                        f"not divide those of {len(bad)} linear layer(s) of this model, e.g. {bad[0][0]} "
                        f"({bad[0][1]}); use int4 or int8 weights with a group_size that divides them")
    if bad:
        name, size = bad[0]
        sizes = sorted({m.in_features for _, m in linears})
        raise UserError(f"qat.group_size: {group} does not divide the input features of {len(bad)} linear layer(s), "
                        f"e.g. {name} ({size}); the layers' input sizes are {', '.join(map(str, sizes))}: use a group "
                        f"size that divides each, e.g. {_suggestion(math.gcd(*sizes))}")
    if cfg.weight_dtype == "nvfp4":
        odd = [name for name, m in linears if m.out_features % FP4_BLOCK["nvfp4"]]
        if odd:
            raise UserError(f"qat.weight_dtype: nvfp4 needs every quantized layer's output features in multiples of "
                            f"16 (torchao's NVFP4 weights); {odd[0]} has {dict(linears)[odd[0]].out_features}")


def _suggestion(size: int) -> int:
    """The largest power of two up to 256 that divides `size` (a group size that works)."""
    return math.gcd(size, 256)


def _fake_quantized_classes() -> tuple[type, ...]:
    """torchao's fake-quantized layers: the linear, the embedding, the FP4 formats' linears."""
    q = _torchao()
    from torchao.prototype.qat import MXFakeQuantizedLinear, NVFP4FakeQuantizedLinear

    return q.qat.FakeQuantizedLinear, q.qat.FakeQuantizedEmbedding, MXFakeQuantizedLinear, NVFP4FakeQuantizedLinear


# Each prepared model's fake quantizers (its modules do not change once prepared), for at_step.
_FAKE_QUANTIZERS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def at_step(model: torch.nn.Module, cfg: QATConfig, steps_done: int) -> None:
    """Fake quantization on or off for the optimizer step after `steps_done` steps (and an eval between them): off
    for the first qat.fake_quant_after_n_steps steps. Each of torchao's fake quantizers (a linear layer's for its
    weight and its input, the embedding's for its weight) has its `enabled` switch, which torchao's own helpers
    (enable_linear_fake_quant) set. A no-op when fake quantization is on from the start, which the FP4 layers (they
    have no switch) always are."""
    if cfg.weight_dtype is None or not cfg.fake_quant_after_n_steps:
        return
    on = steps_done >= cfg.fake_quant_after_n_steps
    quantizers = _FAKE_QUANTIZERS.get(model)
    if quantizers is None:  # found once: walking every module each step is host time on the step's path
        kind = _torchao().qat.FakeQuantizerBase
        quantizers = _FAKE_QUANTIZERS[model] = [m for m in model.modules() if isinstance(m, kind)]
    if quantizers and quantizers[0].enabled != on:  # all switched together: only a change walks them
        for quantizer in quantizers:
            quantizer.enabled = on


def convert(model: torch.nn.Module, cfg: QATConfig) -> None:
    """The trained model, in place, converted to the quantized one (torchao's `step="convert"`: each fake-quantized
    layer back to a plain one holding torchao's quantized weight), ready for save_pretrained. The rest stays as
    trained. The model trains no further after this. A no-op without QAT."""
    if cfg.weight_dtype is None:
        return
    q = _torchao()
    from transformers import TorchAoConfig
    from transformers.quantizers import AutoHfQuantizer

    decoder, base = language_model(model), base_config(cfg)
    q.quantize_(decoder, q.qat.QATConfig(base, step="convert"))
    if cfg.quantize_embedding:
        q.quantize_(decoder, q.qat.QATConfig(embedding_config(cfg), step="convert"),
                    filter_fn=lambda module, _: isinstance(module, torch.nn.Embedding))
    saved = TorchAoConfig(base, include_input_output_embeddings=cfg.quantize_embedding)
    # What from_pretrained(..., quantization_config=TorchAoConfig) leaves on a model it quantized: save_pretrained
    # then writes torchao's tensors into safetensors (flattened, with their layout in the header) and the config
    # into config.json, from which from_pretrained loads the quantized model back.
    model.config.quantization_config = saved
    model.hf_quantizer = AutoHfQuantizer.from_config(saved)


def unsharded_copy(lm: torch.nn.Module) -> torch.nn.Module:
    """An unsharded copy of the prepared model for `final_model` under FSDP, made before fully_shard changes it: the
    same modules (torchao's fake-quantized layers included), its parameters on the meta device (no memory: the
    gathered full state fills them at the end), its buffers and config the model's own (shared, not copied). Its
    compiled forwards (train.compile) are dropped: it is converted and saved, never run."""
    memo: dict[int, Any] = {id(lm.config): lm.config}
    if getattr(lm, "generation_config", None) is not None:
        memo[id(lm.generation_config)] = lm.generation_config
    for p in lm.parameters():  # a tied parameter is listed once, and stays one parameter in the copy
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in lm.buffers():
        memo[id(b)] = b
    unsharded = copy.deepcopy(lm, memo)
    for module in unsharded.modules():
        module._compiled_call_impl = None
    return unsharded


def final_model(lm: torch.nn.Module, cfg: QATConfig, full_state: dict[str, torch.Tensor] | None,
                unsharded: torch.nn.Module | None) -> tuple[torch.nn.Module, dict[str, torch.Tensor] | None]:
    """What rank 0 saves to final/, and the state dict to save it with (save_final's): without QAT the trained model
    and `full_state` (FSDP's gathered state dict, None unsharded) unchanged; with QAT in one process or under DDP
    the model converted in place (`convert`); with QAT under FSDP the gathered full state put into `unsharded`
    (`unsharded_copy`, made before sharding: the model as one process trains it), which is then converted: the same
    modules, weights and conversion as one process's, so the same final/. No weight is copied: the copy's parameters
    become the gathered CPU tensors themselves, and each is released as its layer is converted, so the CPU memory
    rank 0 holds stays about the full model in model.dtype (what a save under FSDP gathers anyway), the quantized
    layers taking the place of the float ones as they are converted."""
    if cfg.weight_dtype is None:
        return lm, full_state
    if full_state is None or unsharded is None:
        convert(lm, cfg)
        return lm, full_state
    _adopt(unsharded, full_state)
    convert(unsharded, cfg)
    return unsharded, None


def _adopt(model: torch.nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """`model`'s parameters (on the meta device) and persistent buffers become `full_state`'s tensors, by name (a tied
    parameter once, under the name named_parameters gives it, as gather_full_state keeps it), emptying `full_state`,
    so that each float weight lives in the model alone and is freed when its layer is converted."""
    adopted: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters():
        if name not in full_state:
            raise RuntimeError(f"qat: the gathered state has no {name}")
        adopted[id(p)] = torch.nn.Parameter(full_state.pop(name), requires_grad=p.requires_grad)
    for prefix, module in model.named_modules():
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = adopted[id(p)]
        for key in module._buffers:
            name = f"{prefix}.{key}" if prefix else key
            if name in full_state:
                module._buffers[key] = full_state.pop(name)
    if full_state:
        raise RuntimeError(f"qat: the gathered state has {', '.join(sorted(full_state))}, which the model has not")


def record(model: torch.nn.Module, cfg: QATConfig) -> dict[str, Any] | None:
    """What the run record (versions.json "run") and the run log say about QAT: the scheme, torchao's config of it,
    how many layers it fake-quantizes, from which step; None without QAT."""
    if cfg.weight_dtype is None:
        return None
    fake = _fake_quantized_classes()
    layers = sum(1 for m in model.modules() if isinstance(m, fake))
    return {"scheme": describe(cfg), "weight_dtype": cfg.weight_dtype, "activation_dtype": cfg.activation_dtype,
            "group_size": effective_group(cfg), "quantize_embedding": cfg.quantize_embedding,
            "fake_quant_from_step": cfg.fake_quant_after_n_steps + 1, "layers": layers,
            "torchao_config": type(base_config(cfg)).__name__}


def log_line(rec: dict[str, Any], total_steps: int) -> str:
    """The run log's QAT line, from `record`'s dict."""
    start = rec["fake_quant_from_step"]
    when = "from the first step" if start == 1 else f"from step {start}"
    if start > total_steps:
        when += f", which is beyond this run's {total_steps} steps: it never trains fake-quantized"
    return (f"qat: {rec['scheme']} (torchao's {rec['torchao_config']}) on {rec['layers']} layers, fake-quantized "
            f"{when}; final/ will hold the quantized model")
