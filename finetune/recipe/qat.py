"""The recipe's `qat:` section: quantization-aware training through torchao (finetune/model/qat.py), and what a recipe
may combine it with.

A section of its own at the top, as Axolotl has it, not a key of `model:`: the model's settings are copied for the
DPO and GRPO references and the distillation teacher (ModelConfig.model_copy), which are never fake-quantized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from finetune.recipe.section import Section

if TYPE_CHECKING:  # the checks read a whole recipe; schema.py imports this module for the section
    from finetune.recipe.schema import Recipe

# The FP4 formats' blocks along the input features: fixed by the format, the only group size each allows.
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}
# Integer weights' default group (Axolotl's default group_size, and torchao's QAT examples').
INT_GROUP = 32
# What QAT trains with: objectives whose every model is either the trained one (fake-quantized) or loaded apart.
QAT_OBJECTIVES = ("sft", "orpo", "distill")


class QATConfig(Section):
    """Quantization-aware training (torchao): the decoder's linear layers train through fake quantization (the
    forward rounds weights, and activations, as the quantized model will; the gradients pass straight through the
    rounding), and final/ holds the model converted to the quantized one. docs/design.md ("Quantization-aware
    training", section 7)."""

    weight_dtype: Literal["int4", "int8", "nvfp4", "mxfp4"] | None = None
    """What the weights of the decoder's linear layers are quantized to; null: no QAT. int4 / int8: symmetric
    integers with one scale per group_size input features (torchao's IntxWeightOnlyConfig, or with int8 activations
    Int8DynamicActivationIntxWeightConfig); nvfp4: NVIDIA's FP4 (torchao's NVFP4DynamicActivationNVFP4WeightConfig,
    e4m3 scales per 16 elements); mxfp4: OCP microscaling FP4 (MXDynamicActivationMXWeightConfig, e8m0 scales per
    32). The FP4 formats need an NVIDIA GPU of compute capability 10.0 or newer and model.dtype bfloat16: on another
    device they are refused, with the reason, when the model loads. The output layer stays in model.dtype (the fused loss multiplies
    by its weight), as do the norms, the embeddings (see quantize_embedding) and a vision-language model's vision
    encoder."""
    activation_dtype: Literal["int8", "nvfp4", "mxfp4"] | None = None
    """What the linear layers' inputs are quantized to, at run time, one scale per token (per block of a token for
    FP4), so that no row's rounding depends on another row of its micro-batch; null: weights only. int8: asymmetric,
    with int4 or int8 weights. nvfp4 / mxfp4: required with weight_dtype the same (torchao trains FP4 activations
    and weights together); NVFP4 without its per-tensor scale, which would depend on the whole micro-batch."""
    group_size: int | None = Field(None, gt=0)
    """Elements of a weight's input features that share one scale. null: the scheme's own: 32 for int4 and int8,
    16 for nvfp4, 32 for mxfp4 (the FP4 formats allow only their own). It must divide the input features of every
    quantized layer (and the hidden size with quantize_embedding), checked when the model loads."""
    quantize_embedding: bool = False
    """Also fake-quantize the input embedding's weight (int4 or int8, per group_size; an embedding has no activations
    to quantize), stored quantized in final/. Not where the output layer shares the embedding's weight
    (tie_word_embeddings): that weight stays in model.dtype for the output layer."""
    fake_quant_after_n_steps: int = Field(0, ge=0)
    """The first N optimizer steps train without fake quantization, the later ones with it; 0: every step. An eval
    after step k runs as step k + 1 does. int4 and int8 weights only (torchao's FP4 layers cannot switch it off)."""


def qat_checks(recipe: Recipe) -> list[str]:
    """The recipe's problems with its qat: section (none without QAT)."""
    q = recipe.qat
    if q.weight_dtype is None:
        changed = [k for k, field in QATConfig.model_fields.items() if getattr(q, k) != field.default]
        return [f"qat.{k}: set, but qat.weight_dtype is null, which means no QAT; set qat.weight_dtype (int4, int8, "
                "nvfp4 or mxfp4) to train quantization-aware" for k in changed]
    weights, acts = q.weight_dtype, q.activation_dtype
    problems = []
    if weights in FP4_BLOCK:
        problems += _fp4_checks(recipe, weights)
    elif acts in FP4_BLOCK:
        problems.append(f"qat.activation_dtype: {acts} activations train with weight_dtype {acts}, not {weights}")
    if recipe.adapter.type != "none":
        problems.append(f"adapter.type: {recipe.adapter.type} with qat: QAT trains the weights that are quantized at "
                        "the end, and under an adapter they stay frozen (the adapter's update, merged later, is never "
                        "fake-quantized); use adapter.type: none with qat, or quantize the merged model afterwards")
    objective = recipe.train.objective
    if objective in ("dpo", "grpo"):
        problems.append(f"train.objective: {objective} with qat: its reference model is the policy as loaded, "
                        "fake-quantized in a fresh run but loaded again without it on a resume; qat trains with sft, "
                        "orpo or distill")
    elif objective not in QAT_OBJECTIVES:
        problems.append(f"train.objective: {objective} with qat: not supported; qat trains with sft, orpo or distill")
    return problems


def _fp4_checks(recipe: Recipe, fp4: str) -> list[str]:
    """What torchao's FP4 QAT (NVFP4FakeQuantizedLinear, MXFakeQuantizedLinear) needs of the recipe."""
    q, block = recipe.qat, FP4_BLOCK[fp4]
    problems = []
    if q.activation_dtype != fp4:
        problems.append(f"qat.activation_dtype: weight_dtype {fp4} needs activation_dtype {fp4}, got "
                        f"{q.activation_dtype or 'null'}: torchao trains {fp4} activations and weights together (it has no "
                        "FP4 weight-only training)")
    if q.group_size not in (None, block):
        problems.append(f"qat.group_size: {fp4} quantizes blocks of {block} elements, its format's own; got "
                        f"{q.group_size}: leave it null or set {block}")
    if recipe.model.dtype != "bfloat16":
        problems.append(f"model.dtype: qat.weight_dtype {fp4} computes in bfloat16 (torchao's FP4 kernels and "
                        f"conversion), not {recipe.model.dtype}; set model.dtype: bfloat16")
    if q.quantize_embedding:
        problems.append(f"qat.quantize_embedding: torchao fake-quantizes an embedding to int4 or int8 only, not {fp4}")
    if q.fake_quant_after_n_steps:
        problems.append(f"qat.fake_quant_after_n_steps: torchao's {fp4} layers cannot switch fake quantization off; "
                        "with int4 or int8 weights they can")
    return problems
