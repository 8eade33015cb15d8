"""The recipe's `distill:` section: a teacher's token distributions into the student (train.objective: distill;
docs/distill.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from finetune.recipe.section import Section


class DistillConfig(Section):
    """Distillation (train.objective: distill): the student trained towards the teacher's distribution over the
    vocabulary at every token SFT would train, with the loss fused and chunked (never the full logits of either)."""

    teacher: str | None = None
    """The teacher: a local model directory or hub id with the student's tokenizer, loaded frozen, in eval mode."""
    teacher_4bit: bool = False
    """Load the teacher's linear layers in 4-bit NF4 (bitsandbytes, as a QLoRA base): about a quarter of its 16-bit
    memory, its embeddings, norms and head in model.dtype; its distribution then is the rounded model's."""
    teacher_logprobs: str | None = None
    """Offline distillation: the row field holding the teacher's top-k log-probabilities per token (Axolotl's KD
    layouts), instead of a teacher model; the values are the teacher's distribution at `temperature`."""
    beta: float = Field(0.5, ge=0, le=1)
    """The generalized Jensen-Shannon divergence's weight: 0 is forward KL(teacher || student), 1 reverse
    KL(student || teacher), in between the JSD against their beta-mixture (TRL's generalized_jsd_loss)."""
    temperature: float = Field(1.0, gt=0)
    """Both models' logits are divided by it (no T^2 factor, as TRL's generalized_jsd_loss)."""
    top_k: int | None = Field(None, gt=0)
    """The divergence over the teacher's top-k ids and one tail bucket holding each distribution's remaining mass
    (exact, no renormalization); null: the whole vocabulary (with teacher_logprobs: every stored entry, else the
    first top_k of each token's)."""
    sft_weight: float = Field(0.0, ge=0)
    """Weight of the student's own cross-entropy on the data's tokens, added to the divergence."""
    lmbda: float = Field(0.0, ge=0, le=1)
    """On-policy distillation (GKD's lambda): the fraction of optimizer steps, drawn per step from the seed, whose
    rows are the student's own completions of their prompts (the tokens before each row's last trained turn),
    sampled at `sample_temperature`; the rest train on the datasets' completions. Needs a teacher model and
    data.packing: false."""
    seq_kd: bool = False
    """Sequence-level KD (TRL's seq_kd): the steps that are not on-policy train on the teacher's own completions of
    their prompts, sampled as the student's are; the divergence is then taken on those tokens. Needs a teacher model
    and data.packing: false."""
    max_new_tokens: int = Field(128, gt=0)
    """The longest on-policy (or seq_kd) completion, in tokens."""
    sample_temperature: float = Field(0.9, gt=0)
    """The sampling temperature of on-policy (and seq_kd) completions (TRL's GKDConfig.temperature); the
    divergence's is `temperature`."""
    generation_batch_size: int = Field(16, gt=0)
    """On-policy prompts generated together: fixed, so that every split of the step samples the same completions."""
    engine: Literal["auto", "generate", "paged"] = "auto"
    """What generates on-policy (and seq_kd) completions, as grpo.engine: generate (transformers' generate on
    left-padded batches of generation_batch_size), paged (its continuous batching; greedy gives generate's tokens
    exactly), auto (generate: paged was measured slower on an H100; README)."""
