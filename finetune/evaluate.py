"""The model as training and evaluation run it (backbone + fused loss), and the token-weighted eval loss.

`finetune eval` uses this directly; the trainer uses it for its eval lines. Both give the same number: the
sum of every eval target token's loss over the count of eval target tokens, whatever the micro-batch size
and whether packing is on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune import dist
from finetune.data import build_samples, collate, eval_rows, rank_micro_batches
from finetune.errors import UserError
from finetune.loss import linear_cross_entropy, resolve_impl
from finetune.model import load_model, load_tokenizer, load_trained, output_layer
from finetune.recipe import Recipe


class CausalLMWithLoss(torch.nn.Module):
    """Backbone + fused loss in one forward, so DDP/FSDP hooks see the whole computation.

    Returns (loss_sum, n_targets) of the micro-batch; the model's own logits path is never used, so the full
    [tokens x vocab] logits are never built.
    """

    def __init__(self, lm: torch.nn.Module, impl: str, chunk_size: int, z_loss: float, softcap: float | None):
        super().__init__()
        self.lm, self.impl, self.chunk_size, self.z_loss = lm, impl, chunk_size, z_loss
        # Models that soft-cap their logits (Gemma 2) must keep doing so inside the fused loss.
        self.softcap = softcap or getattr(lm.config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        decoder, head = output_layer(self.lm)
        # use_cache=False always: with a cache, transformers lets packed documents attend to each other.
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state
        return linear_cross_entropy(hidden, head.weight, labels, getattr(head, "bias", None), impl=self.impl,
                                    chunk_size=self.chunk_size, z_loss=self.z_loss, softcap=self.softcap)



def evaluate_loss(net: torch.nn.Module, samples: list[dict], recipe: Recipe, micro_batch_size: int, pad_id: int,
                  world: dist.World, device: torch.device) -> tuple[float, int]:
    """Token-weighted mean loss over the eval set: sum of token losses over all eval tokens (all ranks)."""
    # Dealt to ranks like a training step's rows: a rank with fewer micro-batches runs fillers that count
    # nothing, so every rank makes the same forward calls (FSDP gathers parameters in each).
    micro_batches = rank_micro_batches(eval_rows(samples, recipe.data), micro_batch_size, world.size, world.rank)
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    net.eval()
    with torch.no_grad():
        for rows in micro_batches:
            loss_sum, n = net(**model_inputs(collate(rows, recipe.data, pad_id), device))
            totals += torch.stack([loss_sum.double(), n.double()])
    loss_sum, n = dist.all_reduce_sum(totals).tolist()
    return loss_sum / max(n, 1), int(n)


def model_inputs(batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a collated micro-batch that the model takes, on the device."""
    keys = ("input_ids", "labels", "attention_mask", "position_ids")
    return {k: batch[k].to(device) for k in keys if k in batch}


def run_eval(recipe: Recipe, run_dir: Path | None = None) -> tuple[float, int]:
    """`finetune eval`: the recipe's model (or, given a run directory, that run's trained model) on the
    recipe's eval data, in one process."""
    world = dist.from_env()
    with dist.process_group(world) as device:
        if run_dir is not None:
            lm, tokenizer = load_trained(run_dir, recipe)
        else:
            tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
            lm = None
        _, eval_samples, _, _ = build_samples(recipe, tokenizer)
        if not eval_samples:
            raise UserError("the recipe has no eval data: set eval_datasets or data.val_fraction")
        if lm is None:
            lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed)
        lm = lm.to(device)
        impl = resolve_impl(recipe.loss.impl, device)
        net = CausalLMWithLoss(lm, impl, recipe.loss.chunk_size, recipe.loss.z_loss, recipe.loss.softcap)
        micro = recipe.eval.micro_batch_size or recipe.train.micro_batch_size
        return evaluate_loss(net, eval_samples, recipe, micro, tokenizer.pad_token_id, world, device)
