"""The training loop, written out. Read it top to bottom: `setup` builds a `Run`, `train_loop` takes one optimizer
step at a time.

The loss contract (docs/design.md, "The loss contract"): for one optimizer step, every rank collates its
micro-batches first, the step's counts (target tokens for SFT) are all-reduced before the first backward, and
each micro-batch backpropagates its summed loss over those counts (times the world size, because DDP/FSDP
average gradients over ranks). The logged loss is the step's summed loss over its counts: exactly the quantity
whose gradient is applied. What a micro-batch's loss and counts are is the objective's business
(finetune/objectives/); the mechanics here are the same for every objective.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from finetune import dist, versions
from finetune.attention.kernels import setting
from finetune.batch import MicroBatch
from finetune.data import StepPlan
from finetune.errors import Stopped, UserError
from finetune.loss.fused import describe_impl, resolve_impl
from finetune.metrics import (
    MetricsLogger,
    Stopwatch,
    WeightSamples,
    mfu,
    model_depth_width,
    open_sinks,
    peak_memory_mb,
)
from finetune.model import kernels as model_kernels
from finetune.model.digest import config_digest, frozen_digest
from finetune.model.isolation import check_packable, check_packing_isolation, is_ours, packed_attention
from finetune.model.loading import count_parameters, save_final
from finetune.objectives import Objective
from finetune.recipe import Recipe, features, to_yaml
from finetune.rl.plan import RolloutPlan
from finetune.run import atomic, checkpoint, lock, startup
from finetune.run.directory import RunDir, truncate_metrics, write_run_header
from finetune.train.evaluate import evaluate_loss
from finetune.train.optim import build_optimizer, build_scheduler
from finetune.train.parallel import gather_full_state, wrap_model
from finetune.train.parts import Parts, load_parts, plan_for
from finetune.train.plan import step_larger_than_epoch
from finetune.train.step import clip_gradients, forward_backward, read_step, step_counts, step_micro_batches
from finetune.train.stop import StopRequest, stopped_message


def train(recipe: Recipe, *, overwrite: bool = False, allow_unpinned: bool = False,
          console: Console | None = None) -> Path:
    """Run a recipe to the end; returns the output directory. Works alone and under torchrun."""
    world = dist.from_env()
    # soft_wrap: log lines stay whole when the output is a file or a pipe (rich would wrap them at 80 columns).
    console = console or Console(soft_wrap=True)
    if not world.is_main:
        console = Console(quiet=True, soft_wrap=True)
    with dist.process_group(world) as device, _run_lock(recipe, world, console):
        run = setup(recipe, world, device, console, overwrite=overwrite, allow_unpinned=allow_unpinned)
        out = run.out.root
        try:
            with StopRequest().watching() as stop:
                stopped = train_loop(run, stop)
        except BaseException:
            if run.logger:
                run.logger.close(ok=False)  # trackers record the run as failed
            raise
        # The model goes while the process group lives: DDP's reducer holds the group, and destroying the reducer
        # after shutdown() had destroyed the group hung a gloo rank now and then at exit (seen in CI).
        del run
    if stopped:  # raised after the process group closed cleanly: every rank stopped after the same step
        raise Stopped(stopped)
    return out


@contextlib.contextmanager
def _run_lock(recipe: Recipe, world: dist.World, console: Console) -> Iterator[None]:
    """Rank 0 holds output_dir's run lock from before it reads the directory until the run has ended."""
    if not world.is_main:
        yield
        return
    with lock.acquire(Path(recipe.output_dir), note=lambda m: _warn(console, m)):
        yield


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
    plan: StepPlan | RolloutPlan
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
            _warn(console, f"{out.root}: {done}")
        resume_from = checkpoint.resume_path(recipe, out.root, warn=lambda m: _warn(console, m))
        replaced = startup.check_output_dir(out.root, recipe, resume_from=resume_from, overwrite=overwrite)
    resume_from = dist.from_main(resume_from)

    torch.manual_seed(recipe.seed)
    if recipe.model.trust_remote_code:  # said before the tokenizer and the model load, i.e. before that code runs
        console.print("[yellow]model.trust_remote_code is on: running code shipped with the model[/yellow]")
    compiled: list[int] = []
    parts = load_parts(recipe, world, device, lambda m: console.print(m, markup=False, highlight=False),
                       fresh_model=resume_from is None,
                       check_model=lambda lm, tokenizer: compiled.append(_check_model(recipe, lm, tokenizer, console)))
    # Before any wrapping shards the parameters; on rank 0 only, as every rank loaded the same weights.
    frozen = dist.from_main(frozen_digest(parts.lm) if world.is_main else None)
    config = config_digest(parts.lm.config)  # once: checkpoints record it, a resume compares it
    plan = plan_for(recipe, parts, world)
    if plan.note:
        console.print(plan.note)
    if isinstance(plan, StepPlan) and (oversized := step_larger_than_epoch(plan, world.size)) is not None:
        _warn(console, oversized)
    checkpoint_every = plan.cadence(recipe.checkpoint.every_steps, recipe.checkpoint.every_epochs)
    lm = parts.lm
    if world.is_main:
        _check_disk_room(recipe, out, lm, checkpoint_every is not None, replaced, resumed=resume_from is not None)
    n_params, kernels_used = _report_model(recipe, parts, world, plan, compiled[0], console)
    net = wrap_model(parts.net, recipe, world, device)
    optimizer = build_optimizer(((n, p) for n, p in lm.named_parameters()), recipe.train)
    scheduler = build_scheduler(optimizer, plan.total, recipe.train)
    start = Progress()
    if resume_from is not None:
        state = checkpoint.load(resume_from, lm, optimizer, scheduler)
        checkpoint.check_resume_recipe(recipe, state, plan.global_batch, parts.samples_key,
                                       getattr(parts.objective, "reference_digest", None), parts.images_key,
                                       frozen=frozen, config=config)
        start = Progress(state["step"], state["tokens_seen"], state.get("samples_seen", 0))
        if isinstance(plan, RolloutPlan) and (note := plan.restore(checkpoint.rollout_state(resume_from), start.step,
                                                                    str(resume_from))):
            _warn(console, note)
        console.print(f"resumed from {resume_from} at step {start.step}")
    logger = _open_run_dir(recipe, out, console, replaced, versions.snapshot(warnings) | {"run": kernels_used}, plan,
                           start, resumed=resume_from is not None) if world.is_main else None
    return Run(recipe, world, device, console, out, parts.tokenizer, lm, net, parts.objective, optimizer, scheduler,
               plan, parts.evals, parts.samples_key, logger, start, n_params,
               plan.cadence(recipe.eval.every_steps, recipe.eval.every_epochs), checkpoint_every, parts.images_key,
               frozen, config)


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


def _check_model(recipe: Recipe, lm: torch.nn.Module, tokenizer: Any, console: Console) -> int:
    """The loaded model, before anything runs it: compiled (train.compile; returns how many layers), and its packed
    documents isolated from each other. Compiled first, so that the isolation check proves the compiled path."""
    compiled = model_kernels.compile_layers(lm) if recipe.train.compile else 0
    if recipe.data.packing:
        check_packable(lm, tokenizer.pad_token_id)
    if recipe.data.packing and recipe.data.packing_check:
        err = check_packing_isolation(lm, len(tokenizer), kernel=setting(recipe.model.packed_attention))
        console.print(f"packing isolation check passed (max logit difference {err:.1e})")
    return compiled


def _report_model(recipe: Recipe, parts: Parts, world: dist.World, plan: StepPlan, compiled: int,
                  console: Console) -> tuple[int, dict[str, Any]]:
    """Print what runs (parameters, loss, attention and its packed kernel, device, steps); returns the number of
    parameters and the record of what runs (versions.json "run": the loss, the attention, the packed kernel and
    why it was chosen), which `finetune runs compare` shows."""
    lm, device = parts.lm, parts.device
    trainable, total = count_parameters(lm)
    attn = getattr(lm.config, "_attn_implementation", "?")
    loss = describe_impl(parts.impl, device)  # says so where Liger runs in Triton's interpreter (a testing mode)
    packed, record = "", {"loss": loss, "attention": attn, "packed_kernel": None, "packed_kernel_why": None}
    if recipe.data.packing and is_ours(lm):
        kernel, why = packed_attention(lm, device, setting(recipe.model.packed_attention))
        packed = f"; packed rows: {kernel} ({why})"
        record |= {"packed_kernel": kernel, "packed_kernel_why": why}
    liger = f"; liger kernels: {model_kernels.liger_summary(lm)}" if recipe.model.liger_kernels else ""
    compiled_note = f"; compiled: {compiled} decoder layers" if compiled else ""
    console.print(f"model: {total / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable; loss: {loss}; "
                  f"attention: {attn}; device: {device}; world size {world.size}; {plan.total} optimizer steps of "
                  f"{plan.global_batch} rows{packed}{liger}{compiled_note}")
    return total, record


def _open_run_dir(recipe: Recipe, out: RunDir, console: Console, replaced: list[str], snapshot: dict[str, Any],
                  plan: StepPlan, start: Progress, *, resumed: bool) -> MetricsLogger:
    """Rank 0, once everything has loaded: replace an earlier run (--overwrite), mark the directory as this run's,
    record the recipe and the versions, drop metrics lines a resume re-runs, and open the metrics sinks."""
    startup.remove_previous_run(out.root, replaced)
    debris = [*atomic.remove_temporaries(out.checkpoints, checkpoint.PREFIX),
              *atomic.remove_temporaries(out.root, out.final.name)]
    if debris:
        _warn(console, f"removed what interrupted saves left in {out.root}: {', '.join(debris)}")
    marker = startup.claim(out.root, recipe, fresh=not resumed)
    console.print(f"run {marker.run_id} in {out.root}", markup=False, highlight=False)
    write_run_header(out, to_yaml(recipe), snapshot)
    if start.step:
        truncate_metrics(out, start.step)
    return open_sinks(out, recipe.logging, console, plan.total, start.step, config=recipe.model_dump(mode="json"))


# --- the loop ------------------------------------------------------------------------------------------------

def train_loop(run: Run, stop: StopRequest | None = None) -> str | None:
    """Every optimizer step from the start (or the resumed step) to the end, then the final eval and save; asked to
    `stop` (SIGTERM: train/stop.py), up to the step under way, with its checkpoint, returning what to tell the user.

    A step reads the device once (step.read_step: the skip decision needs its loss and gradient norm); its update
    ratio is read with the next step's figures, so its metrics line is written then (or before an eval, a
    checkpoint or the end, whichever comes first). The next step's micro-batches are collated and copied to the
    device while the device still works on this one."""
    recipe, world, plan = run.recipe, run.world, run.plan
    done = run.start
    if done.step == 0 and recipe.eval.at_start:
        _evaluate(run, 0)
    run.net.train()  # once: an eval switches it back when done
    clock, bad_streak, pending = Stopwatch(), 0, None
    depth_width = model_depth_width(run.lm)
    upcoming = None
    for step in range(done.step, plan.total):
        clock.start_lap()  # the step alone: the previous step's eval, checkpoint and logging are not in it
        # Collated ahead during the previous step, unless the rows depend on its update (generated rollouts).
        epoch, step_rows, micro = upcoming or _micro_batches(run, step, clock)
        upcoming = None
        # The step's counts over all micro-batches and ranks, known before any backward.
        counts, seq_tokens, padded_tokens, stopping = step_counts(run.objective, micro, world, run.device,
                                                                  stop is not None and stop.requested)
        sums = forward_backward(run.net, run.objective, micro, counts, world, run.device)
        norm = clip_gradients(run.params, recipe.train.max_grad_norm or math.inf)
        if step + 1 < plan.total and plan.prefetch:
            upcoming = _micro_batches(run, step + 1, clock)
        figures = read_step(run.objective, sums, norm, counts, [pending.ratio] if pending else [])
        if pending:
            with clock.excluded():
                _write_line(run, pending, figures.late[0])
        healthy = figures.healthy(counts)
        before = run.weight_samples.take() if healthy else None
        if healthy:
            run.optimizer.step()
            bad_streak = 0
        else:
            bad_streak = _report_skipped(run.console, step, counts, bad_streak)
        run.optimizer.zero_grad(set_to_none=True)
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()
        ratio = _update_ratio(run, before) if before is not None else None
        seconds = clock.lap()
        done = Progress(step + 1, done.tokens_seen + seq_tokens, done.samples_seen + sum(
            len(r["doc_lengths"]) if "doc_lengths" in r else 1 for r in step_rows))
        step_mfu = mfu(seq_tokens / seconds / world.size, run.n_params, *depth_width,
                       recipe.data.max_seq_len or 2048, run.device) if all(depth_width) else None
        max_norm = recipe.train.max_grad_norm or math.inf
        pending = _Line({
            "step": done.step, "total_steps": plan.total, "epoch": epoch, "loss": figures.loss,
            "grad_norm": figures.grad_norm, "grad_norm_clipped": min(figures.grad_norm, max_norm), "lr": lr,
            **counts, **figures.metrics, "seq_tokens": seq_tokens, "padded_tokens": padded_tokens,
            "tokens_seen": done.tokens_seen, "samples": done.samples_seen, "tokens_per_s": seq_tokens / seconds,
            "padded_tokens_per_s": padded_tokens / seconds, "update_ratio": 0.0, "skipped": not healthy,
            "peak_memory_mb": peak_memory_mb(run.device), "elapsed_s": clock.elapsed, **plan.info(step),
            **({"mfu": step_mfu} if step_mfu is not None else {}),
        }, ratio)
        ends = bad_streak >= recipe.train.max_bad_steps or done.step == plan.total
        stops = stopping and not ends  # an eval now would spend the time the signal's sender gives to stop
        evals = run.eval_every and done.step % run.eval_every == 0 and done.step != plan.total and not stops
        saves = run.checkpoint_every and done.step % run.checkpoint_every == 0
        if ratio is None or ends or evals or saves or stops:  # read now: a skipped step's ratio is 0, nothing to wait for
            _write_line(run, pending, float(ratio) if ratio is not None else 0.0)
            pending = None
        if bad_streak >= recipe.train.max_bad_steps:  # after logging, so the metrics show the bad steps
            raise UserError(f"{bad_streak} consecutive steps with a non-finite loss or gradient "
                            f"(train.max_bad_steps = {recipe.train.max_bad_steps}); lower train.lr, "
                            "check the data, or use float32")
        if evals:
            _evaluate(run, done.step)
        if saves or stops:
            saved = _save_checkpoint(run, done, epoch)
        if stops:
            if run.logger:
                run.logger.close(ok=False)  # trackers: the run did not end
            return stopped_message(done.step, plan.total, saved)
    _evaluate(run, plan.total)
    _save_final(run)
    return None


@dataclass
class _Line:
    """A step's metrics line, waiting for its update ratio (a 0-dim tensor on the device; None: skipped, 0)."""

    record: dict[str, Any]
    ratio: torch.Tensor | None


def _write_line(run: Run, line: _Line, ratio: float) -> None:
    """Log a step's line with its update ratio now read; say when an applied update changed nothing."""
    record = line.record
    record["update_ratio"] = ratio
    # Weight decay alone still moves them; at lr 0 (a warmup from zero) nothing moves, rightly.
    if not record["skipped"] and ((ratio == 0.0 and record["lr"] > 0) or record["grad_norm"] == 0.0):
        what = "the trainable weights did not change" if ratio == 0.0 else "every gradient was 0"
        run.console.print(f"[yellow]step {record['step']}: {what}[/yellow]")
    if record.get("zero_std_groups") == 1.0:
        run.console.print(f"[yellow]step {record['step']}: the rewards are equal within every group (no advantage): "
                          "nothing to learn from its rollouts[/yellow]")
    if run.logger:
        run.logger.log(record)


def _micro_batches(run: Run, step: int, clock: Stopwatch) -> tuple[int, list[dict], list[MicroBatch]]:
    """(epoch, the step's rows, this rank's micro-batches of them collated and on the device). Making the rows
    (GRPO: generating and scoring the rollouts, timed by the plan) is left out of the training step's time, so
    tokens_per_s is the training's own rate."""
    recipe, world = run.recipe, run.world
    with clock.excluded():
        epoch, step_rows = run.plan.step(step)
    micro = step_micro_batches(run.objective, step_rows, recipe, run.tokenizer.pad_token_id, world.size, world.rank,
                               run.device)
    return epoch, step_rows, micro


def _report_skipped(console: Console, step: int, counts: dict[str, int], bad_streak: int) -> int:
    """Say why step `step` applied no update; returns the streak of non-finite steps."""
    empty = [u for u, n in counts.items() if n == 0]
    if empty:
        what = "target tokens (every label masked)" if empty[0] == "tokens" else empty[0]
        console.print(f"[yellow]step {step + 1}: no {what}; skipped[/yellow]")
        return bad_streak
    console.print(f"[red]step {step + 1}: non-finite loss or gradient; update skipped ({bad_streak + 1} in a "
                  "row)[/red]")
    return bad_streak + 1


def _update_ratio(run: Run, before: torch.Tensor) -> torch.Tensor:
    # Under FSDP2 each rank holds a shard of every weight: the sums are summed over ranks.
    return run.weight_samples.ratio(before, dist.all_reduce_sum if dist.is_sharded(run.lm) else None)


def _evaluate(run: Run, step: int) -> None:
    if run.plan.evaluator is not None:  # GRPO: the mean reward of greedy completions of held-out prompts
        record = {"step": step, **run.plan.evaluator()}
        if run.logger:
            run.logger.log(record)
        return
    if not run.eval_samples:
        return
    micro = run.recipe.eval.micro_batch_size or run.recipe.train.micro_batch_size
    result = evaluate_loss(run.objective, run.net, run.eval_samples, run.recipe, micro,
                           run.tokenizer.pad_token_id, run.world, run.device)
    run.net.train()
    if run.logger:
        run.logger.log(result.record(step))


def _save_checkpoint(run: Run, done: Progress, epoch: int) -> Path:
    state = checkpoint.trainer_state(run.recipe, step=done.step, epoch=epoch, samples_key=run.samples_key,
                                     global_batch=run.plan.global_batch, world_size=run.world.size,
                                     tokens_seen=done.tokens_seen, samples_seen=done.samples_seen,
                                     reference=getattr(run.objective, "reference_digest", None),
                                     images_key=run.images_key, frozen=run.frozen, config=run.config)
    rollouts = run.plan.resume_state(done.step) if isinstance(run.plan, RolloutPlan) else None
    return checkpoint.save(run.out.root, done.step, run.lm, run.optimizer, run.scheduler, state,
                           run.recipe.checkpoint.keep_last, rollouts)


def _save_final(run: Run) -> None:
    """final/ is written like a checkpoint: into a temporary directory renamed into place, so a disk that fills
    during the save leaves no half final/ (and no debris), only a message."""
    full_state = gather_full_state(run.net, run.lm)  # a collective under FSDP: every rank takes part
    if run.world.is_main:
        atomic.write_dir(run.out.final, lambda tmp: save_final(run.lm, run.tokenizer, tmp, state_dict=full_state),
                         "nothing was half-written: final/ is as it was before this save. Free disk space, then "
                         "run again: with resume: auto it continues from the newest checkpoint (without "
                         "checkpoints, use --overwrite)")
        run.logger.close()
        run.console.print(f"done: {run.out.final}")


def _warn(console: Console, message: str) -> None:
    console.print(message, style="yellow", markup=False, highlight=False)
