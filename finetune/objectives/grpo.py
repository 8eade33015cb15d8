"""GRPO: group relative policy optimization, its policy loss normalized exactly over the optimizer step.

Per completion token (TRL's formula, docs/rl.md): with r = exp(logp - old_logp) and A the completion's advantage
(log-probabilities of the logits divided by grpo.temperature, the policy that samples, as TRL scores them),
    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t,
    kl_t = exp(ref - logp) - (ref - logp) - 1   (k3; times r with kl_gradient: exact, TRL's default).
The micro-batch's term is the sum of loss_t (normalize tokens, constant) or of each completion's loss_t over its
own scored tokens (sequences); the loop divides it by the step's count of the unit (every completion token of the
step, its completions, or completions x max_new_tokens), summed over every micro-batch and rank before the first
backward: the update is the same under any split of the step. Its metrics are sums over the scored tokens,
divided by the step's tokens when read: the KL, the clipped fractions, the policy's log-probability and its
entropy (at grpo.temperature, summed in the same chunked pass through the head: finetune/loss/logprobs.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from finetune import dist
from finetune.batch import MicroBatch
from finetune.data.cache import Prepared
from finetune.loss.logprobs import entropy_sum
from finetune.model.digest import weights_digest
from finetune.model.loading import load_model
from finetune.model.with_loss import CausalLMWithLoss
from finetune.objectives.base import MicroResult, Planning, Preparation
from finetune.recipe import AdapterConfig, GRPOConfig, Recipe
from finetune.rl.plan import RolloutPlan
from finetune.rl.sources import rollout_plan, rollout_samples

UNITS = {"tokens": "tokens", "sequences": "sequences", "constant": "token_budget"}


class GRPO:
    """The GRPO objective over rollouts collated with their advantages (MicroBatch.rollouts)."""

    name = "grpo"
    needs = ("rollouts",)
    metrics = {"kl": "tokens", "clip_ratio": "tokens", "clip_ratio_low": "tokens", "clip_ratio_high": "tokens",
               "policy_logp": "tokens", "entropy": "tokens"}

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        if cfg.importance_correction != "none":  # the engine/trainer mismatch and what the weight did, per token
            self.metrics = {**self.metrics, "logprob_mismatch": "tokens", "importance_weight": "tokens",
                            "importance_masked": "tokens"}
        elif cfg.engine == "paged" or cfg.replay:  # an engine's log-probabilities may come: their mismatch, logged
            self.metrics = {**self.metrics, "logprob_mismatch": "tokens"}
        self.units = (UNITS[cfg.normalize],)
        self._reference: CausalLMWithLoss | None = None
        self._adapter_off: torch.nn.Module | None = None  # the policy whose adapter is turned off for the reference
        self.reference_digest: str | None = None  # grpo.reference: PATH's weights, checked on a resume

    def samples(self, recipe: Recipe, tokenizer: Any, world: dist.World, say: Callable[[str], Any]) -> Prepared:
        """None up front: the plan makes the rows from rollouts (finetune/rl/sources.py)."""
        return rollout_samples(recipe, tokenizer, say)

    def plan(self, planning: Planning) -> RolloutPlan:
        """The replay file's rollouts, or the policy's, with their advantages, one batch per optimizer step."""
        p = planning
        return rollout_plan(p.recipe, p.tokenizer, p.lm, p.net, p.device, p.world, p.world_size)

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """The reference model (beta > 0): the policy with its adapter off, a frozen copy of the model as loaded,
        or grpo.reference's model."""
        if not self.cfg.beta:
            return
        recipe, path = setting.recipe, self.cfg.reference
        if path == "auto" and hasattr(lm, "disable_adapter"):
            self._adapter_off, ref = lm, lm
        elif path == "auto" and setting.fresh_model:
            ref = copy.deepcopy(lm)
        else:
            cfg = recipe.model if path == "auto" else recipe.model.model_copy(
                update={"path": path, "init": "pretrained", "gguf_file": None, "config_overrides": {}})
            ref = load_model(cfg, AdapterConfig(), setting.tokenizer, recipe.seed, setting.device,
                             key="model.path" if path == "auto" else "grpo.reference").to(setting.device)
        if ref is not lm:
            ref.requires_grad_(False).eval()
            # Identified by content: a resume loads it again (auto: from model.path), and against other weights
            # there it is refused.
            self.reference_digest = weights_digest(ref)
        self._reference = CausalLMWithLoss.for_recipe(ref, recipe.loss, setting.impl, recipe.model.packed_attention)
        what = ("the policy with its adapter off" if self._adapter_off is not None
                else "the model as loaded (a frozen copy)" if ref is not lm and path == "auto" and setting.fresh_model
                else path if path != "auto" else recipe.model.path)
        setting.say(f"grpo reference: {what}")

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        r = batch.require("rollouts", self.name)
        unit = self.units[0]
        if unit == "tokens":
            return {"tokens": batch.targets}
        return {unit: r.count * (self.cfg.max_new_tokens if unit == "token_budget" else 1)}

    @contextlib.contextmanager
    def _reference_mode(self) -> Iterator[None]:
        """No gradients, no dropout, and the adapter off when the reference is the policy's base."""
        lm = self._adapter_off
        if lm is None:
            with torch.no_grad():
                yield
            return
        training = lm.training
        lm.eval()
        try:
            with torch.no_grad(), lm.disable_adapter():
                yield
        finally:
            lm.train(training)

    def reference_logps(self, batch: MicroBatch) -> torch.Tensor:
        """The reference's log-probability of every scored token of a (moved) micro-batch."""
        with self._reference_mode():
            ref, _ = self._reference(**batch.model_inputs(), per_token=True, temperature=self.cfg.temperature)
        return ref

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        batch = batch.to(device)
        r = batch.require("rollouts", self.name)
        with entropy_sum() as entropy:  # the policy's, in the same chunked pass, summed over the scored tokens
            logp, keep = net(**batch.model_inputs(), per_token=True, temperature=self.cfg.temperature)
        seq = r.seq_index.reshape(-1).index_select(0, keep)
        advantage = r.advantages.to(logp.dtype).index_select(0, seq)
        old = r.old_logps.reshape(-1).index_select(0, keep).to(logp.dtype)
        old = torch.where(torch.isnan(old), logp.detach(), old)  # no sampling log-probs: on-policy, ratio 1
        ratio = torch.exp(logp - old)
        low, high = 1 - self.cfg.epsilon, 1 + self.cfg.clip_high
        per_token = -torch.min(ratio * advantage, torch.clamp(ratio, low, high) * advantage)
        extra: dict[str, torch.Tensor] = {}
        if self.cfg.importance_correction != "none":
            sampling = r.sampling_logps.reshape(-1).index_select(0, keep).to(logp.dtype)
            weight, extra = importance_weights(old.detach() - sampling, seq, len(r.scored), self.cfg)
            per_token = per_token * weight  # the policy term only, as TRL (the KL is added after)
        elif "logprob_mismatch" in self.metrics:
            sampling = r.sampling_logps.reshape(-1).index_select(0, keep).to(logp.dtype)
            extra = {"logprob_mismatch": torch.nan_to_num(old.detach() - sampling, nan=0.0).abs().sum()}  # no weight
        kl = torch.zeros_like(logp)
        if self.cfg.beta:
            d = self.reference_logps(batch).to(logp.dtype) - logp
            kl = torch.exp(d) - d - 1
            per_token = per_token + self.cfg.beta * (kl * ratio if self.cfg.kl_gradient == "exact" else kl)
        if self.cfg.normalize == "sequences":
            scored = torch.tensor(r.scored, dtype=logp.dtype).clamp(min=1).to(device, non_blocking=True)
            per_token = per_token / scored.index_select(0, seq)
        clipped_low = (ratio < low) & (advantage < 0)
        clipped_high = (ratio > high) & (advantage > 0)
        metrics = {"kl": kl.detach().sum(), "clip_ratio": (clipped_low | clipped_high).sum(),
                   "clip_ratio_low": clipped_low.sum(), "clip_ratio_high": clipped_high.sum(),
                   "policy_logp": logp.detach().sum(),
                   "entropy": entropy.total if entropy.total is not None else logp.new_zeros(()), **extra}
        return MicroResult({self.units[0]: per_token.sum()}, {k: v.double() for k, v in metrics.items()})


def importance_weights(log_ratio: torch.Tensor, seq: torch.Tensor, completions: int,
                       cfg: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each scored token's importance weight from the trainer's minus the engine's log-probability (NaN, no engine
    value: 0, weight 1, as TRL), per token or summed per completion (`seq`: each token's completion), truncated (tis)
    or masked (mis) to [importance_min, importance_max]; and its metrics, sums over the tokens: |log_ratio|
    (logprob_mismatch), the weight, the tokens whose weight was masked to 0."""
    diff = torch.nan_to_num(log_ratio, nan=0.0)
    mismatch = diff.abs().sum()
    if cfg.importance_level == "sequence":
        per_completion = torch.zeros(completions, dtype=diff.dtype, device=diff.device).index_add_(0, seq, diff)
        diff = per_completion.index_select(0, seq)
    weight = torch.exp(diff)
    low = cfg.importance_min if cfg.importance_min is not None else 0.0
    high = cfg.importance_max if cfg.importance_max is not None else math.inf
    outside = (weight < low) | (weight > high)
    weight = weight.clamp(low, high) if cfg.importance_correction == "tis" else weight.masked_fill(outside, 0.0)
    masked = outside.sum() if cfg.importance_correction == "mis" else outside.new_zeros((), dtype=torch.long)
    return weight, {"logprob_mismatch": mismatch, "importance_weight": weight.sum(), "importance_masked": masked}
