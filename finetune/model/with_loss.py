"""The model as training, evaluation and `verify` run it: the decoder backbone and the fused loss in one forward.

The output layer's logits are never built in full: the fused linear cross-entropy (finetune/loss.py) takes the
backbone's hidden states and the output layer's weight, so a micro-batch costs one chunk of logits at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from finetune.attention import dispatch as attention
from finetune.loss.fused import linear_cross_entropy
from finetune.loss.logprobs import token_logprobs
from finetune.loss.targets import Targets, find_targets
from finetune.loss.targets import to_device as to_device_tensor
from finetune.model.architectures import head_spec, stateful_layer
from finetune.model.loading import output_layer
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
        self.takes_boundaries = takes_boundaries(lm)

    @classmethod
    def for_recipe(cls, lm: torch.nn.Module, loss: LossConfig, impl: str) -> CausalLMWithLoss:
        """The recipe's loss settings around `lm`; `impl` is loss.impl resolved for the device (resolve_impl)."""
        return cls(lm, impl, loss.chunk_size, loss.z_loss, loss.softcap)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, per_token: bool = False, targets: Targets | None = None,
                packed: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, number of targets); with per_token, (each target's log-probability, its flat position)
        for objectives that score whole sequences. `targets` and `packed` (model_inputs: the target positions and
        the packed rows' document boundaries, found on the CPU) spare the loss and the attention host syncs."""
        decoder, head = output_layer(self.lm)
        extra = packed if packed and self.takes_boundaries else {}
        # use_cache=False always: with a cache, transformers lets packed documents attend to each other.
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, **extra).last_hidden_state
        hidden, weight, bias = self.head.apply(hidden, head.weight, getattr(head, "bias", None))
        if per_token:
            return token_logprobs(hidden, weight, labels, bias, impl=self.impl, chunk_size=self.chunk_size,
                                  softcap=self.softcap, targets=targets)
        return linear_cross_entropy(hidden, weight, labels, bias, impl=self.impl, chunk_size=self.chunk_size,
                                    z_loss=self.z_loss, softcap=self.softcap, targets=targets)


def takes_boundaries(model: torch.nn.Module) -> bool:
    """Whether packed rows' document boundaries (attention.packed_kwargs) go into this model's call: only to our
    attention (other implementations find the documents themselves, some models refuse keywords they do not know),
    and not where layers carry a state along the sequence (refused for packing: transformers' gated delta net takes
    the boundaries as a request for kernels it may lack)."""
    return attention.is_ours(model) and stateful_layer(model) is None


_MODEL_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def to_device(batch: dict, device: torch.device) -> dict:
    """A collated micro-batch ready on `device`: every tensor copied there (without blocking the host, from pinned
    memory, on CUDA), and what the model call needs found on the CPU first: the target positions and id range
    (`target_positions`) and, for packed rows, the documents' boundaries (`packed`: attention.packed_kwargs). A step prepares
    its next micro-batches this way while the device still works on the current ones; model_inputs takes them
    as they are."""
    if batch.get("on_device") == device:
        return batch
    ready = {key: to_device_tensor(value, device) if isinstance(value, torch.Tensor) else value
             for key, value in batch.items()}
    ready["target_positions"] = find_targets(batch["labels"], device)
    if "position_ids" in batch and "attention_mask" not in batch:
        ready["packed"] = attention.packed_kwargs(batch["position_ids"], device)
    ready["on_device"] = device
    return ready


def model_inputs(batch: dict, device: torch.device) -> dict[str, Any]:
    """The keyword arguments of the model call for a collated micro-batch (to_device unless it already is)."""
    ready = to_device(batch, device)
    inputs = {k: ready[k] for k in (*_MODEL_KEYS, "packed") if k in ready}
    return {**inputs, "targets": ready["target_positions"]}


