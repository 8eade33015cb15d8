"""Everything a training run needs before its first step, built once: `setup` checks the environment and the output
directory, loads the data and the model, restores a checkpoint and opens the run directory, and returns a `Run`
(loop.py then takes one optimizer step at a time)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from finetune import dist, versions
from finetune.attention.kernels import setting
from finetune.context_parallel.groups import context_group, data_parallel
from finetune.context_parallel.isolation import sharded_isolation_error
from finetune.context_parallel.models import check_model as check_context_parallel
from finetune.context_parallel.shard import ContextGroup
from finetune.data import StepPlan
from finetune.data.stream import StreamPlan
from finetune.errors import UserError
from finetune.loss.fused import describe_impl, resolve_impl
from finetune.metrics import MetricsLogger, WeightSamples, open_sinks
from finetune.model import kernels as model_kernels
from finetune.model import qat
from finetune.model.digest import config_digest, frozen_digest
from finetune.model.experts import experts_implementation
from finetune.model.isolation import (
    check_packable,
    check_packing_isolation,
    default_tolerance,
    is_ours,
    packed_attention,
)
from finetune.model.loading import count_parameters
from finetune.objectives import Objective
from finetune.recipe import Recipe, features, to_yaml
from finetune.recipe.code import run_record
from finetune.rl.plan import RolloutPlan
from finetune.run import atomic, checkpoint, startup
from finetune.run.directory import RunDir, truncate_metrics, write_run_header
from finetune.train import padding_free
from finetune.train.early_stop import EarlyStopping
from finetune.train.optim import build_optimizer, build_scheduler
from finetune.train.padding_free import PaddingFree
from finetune.train.parallel import wrap_model
from finetune.train.parts import Parts, load_parts, plan_for
from finetune.train.plan import step_larger_than_epoch


@dataclass
class Progress:
    """Where the run stands: the optimizer steps done, and the real input tokens and samples trained on."""

    step: int = 0
    tokens_seen: int = 0
    samples_seen: int = 0


@dataclass
class Run:
    """Everything the step loop needs, built once by `setup`."""

    recipe: Recipe
    world: dist.World
    device: torch.device
    console: Console
    out: RunDir
    tokenizer: Any
    lm: torch.nn.Module  # the model (PEFT-wrapped with an adapter): what is saved
    net: torch.nn.Module  # the model with its fused loss, DDP/FSDP-wrapped: what is run
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: StepPlan | RolloutPlan | StreamPlan
    eval_samples: list[dict]
    samples_key: str | None  # the training data's identity, recorded in checkpoints
    logger: MetricsLogger | None  # rank 0 only
    start: Progress
    n_params: int
    eval_every: int | None  # optimizer steps between evals (eval.every_steps or every_epochs, resolved)
    checkpoint_every: int | None
    images_key: str | None = None  # the training images' bytes, recorded in checkpoints (None: no images)
    frozen: str | None = None  # the weights a resume loads from model.path again (model/digest.py), recorded too
    config: str | None = None  # the model's config by content (model/digest.py): with `frozen`, a moved model.path
    context: ContextGroup | None = None  # this rank's context-parallel group (distributed.context_parallel > 1)
    padding_free: bool = False  # packing off: each micro-batch's samples end to end in one row (padding_free.py)
    early_stopping: EarlyStopping = field(default_factory=lambda: EarlyStopping(None))  # eval.early_stopping_patience
    warned: set[str] = field(default_factory=set)  # the once-a-run warnings said already
    # QAT under FSDP, rank 0: the model unsharded, its weights on the meta device until the end (qat.unsharded_copy)
    qat_unsharded: torch.nn.Module | None = None

    @functools.cached_property
    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters, listed once (walking every parameter each step is host time per step)."""
        return [p for p in self.net.parameters() if p.requires_grad]

    @functools.cached_property
    def weight_samples(self) -> WeightSamples:
        """The samples the update ratio compares, their views made once."""
        return WeightSamples(self.params)


# --- setup -------------------------------------------------------------------------------------------------

def setup(recipe: Recipe, world: dist.World, device: torch.device, console: Console, *, overwrite: bool,
          allow_unpinned: bool) -> Run:
    """Check the environment and the output directory, load the data and the model, restore a checkpoint."""
    out = RunDir(Path(recipe.output_dir))
    impl = resolve_impl(recipe.loss.impl, device)
    warnings = _enforce_versions(recipe, impl, allow_unpinned, console)
    # Rank 0 verifies the checkpoints (their checksums) and checks the directory, holding the run lock; the other
    # ranks take its answer. Checked now, before anything slow; an old run is only removed once everything loaded.
    replaced: list[str] = []
    resume_from = None
    if world.is_main:
        for done in [*atomic.restore_displaced(out.checkpoints, checkpoint.PREFIX),  # a kill mid-swap (atomic.py)
                     *atomic.restore_displaced(out.root, out.final.name)]:
            warn(console, f"{out.root}: {done}")
        resume_from = checkpoint.resume_path(recipe, out.root, warn=lambda m: warn(console, m))
        replaced = startup.check_output_dir(out.root, recipe, resume_from=resume_from, overwrite=overwrite)
    resume_from = dist.from_main(resume_from)

    torch.manual_seed(recipe.seed)
    if recipe.model.trust_remote_code:  # said before the tokenizer and the model load, i.e. before that code runs
        console.print("[yellow]model.trust_remote_code is on: running code shipped with the model[/yellow]")
    checked: list[tuple[int, PaddingFree]] = []
    parts = load_parts(recipe, world, device, lambda m: console.print(m, markup=False, highlight=False),
                       fresh_model=resume_from is None,
                       check_model=lambda lm, tokenizer: checked.append(_check_model(recipe, lm, tokenizer, device,
                                                                                     console)))
    compiled, flat = checked[0]
    # Before any wrapping shards the parameters; on rank 0 only, as every rank loaded the same weights.
    frozen = dist.from_main(frozen_digest(parts.lm) if world.is_main else None)
    config = config_digest(parts.lm.config)  # once: checkpoints record it, a resume compares it
    cp = recipe.distributed
    context = context_group(world.rank, world.size, cp.context_parallel, cp.context_parallel_method) \
        if world.distributed else None
    if context is not None:
        check_context_parallel(parts.lm, context.ranks, context.method)
        if recipe.data.packing and recipe.data.packing_check:
            _check_sharded_isolation(recipe, parts, context, device, console)
    plan = plan_for(recipe, parts, world, data_parallel(world.rank, world.size, context)[1])
    if plan.note:
        console.print(plan.note)
    if isinstance(plan, StepPlan) and (oversized := step_larger_than_epoch(plan, world.size)) is not None:
        warn(console, oversized)
    checkpoint_every = plan.cadence(recipe.checkpoint.every_steps, recipe.checkpoint.every_epochs)
    lm = parts.lm
    if world.is_main:
        _check_disk_room(recipe, out, lm, checkpoint_every is not None, replaced, resumed=resume_from is not None)
    n_params, kernels_used = _report_model(recipe, parts, world, plan, compiled, flat, console)
    # QAT under FSDP: rank 0 converts the trained model at the end in an unsharded copy, made before sharding.
    unsharded = qat.unsharded_copy(lm) if (world.is_main and world.distributed and recipe.qat.weight_dtype
                                           and recipe.distributed.strategy == "fsdp") else None
    net = wrap_model(parts.net, recipe, world, device)
    optimizer = build_optimizer(((n, p) for n, p in lm.named_parameters()), recipe.train)
    scheduler = build_scheduler(optimizer, plan.total, recipe.train)
    start, state = Progress(), None
    if resume_from is not None:
        state = checkpoint.load(resume_from, lm, optimizer, scheduler)
        checkpoint.check_resume_recipe(recipe, state, plan.global_batch, parts.samples_key,
                                       getattr(parts.objective, "reference_digest", None), parts.images_key,
                                       frozen=frozen, config=config)
        start = Progress(state["step"], state["tokens_seen"], state.get("samples_seen", 0))
        if isinstance(plan, RolloutPlan) and (note := plan.restore(checkpoint.rollout_state(resume_from), start.step,
                                                                    str(resume_from))):
            warn(console, note)
        if isinstance(plan, StreamPlan):  # each rank's place in its share of the stream (data/stream.py)
            plan.restore(state.get("stream"), start.step, str(resume_from))
        console.print(f"resumed from {resume_from} at step {start.step}")
    record = kernels_used | ({"code": code} if (code := run_record(recipe)) else {})  # imported already: cheap
    record |= getattr(plan, "record", {})  # a streamed plan: that the data was streamed, and how
    logger = _open_run_dir(recipe, out, console, replaced, versions.snapshot(warnings) | {"run": record}, plan,
                           start, resumed=resume_from is not None) if world.is_main else None
    return Run(recipe, world, device, console, out, parts.tokenizer, lm, net, parts.objective, optimizer, scheduler,
               plan, parts.evals, parts.samples_key, logger, start, n_params,
               plan.cadence(recipe.eval.every_steps, recipe.eval.every_epochs), checkpoint_every, parts.images_key,
               frozen, config, context, flat.on, EarlyStopping.resumed(recipe.eval.early_stopping_patience, state),
               qat_unsharded=unsharded)


def _check_disk_room(recipe: Recipe, out: RunDir, lm: torch.nn.Module, checkpointing: bool, replaced: list[str],
                     resumed: bool) -> None:
    """keep_last + 1 checkpoints coexist while the newest is written (fewer to add when a resume has some)."""
    on_disk = len(checkpoint.complete_checkpoints(out.checkpoints)) if resumed else 0
    copies = startup.checkpoint_copies(recipe.checkpoint.keep_last, on_disk) if checkpointing else 0
    startup.check_disk_room(out.root, lm, checkpoints=copies, reclaim=startup.tree_bytes(out.root, replaced))


def _enforce_versions(recipe: Recipe, impl: str, allow_unpinned: bool, console: Console) -> list[str]:
    used = features(recipe)
    if "liger" not in used and impl == "liger":
        used.append("liger")  # whatever chose Liger, it is held to its pin
    warnings = versions.enforce(versions.packages_for(used), allow_unpinned=allow_unpinned)
    for w in warnings:
        console.print(f"[yellow]warning: {w}[/yellow]")
    return warnings


def _check_model(recipe: Recipe, lm: torch.nn.Module, tokenizer: Any, device: torch.device,
                 console: Console) -> tuple[int, PaddingFree]:
    """The loaded model, before anything runs it: compiled (train.compile), whether its micro-batches can be
    padding-free (padding_free.py), and its packed documents isolated from each other. Compiled first, so that the
    isolation check proves the compiled path. Returns (how many layers were compiled, the padding-free choice)."""
    compiled = model_kernels.compile_layers(lm) if recipe.train.compile else 0
    flat = padding_free.choose(recipe, lm, tokenizer.pad_token_id, device)
    if recipe.data.packing:
        check_packable(lm, tokenizer.pad_token_id)
    if (recipe.data.packing or flat.on) and recipe.data.packing_check:
        try:
            err = check_packing_isolation(lm, len(tokenizer), kernel=setting(recipe.model.packed_attention))
        except UserError as leak:
            if recipe.data.packing or recipe.data.padding_free is True:
                raise
            warn(console, f"padding-free micro-batches off: {leak}")  # auto: padded rows keep samples apart
            return compiled, PaddingFree(False, "auto: the isolation check failed")
        what = "packing" if recipe.data.packing else "padding-free"
        console.print(f"{what} isolation check passed (max logit difference {err:.1e})")
    return compiled, flat


def _check_sharded_isolation(recipe: Recipe, parts: Parts, context: ContextGroup, device: torch.device,
                             console: Console) -> None:
    """Packed documents isolated across the context-parallel cut (context_parallel/isolation.py), with the
    tolerance of the whole-row check."""
    err = sharded_isolation_error(parts.lm, len(parts.tokenizer), context, device)
    tolerance = default_tolerance(next(parts.lm.parameters()).dtype, device)
    if not err <= tolerance:
        raise UserError(f"distributed.context_parallel: packed documents leak attention once rows are split across "
                        f"{context.ranks} ranks: changing one document changed another's logits by {err:.3g} "
                        f"(tolerance {tolerance:.1g}); this is finetune's bug to report")
    console.print(f"packing isolation check across {context.ranks} context-parallel ranks passed (max logit "
                  f"difference {err:.1e})")


def _report_model(recipe: Recipe, parts: Parts, world: dist.World, plan: StepPlan, compiled: int, flat: PaddingFree,
                  console: Console) -> tuple[int, dict[str, Any]]:
    """Print what runs (parameters, loss, attention and its packed kernel, device, steps); returns the number of
    parameters and the record of what runs (versions.json "run": the loss, the attention, the packed kernel and
    why it was chosen), which `finetune runs compare` shows."""
    lm, device = parts.lm, parts.device
    trainable, total = count_parameters(lm)
    attn = getattr(lm.config, "_attn_implementation", "?")
    loss = describe_impl(parts.impl, device)  # says so where Liger runs in Triton's interpreter (a testing mode)
    if recipe.train.objective == "reward":  # no token loss: the score head's Bradley-Terry loss
        loss = "bradley-terry on a score head"
    packed, record = "", {"loss": loss, "attention": attn, "packed_kernel": None, "packed_kernel_why": None}
    if (recipe.data.packing or flat.on) and is_ours(lm):
        kernel, why = packed_attention(lm, device, setting(recipe.model.packed_attention))
        packed = f"; {'packed' if recipe.data.packing else 'padding-free'} rows: {kernel} ({why})"
        record |= {"packed_kernel": kernel, "packed_kernel_why": why}
    if not recipe.data.packing:
        record["padding_free"] = flat.on
        packed += "" if flat.on else f"; padded micro-batches ({flat.why})"
    liger_note = model_kernels.liger_auto_note(lm, device, recipe.model.liger_kernels)
    liger = f"; liger kernels: {liger_note}" if liger_note else ""
    record["liger_kernels"] = model_kernels.liger_summary(lm) if model_kernels.liger_modules(lm) else None
    experts = experts_implementation(lm)
    if experts is not None:
        record["experts_implementation"] = experts
    experts_note = f"; experts: {experts}" if experts else ""
    compiled_note = f"; compiled: {compiled} decoder layers" if compiled else ""
    console.print(f"model: {total / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable; loss: {loss}; "
                  f"attention: {attn}; device: {device}; world size {world.size}; {plan.total} optimizer steps of "
                  f"{plan.global_batch} rows{packed}{experts_note}{liger}{compiled_note}")
    if (quantized := qat.record(lm, recipe.qat)) is not None:
        record["qat"] = quantized
        console.print(qat.log_line(quantized, plan.total), markup=False, highlight=False)
    return total, record


def _open_run_dir(recipe: Recipe, out: RunDir, console: Console, replaced: list[str], snapshot: dict[str, Any],
                  plan: StepPlan, start: Progress, *, resumed: bool) -> MetricsLogger:
    """Rank 0, once everything has loaded: replace an earlier run (--overwrite), mark the directory as this run's,
    record the recipe and the versions, drop metrics lines a resume re-runs, and open the metrics sinks."""
    startup.remove_previous_run(out.root, replaced)
    debris = [*atomic.remove_temporaries(out.checkpoints, checkpoint.PREFIX),
              *atomic.remove_temporaries(out.root, out.final.name)]
    if debris:
        warn(console, f"removed what interrupted saves left in {out.root}: {', '.join(debris)}")
    marker = startup.claim(out.root, recipe, fresh=not resumed)
    console.print(f"run {marker.run_id} in {out.root}", markup=False, highlight=False)
    write_run_header(out, to_yaml(recipe), snapshot)
    if start.step:
        truncate_metrics(out, start.step)
    return open_sinks(out, recipe.logging, console, plan.total, start.step, config=recipe.model_dump(mode="json"))


def warn(console: Console, message: str) -> None:
    console.print(message, style="yellow", markup=False, highlight=False)
