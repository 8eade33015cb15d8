"""The model as training, evaluation and `verify` run it: the decoder backbone and the fused loss in one forward.

The output layer's logits are never built in full: the fused linear cross-entropy (finetune/loss.py) takes the
backbone's hidden states and the output layer's weight, so a micro-batch costs one chunk of logits at a time.
"""

from __future__ import annotations

import torch

from finetune.architectures import head_spec
from finetune.logprobs import token_logprobs
from finetune.loss import linear_cross_entropy
from finetune.model import output_layer
from finetune.recipe import LossConfig


class CausalLMWithLoss(torch.nn.Module):
    """Backbone + fused loss in one forward, so DDP/FSDP hooks see the whole computation.

    Returns (loss_sum, n_targets) of the micro-batch; the model's own logits path is never used, so the full
    [tokens x vocab] logits are never built.
    """

    def __init__(self, lm: torch.nn.Module, impl: str, chunk_size: int, z_loss: float, softcap: float | None):
        super().__init__()
        self.lm, self.impl, self.chunk_size, self.z_loss = lm, impl, chunk_size, z_loss
        # What the model's own head does to its logits (a scale, a soft-cap, a vocabulary slice), done here too:
        # else the run would train other logits than the model's (finetune/architectures.py).
        self.head = head_spec(lm.config, output_layer(lm)[1].weight.shape[0])
        self.softcap = softcap or self.head.softcap

    @classmethod
    def for_recipe(cls, lm: torch.nn.Module, loss: LossConfig, impl: str) -> CausalLMWithLoss:
        """The recipe's loss settings around `lm`; `impl` is loss.impl resolved for the device (resolve_impl)."""
        return cls(lm, impl, loss.chunk_size, loss.z_loss, loss.softcap)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, number of targets); with per_token, (each target's log-probability, its flat position)
        for objectives that score whole sequences."""
        decoder, head = output_layer(self.lm)
        # use_cache=False always: with a cache, transformers lets packed documents attend to each other.
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state
        hidden, weight, bias = self.head.apply(hidden, head.weight, getattr(head, "bias", None))
        if per_token:
            return token_logprobs(hidden, weight, labels, bias, impl=self.impl, chunk_size=self.chunk_size,
                                  softcap=self.softcap)
        return linear_cross_entropy(hidden, weight, labels, bias, impl=self.impl, chunk_size=self.chunk_size,
                                    z_loss=self.z_loss, softcap=self.softcap)


def model_inputs(batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a collated micro-batch that the model takes, on the device."""
    keys = ("input_ids", "labels", "attention_mask", "position_ids")
    return {k: batch[k].to(device) for k in keys if k in batch}
