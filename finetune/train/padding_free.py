"""Padding-free micro-batches (`data.padding_free`): with packing off, each micro-batch's samples are laid end to end
in one row, each a document that attends only to itself, as packed documents do. The micro-batches hold the same
samples as padded ones, with the same tokens, targets and loss, up to float rounding; only the padding is not
computed. On issue 48's benchmark, padded micro-batches of 4 long-tailed chat samples were about half padding.

Where it applies is decided once per run, from the recipe and the loaded model (`choose`): the SFT objective on text
rows, a model whose packed documents are kept apart (the structural refusal and, with data.packing_check, the
start-of-run isolation check, as for packing), and our attention with a kernel that attends per document (one long
row behind a dense block mask, CUDA's fp32 kernel, would cost more than the padding it saves)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.attention.kernels import choose as choose_kernel
from finetune.attention.kernels import setting
from finetune.errors import UserError
from finetune.model import vision
from finetune.model.architectures import packing_refusal
from finetune.model.isolation import attention_layers, input_dtype, is_ours
from finetune.recipe import Recipe


@dataclass(frozen=True)
class PaddingFree:
    """The run's choice: whether micro-batches are padding-free, and why (for the run log and versions.json)."""

    on: bool
    why: str


def choose(recipe: Recipe, lm: torch.nn.Module, pad_token_id: int | None, device: torch.device) -> PaddingFree:
    """data.padding_free resolved for this run: auto is on wherever it applies; true where it does not is an error
    saying why; packing on, or false: off."""
    wanted = recipe.data.padding_free
    if recipe.data.packing:
        return PaddingFree(False, "data.packing is on")
    if wanted is False:
        return PaddingFree(False, "data.padding_free: false")
    problem = _problem(recipe, lm, pad_token_id, device)
    if problem is None:
        return PaddingFree(True, f"data.padding_free: {'true' if wanted is True else 'auto'}")
    if wanted is True:
        raise UserError(f"data.padding_free: true, but {problem}; set data.padding_free: auto (padded micro-batches "
                        "where it does not apply) or false")
    return PaddingFree(False, f"auto: {problem}")


def _problem(recipe: Recipe, lm: torch.nn.Module, pad_token_id: int | None, device: torch.device) -> str | None:
    """Why this run's micro-batches cannot be padding-free, or None."""
    if recipe.train.objective != "sft":
        return f"train.objective {recipe.train.objective} keeps padded rows (only sft lays samples end to end)"
    if vision.family(lm.config) is not None:
        return "vision-language rows stay padded"
    if recipe.data.pad_to_multiple_of:
        return "data.pad_to_multiple_of asks for padded shapes"
    if recipe.distributed.context_parallel > 1:
        return "distributed.context_parallel splits padded rows as they are"
    refusal = packing_refusal(lm, pad_token_id)
    if refusal:
        return refusal.removeprefix("data.packing: ")
    if not is_ours(lm):
        attn = getattr(lm.config, "_attn_implementation", "?")
        return f"the model's attention is {attn}, not finetune's (model.attn_implementation: auto)"
    dtype = input_dtype(lm)
    kernels = {choose_kernel(setting(recipe.model.packed_attention), device, dtype, head, v_head, dropout)[0]
               for _, head, v_head, dropout in attention_layers(lm)}
    if "masked" in kernels:
        return (f"packed documents take the block-diagonal mask kernel here ({device.type}, "
                f"{str(dtype).removeprefix('torch.')}), whose mask over one long row costs more than the padding")
    return None
