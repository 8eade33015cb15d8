"""Distillation (train.objective: distill): the student trained towards the teacher's distribution over the
vocabulary at every token SFT trains (docs/distill.md).

One term, the summed divergence (the generalized Jensen-Shannon divergence of finetune/loss/distill.py, fused and
chunked: never the full logits of either model), over the step's target tokens: micro-batch x accumulation x ranks
gives one batch's gradient, as for SFT. The teacher is loaded once, frozen, in eval mode, on the student's device; it
runs on the same micro-batch without gradients, and its hidden rows at the targets and its head are handed to the
student's forward, which computes the loss inside itself, where DDP and FSDP see it. A resume reloads the teacher
and refuses one whose weights changed (its digest is recorded like a reference's).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

from finetune.batch import MicroBatch, StoredTeacherFields
from finetune.context_parallel.models import check_model as check_context_parallel
from finetune.data import StepPlan
from finetune.errors import UserError
from finetune.model.digest import weights_digest
from finetune.model.loading import load_model, output_layer
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss, StoredTeacherRows
from finetune.objectives.base import MicroResult, Planning, Preparation
from finetune.objectives.on_policy import OnPolicyPlan
from finetune.objectives.rows import DatasetRows
from finetune.recipe import AdapterConfig, GRPOConfig, Recipe, TokenizerConfig
from finetune.recipe.distill import DistillConfig
from finetune.rl.generation import HFGenerator, PagedGenerator
from finetune.rl.rollout import end_ids


class Distill(DatasetRows):
    """One term, the summed divergence from the teacher, over the step's target tokens."""

    name = "distill"
    units = ("tokens",)
    needs: tuple[str, ...] = ()

    def __init__(self, cfg: DistillConfig) -> None:
        self.cfg = cfg
        if cfg.teacher_logprobs:  # offline: the teacher's top-k comes with each micro-batch
            self.needs = ("teacher",)
        self.teacher: CausalLMWithLoss | None = None
        self.vocab: int | None = None
        self.reference_digest: str | None = None  # the teacher's weights, which checkpoints record
        # Each metric's sum over the step's target tokens: the top-1 agreement always; the rest when they mean something.
        tail = cfg.top_k or cfg.teacher_logprobs
        self.metrics = {"agreement": "tokens", **({"teacher_tail": "tokens"} if tail else {}),
                        **({"student_ce": "tokens"} if cfg.sft_weight else {})}

    def prepare(self, splits: dict[str, list[dict]], lm: torch.nn.Module, setting: Preparation) -> None:
        """The teacher loaded, frozen, with the student's tokenizer checked against its own (offline: nothing to load)."""
        if self.teacher is None and not self.cfg.teacher_logprobs:
            self.teacher, self.vocab = load_teacher(setting.recipe, setting.tokenizer, lm, setting.impl,
                                                    setting.device, setting.say)
            if self.vocab is not None:
                self.metrics["teacher_outside"] = "tokens"
            self.reference_digest = weights_digest(self.teacher.lm)
            cp = setting.recipe.distributed
            if cp.context_parallel > 1:  # the teacher runs on each rank's share of the rows, its attention split too
                try:
                    check_context_parallel(self.teacher.lm, cp.context_parallel, cp.context_parallel_method)
                except UserError as e:
                    raise UserError(f"distill.teacher {self.cfg.teacher}: {e}") from None

    def plan(self, planning: Planning) -> StepPlan:
        """The datasets' rows each step; with distill.lmbda, a seeded fraction of steps on the student's own
        completions of their prompts, and with distill.seq_kd the others on the teacher's (objectives/on_policy.py)."""
        c = self.cfg
        if not c.lmbda and not c.seq_kd:
            return super().plan(planning)
        sampling = GRPOConfig(max_new_tokens=c.max_new_tokens, temperature=c.sample_temperature, top_p=1.0)

        engine = PagedGenerator if c.engine == "paged" else HFGenerator

        def sampler(lm: torch.nn.Module) -> HFGenerator | PagedGenerator:
            return engine(lm, planning.tokenizer, sampling, end_ids(planning.tokenizer, planning.lm),
                          planning.device, c.generation_batch_size)

        teacher = sampler(self.teacher.lm) if c.seq_kd and self.teacher is not None else None
        return OnPolicyPlan(planning.train, planning.recipe, planning.world_size, sampler(planning.lm), teacher)

    def counts(self, batch: MicroBatch) -> dict[str, int]:
        return {"tokens": batch.targets}

    def forward(self, net: torch.nn.Module, batch: MicroBatch, device: torch.device) -> MicroResult:
        if self.teacher is None and not self.cfg.teacher_logprobs:
            raise RuntimeError("Distill.prepare loads the teacher before the first forward")
        batch = batch.to(device)
        inputs = batch.model_inputs()
        c = self.cfg
        if c.teacher_logprobs:
            rows = stored_rows(batch.require("teacher", self.name), c)
        else:
            rows = dataclasses.replace(self.teacher.teacher_rows(**inputs), beta=c.beta, temperature=c.temperature,
                                       top_k=c.top_k, vocab=self.vocab, sft_weight=c.sft_weight)
        loss, sums = net(**inputs, teacher=rows)
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        return MicroResult({"tokens": loss}, {m: sums.get(m, zero) for m in self.metrics})


def stored_rows(stored: StoredTeacherFields, cfg: DistillConfig) -> StoredTeacherRows:
    """The micro-batch's stored teacher, cut to distill.top_k of each token's entries (they are in descending order:
    the rest joins the tail bucket)."""
    k = stored.ids.shape[1]
    if cfg.top_k is not None and cfg.top_k > k:
        raise UserError(f"distill.top_k: {cfg.top_k}, but the datasets store {k} teacher log-probabilities per "
                        f"token ({cfg.teacher_logprobs}); set it to {k} or less, or leave it out")
    top = cfg.top_k or k
    return StoredTeacherRows(stored.ids[:, :top], stored.logprobs[:, :top], beta=cfg.beta,
                             temperature=cfg.temperature, sft_weight=cfg.sft_weight)


def load_teacher(recipe: Recipe, tokenizer: Any, lm: torch.nn.Module, impl: str, device: torch.device,
                 say: Any = print) -> tuple[CausalLMWithLoss, int | None]:
    """The teacher with its fused-loss wrapper (its head's transforms), frozen and in eval mode, and the shared
    vocabulary when the teacher's is larger (None when both are the same size). Refused: a teacher whose tokenizer
    maps any text to other ids than the student's, and a student with more output rows than the teacher."""
    path = recipe.distill.teacher
    assert path is not None  # validation requires it for train.objective distill
    cfg = recipe.model.model_copy(update={"path": path, "init": "pretrained", "gguf_file": None, "config": None,
                                           "config_overrides": {}})
    _same_tokenizer(tokenizer, load_tokenizer(TokenizerConfig(path=path), cfg), path)
    _predicts_every_id(path, cfg, len(tokenizer))
    four_bit = recipe.distill.teacher_4bit
    check_fits(path, cfg.dtype, four_bit, device)
    teacher = load_model(cfg, AdapterConfig(), tokenizer, recipe.seed, device, key="distill.teacher",
                         four_bit=four_bit)
    if not four_bit:  # a 4-bit model is quantized onto its device (bitsandbytes refuses .to)
        teacher = teacher.to(device)
    teacher.eval().requires_grad_(False)
    student_rows = output_layer(lm)[1].weight.shape[0]
    teacher_rows = output_layer(teacher)[1].weight.shape[0]
    if student_rows > teacher_rows:
        raise UserError(f"distill.teacher {path}: its vocabulary has {teacher_rows} ids and the student's "
                        f"{student_rows}: the student's extra ids would have no teacher probability")
    vocab = student_rows if teacher_rows > student_rows else None
    extra = f"; {teacher_rows - student_rows} ids beyond the student's, their mass reported" if vocab else ""
    n = sum(p.numel() for p in teacher.parameters())
    bits = ", linear layers in 4-bit NF4" if four_bit else ""
    say(f"distill teacher: {path} ({n / 1e6:.2f}M parameters{bits}, vocabulary {teacher_rows}{extra})")
    return CausalLMWithLoss.for_recipe(teacher, recipe.loss, impl, recipe.model.packed_attention), vocab


def check_fits(path: str, dtype: str, four_bit: bool, device: torch.device, free: int | None = None) -> None:
    """Refuse, before loading, a local teacher whose weights alone would take more than the device's free memory
    (`free`, bytes: found when None): a clear error rather than an out-of-memory kill half way through the load."""
    elements = _elements(Path(path))
    if elements is None:
        return
    need = elements * (0.5 if four_bit else DTYPE_BYTES[dtype])  # NF4: half a byte a weight, most weights linear
    free = free if free is not None else free_memory(device)
    if free is not None and need > free:
        raise UserError(f"distill.teacher {path}: its {elements / 1e9:.2f}B weights take about {need / 2**30:.1f} GiB "
                        f"{'in 4-bit' if four_bit else 'in ' + dtype}, and the {device.type} has "
                        f"{free / 2**30:.1f} GiB free: use a smaller teacher, distill.teacher_4bit: true, or its "
                        "log-probabilities stored in the data (distill.teacher_logprobs)")


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _elements(path: Path) -> int | None:
    """The number of weights in a local model directory's safetensors files (their headers only); None when it has
    none (a hub id, other formats: not checked)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            names = f.keys()  # safe_open is not iterable
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return total


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: the GPU's free memory, or the host's available memory (Linux); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _predicts_every_id(path: str, cfg: Any, ids: int) -> None:
    """The teacher's output layer has a row for each of the tokenizer's ids: loading would otherwise add rows for the
    missing ones (random: distilled towards noise)."""
    from transformers import AutoConfig

    from finetune.model import vision

    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    rows = getattr(vision.text_config(config), "vocab_size", None)
    if isinstance(rows, int) and rows < ids:
        raise UserError(f"distill.teacher {path}: its vocabulary has {rows} ids and the tokenizer {ids}: the teacher "
                        "gives no probability to the others")


def _same_tokenizer(student: Any, teacher: Any, path: str) -> None:
    """The teacher's tokenizer maps every token to the student's id: distributions are compared id by id."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    differ = [t for t, i in ours.items() if theirs.get(t) != i]
    if differ or len(theirs) != len(ours):
        raise UserError(f"distill.teacher {path}: its tokenizer differs from the student's ({len(differ)} of "
                        f"{len(ours)} tokens have another id or none, {len(theirs)} tokens against {len(ours)}): "
                        "distillation compares the two distributions id by id, so they must share a tokenizer")
