"""The model as training, evaluation and `verify` run it: the decoder backbone and the fused loss in one forward.

The output layer's logits are never built in full: the fused linear cross-entropy (finetune/loss/fused.py) takes the
backbone's hidden states and the output layer's weight, so a micro-batch costs one chunk of logits at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from finetune.attention import dispatch as attention
from finetune.attention.kernels import setting
from finetune.batch import Documents, Targets, VisionFields
from finetune.loss.distill import distill_loss, distill_stored_loss
from finetune.loss.fused import linear_cross_entropy, target_rows
from finetune.loss.logprobs import token_logprobs
from finetune.model import vision as vision_models
from finetune.model.architectures import head_spec, stateful_layer
from finetune.model.loading import output_layer
from finetune.model.router_loss import METRIC as ROUTER_METRIC
from finetune.model.router_loss import router_loss
from finetune.recipe import LossConfig


class CausalLMWithLoss(torch.nn.Module):
    """Backbone + fused loss in one forward, so DDP/FSDP hooks see the whole computation.

    Returns (loss_sum, n_targets) of the micro-batch; the model's own logits path is never used, so the full
    [tokens x vocab] logits are never built. A mixture-of-experts model whose config has output_router_logits adds
    its router's load-balancing loss, as its own forward would (finetune/model/router_loss.py).
    """

    def __init__(self, lm: torch.nn.Module, impl: str, chunk_size: int, z_loss: float, softcap: float | None,
                 packed_attention: str = "auto"):
        super().__init__()
        self.lm, self.impl, self.chunk_size, self.z_loss = lm, impl, chunk_size, z_loss
        # What the model's own head does to its logits (a scale, a soft-cap, a vocabulary slice), done here too:
        # else the run would train other logits than the model's (finetune/model/architectures.py).
        # Found once (a walk through a PEFT wrapper each forward is host time per micro-batch); a tuple, so that the
        # two are not registered again as submodules of this one.
        self._layers = output_layer(lm)
        self.head = head_spec(vision_models.text_config(lm.config), self._layers[1].weight.shape[0])
        if not vision_models.head_softcapped(lm.config):
            self.head = dataclasses.replace(self.head, softcap=None)
        self.softcap = softcap or self.head.softcap
        self.takes_boundaries = takes_boundaries(lm)
        # The run's packed-attention kernel setting, resolved once (the environment override read once per process);
        # the attention reads it from each micro-batch's Documents, which this module hands to the model call.
        self.packed_kernel = setting(packed_attention)
        # The load-balancing loss the model's own forward would add (output_router_logits), or None.
        self.router = router_loss(lm)
        self._router_weight = 1.0  # 0 inside router_loss_off()

    @classmethod
    def for_recipe(cls, lm: torch.nn.Module, loss: LossConfig, impl: str,
                   packed_attention: str = "auto") -> CausalLMWithLoss:
        """The recipe's loss settings around `lm`; `impl` is loss.impl resolved for the device (resolve_impl),
        `packed_attention` the recipe's model.packed_attention."""
        return cls(lm, impl, loss.chunk_size, loss.z_loss, loss.softcap, packed_attention)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, per_token: bool = False, targets: Targets | None = None,
                documents: Documents | None = None, temperature: float = 1.0, vision: VisionFields | None = None,
                teacher: TeacherRows | StoredTeacherRows | None = None, metrics: bool = False,
                ) -> tuple[torch.Tensor, Any]:
        """(summed loss, number of targets); with per_token, (each target's log-probability, its flat position)
        for objectives that score whole sequences. `targets` and `documents` (MicroBatch.model_inputs: the target
        positions and the packed rows' documents, found on the CPU) spare the loss and the attention host syncs.
        `temperature` (per_token only): the log-probabilities of logits / temperature. `vision`: the images of the
        rows (pixel values and the like), for a vision-language model's backbone. `teacher` (distillation): the
        teacher's rows at the same targets; then (summed divergence, plus sft_weight x the summed cross-entropy,
        and the loss's DistillSums), computed here, inside the forward that DDP and FSDP wrap.

        With the router's load-balancing loss (self.router), the summed loss adds router_aux_loss_coef x the
        micro-batch's load-balancing loss x its number of targets: over the step's target tokens (the loss contract)
        that is the model's own loss for one micro-batch, and the token-weighted mean of the micro-batches' values
        for several (docs/models.md). `metrics`: return (summed loss, {"router_aux_loss": that loss x the targets})
        instead, what SFT logs (empty without a router loss)."""
        routed = self.router is not None and teacher is None and not per_token
        hidden, weight, bias, router_logits = self._head_inputs(input_ids, attention_mask, position_ids, documents,
                                                                vision, routed)
        if teacher is not None:
            return self._distill(hidden, weight, bias, labels, targets, teacher)
        if per_token:
            if temperature != 1.0:  # log-probabilities of logits / T (GRPO's sampling policy), folded into the head
                if self.softcap is not None:
                    raise ValueError("a sampling temperature other than 1 with a soft-capped head is not supported")
                weight, bias = weight / temperature, bias / temperature if bias is not None else None
            return token_logprobs(hidden, weight, labels, bias, impl=self.impl, chunk_size=self.chunk_size,
                                  softcap=self.softcap, targets=targets)
        loss_sum, n_targets = linear_cross_entropy(hidden, weight, labels, bias, impl=self.impl,
                                                   chunk_size=self.chunk_size, z_loss=self.z_loss,
                                                   softcap=self.softcap, targets=targets)
        if not routed:
            return (loss_sum, {}) if metrics else (loss_sum, n_targets)
        # Weighted by the micro-batch's targets, so that the loop's division by the step's target tokens gives each
        # micro-batch's value its share of the step (a filler's share is 0, and still reaches the routers).
        weighted = self.router(router_logits, attention_mask) * n_targets
        loss_sum = loss_sum + (self.router.coef * self._router_weight) * weighted.to(loss_sum.dtype)
        return (loss_sum, {ROUTER_METRIC: weighted.detach()}) if metrics else (loss_sum, n_targets)

    @contextlib.contextmanager
    def router_loss_off(self) -> Iterator[None]:
        """The router's load-balancing loss left out of the summed loss (its value still reported): `finetune
        verify` checks the part of the loss that accumulation keeps exact, the cross-entropy."""
        self._router_weight = 0.0
        try:
            yield
        finally:
            self._router_weight = 1.0

    def _head_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, documents: Documents | None, vision: VisionFields | None,
                     routed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
        """The backbone's hidden states and the output layer's weight and bias, after the head's own transforms;
        with `routed`, the routers' logits too (every MoE layer's, in order), else None."""
        decoder, head = self._layers
        extra = documents.model_kwargs(self.packed_kernel) if documents is not None and self.takes_boundaries else {}
        if vision is not None:
            extra.update(vision.inputs)
        if routed:
            extra["output_router_logits"] = True
        # use_cache=False always: with a cache, transformers lets packed documents attend to each other.
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                      **extra)
        hidden, weight, bias = self.head.apply(out.last_hidden_state, head.weight, getattr(head, "bias", None))
        return hidden, weight, bias, out.router_logits if routed else None

    @torch.no_grad()
    def teacher_rows(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, targets: Targets | None = None,
                     documents: Documents | None = None, vision: VisionFields | None = None) -> TeacherRows:
        """This model (a distillation's teacher) at the micro-batch's target positions: its hidden rows and head,
        never its full logits; no gradient."""
        hidden, weight, bias, _ = self._head_inputs(input_ids, attention_mask, position_ids, documents, vision)
        keep, _ = target_rows(labels, targets)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
        return TeacherRows(rows, weight, bias, self.softcap)

    def _distill(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                 targets: Targets | None, teacher: TeacherRows | StoredTeacherRows) -> tuple[torch.Tensor, Any]:
        """The divergence of this model (the student) from the teacher's rows, summed over the targets, with the
        student's own cross-entropy times teacher.sft_weight."""
        keep, _ = target_rows(labels, targets)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
        if rows.shape[0] == 0:  # a filler: 0.0 that still reaches every parameter (DDP/FSDP hooks fire)
            zero = rows.sum() + weight.reshape(-1)[:0].sum() + (bias[:0].sum() if bias is not None else 0)
            return zero.float(), {}
        if isinstance(teacher, StoredTeacherRows):
            sums = distill_stored_loss(rows, weight, bias, teacher.ids, teacher.logprobs, beta=teacher.beta,
                                       temperature=teacher.temperature, chunk_size=self.chunk_size,
                                       student_softcap=self.softcap)
        else:
            sums = distill_loss(rows, weight, bias, teacher.hidden, teacher.weight, teacher.bias,
                                beta=teacher.beta, temperature=teacher.temperature, chunk_size=self.chunk_size,
                                student_softcap=self.softcap, teacher_softcap=teacher.softcap, top_k=teacher.top_k,
                                vocab=teacher.vocab)
        loss = sums.loss
        metrics = {"agreement": sums.agree, "teacher_tail": sums.tail, "teacher_outside": sums.outside}
        if teacher.sft_weight:
            ce, _ = linear_cross_entropy(hidden, weight, labels, bias, impl=self.impl, chunk_size=self.chunk_size,
                                         softcap=self.softcap, targets=targets)
            metrics["student_ce"] = ce.detach()
            loss = loss + teacher.sft_weight * ce
        return loss, metrics


@dataclass
class TeacherRows:
    """A distillation's teacher at a micro-batch's targets (CausalLMWithLoss.teacher_rows) and the divergence's
    settings (the distill: section), handed to the student's forward."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None
    beta: float = 0.5
    temperature: float = 1.0
    top_k: int | None = None
    vocab: int | None = None
    sft_weight: float = 0.0


@dataclass
class StoredTeacherRows:
    """An offline distillation's teacher at a micro-batch's targets: its stored top-k ids and log-probabilities
    [targets, k] (descending), and the divergence's settings."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    beta: float = 0.5
    temperature: float = 1.0
    sft_weight: float = 0.0


def router_loss_off(net: torch.nn.Module) -> contextlib.AbstractContextManager:
    """CausalLMWithLoss.router_loss_off of `net`, or of the model DDP wraps in it (`.module`; FSDP2 keeps the class);
    nothing to turn off for another module."""
    inner = getattr(net, "module", net)
    return inner.router_loss_off() if isinstance(inner, CausalLMWithLoss) else contextlib.nullcontext()


def takes_boundaries(model: torch.nn.Module) -> bool:
    """Whether packed rows' documents (Documents.model_kwargs) go into this model's call: only to our
    attention (other implementations find the documents themselves, some models refuse keywords they do not know),
    and not where layers carry a state along the sequence (refused for packing: transformers' gated delta net takes
    the boundaries as a request for kernels it may lack)."""
    return attention.is_ours(model) and stateful_layer(model) is None
