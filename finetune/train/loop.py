"""The training loop, written out. Read it top to bottom: `setup` (setup.py) builds a `Run`, `train_loop` takes one
optimizer step at a time.

The loss contract (docs/design.md, "The loss contract"): for one optimizer step, every rank collates its
micro-batches first, the step's counts (target tokens for SFT) are all-reduced before the first backward, and
each micro-batch backpropagates its summed loss over those counts (times the world size, because DDP/FSDP
average gradients over ranks). The logged loss is the step's summed loss over its counts: exactly the quantity
whose gradient is applied. What a micro-batch's loss and counts are is the objective's business
(finetune/objectives/); the mechanics here are the same for every objective.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from finetune import dist
from finetune.batch import MicroBatch
from finetune.data.stream import StreamPlan
from finetune.errors import Interrupted, Stopped, UserError
from finetune.metrics import Stopwatch, mfu, model_depth_width, peak_memory_mb
from finetune.model import qat
from finetune.model.loading import save_final
from finetune.recipe import Recipe
from finetune.rl.plan import RolloutPlan
from finetune.run import atomic, checkpoint, lock
from finetune.train.evaluate import evaluate_loss
from finetune.train.parallel import gather_full_state
from finetune.train.setup import Progress, Run, setup, warn
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
    with lock.acquire(Path(recipe.output_dir), note=lambda m: warn(console, m)):
        yield


# --- the loop ------------------------------------------------------------------------------------------------

def train_loop(run: Run, stop: StopRequest | None = None) -> str | None:
    """Every optimizer step from the start (or the resumed step) to the end, then the final eval and save; asked to
    `stop` (SIGTERM: train/stop.py), up to the step under way (while generating rollouts: the steps done), with its
    checkpoint, returning what to tell the user. A step reads the device once (step.read_step); its update ratio is
    read with the next step's figures, so its metrics line is written then (or before an eval, a checkpoint or the
    end). The next step's micro-batches are collated and copied to the device while it still works on this one."""
    recipe, world, plan = run.recipe, run.world, run.plan
    done = run.start
    _watch_generation(plan, stop, lambda: done.step)
    epoch, pending, saved = 0, None, None
    try:
        if done.step == 0 and recipe.eval.at_start:
            _evaluate(run, 0)
        run.net.train()  # once: an eval switches it back when done
        clock, bad_streak, upcoming = Stopwatch(), 0, None
        depth_width = model_depth_width(run.lm)
        for step in range(done.step, plan.total):
            clock.start_lap()  # the step alone: the previous step's eval, checkpoint and logging are not in it
            # Collated ahead during the previous step, unless the rows depend on its update (generated rollouts).
            epoch, step_rows, micro = upcoming or _micro_batches(run, step, clock)
            upcoming = None
            qat.at_step(run.lm, recipe.qat, step)  # qat.fake_quant_after_n_steps: off for the first N steps
            # The step's counts over all micro-batches and ranks, known before any backward.
            counts, seq_tokens, padded_tokens, stopping, samples = step_counts(
                run.objective, micro, world, run.device, stop is not None and stop.requested, _samples(run, step_rows))
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
            done = Progress(step + 1, done.tokens_seen + seq_tokens, done.samples_seen + samples)
            saved = None  # no checkpoint of this step yet
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
            if ratio is None or ends or evals or saves or stops:  # read now (a skipped step's ratio is 0)
                _write_line(run, pending, pending.ratio_now())
                pending = None
            _check_bad_streak(bad_streak, recipe.train.max_bad_steps)  # after logging: the metrics show them
            if evals and _eval_ends_run(run, done.step):
                break  # early stopping: the run ends here, as at its last step (its eval just made)
            if saves or stops:
                saved = _save_checkpoint(run, done, epoch)
            if stops:
                return _stop_between_steps(run, done, epoch, None, saved)
        else:
            _evaluate(run, plan.total)
    except Interrupted:  # a generation (GRPO's rollouts or its eval) cut short by the stop request
        return _stop_between_steps(run, done, epoch, pending, saved)
    _save_final(run)
    return None


def _watch_generation(plan: Any, stop: StopRequest | None, steps_done: Callable[[], int]) -> None:
    """Generation (GRPO) asks the stop request between tokens once the run has a step to stop after. Before that, a
    fresh run generates and trains step 1 and stops after it, with its checkpoint: stopped with none, a requeued
    `resume: auto` would find nothing to resume."""
    if isinstance(plan, RolloutPlan) and stop is not None:
        plan.stop = lambda: stop.requested and steps_done() > 0


def _stop_between_steps(run: Run, done: Progress, epoch: int, pending: _Line | None, saved: Path | None) -> str:
    """Stopped after the steps done (train/stop.py): their last metrics line and checkpoint written (`saved`: the
    step's checkpoint when written already; none when this process took no step); returns what to tell the user."""
    if pending:
        _write_line(run, pending, pending.ratio_now())
    if saved is None and done.step > run.start.step:
        saved = _save_checkpoint(run, done, epoch)
    if run.logger:
        run.logger.close(ok=False)  # trackers: the run did not end
    return stopped_message(done.step, run.plan.total, saved)


@dataclass
class _Line:
    """A step's metrics line, waiting for its update ratio (a 0-dim tensor on the device; None: skipped, 0)."""

    record: dict[str, Any]
    ratio: torch.Tensor | None

    def ratio_now(self) -> float:
        """The ratio read now (a sync with the device)."""
        return float(self.ratio) if self.ratio is not None else 0.0


# The mean |trainer - engine| log-probability per token above which an uncorrected run is warned (TRL #3867 saw
# mismatches of this order make training collapse; fp32 on one device gives ~1e-7).
MISMATCH_WARNING = 0.02


def _write_line(run: Run, line: _Line, ratio: float) -> None:
    """Log a step's line with its update ratio now read; say when an applied update changed nothing."""
    record = line.record
    record["update_ratio"] = ratio
    # Weight decay alone still moves them; at lr 0 (a warmup from zero) nothing moves, rightly.
    if not record["skipped"] and ((ratio == 0.0 and record["lr"] > 0) or record["grad_norm"] == 0.0):
        what = "the trainable weights did not change" if ratio == 0.0 else "every gradient was 0"
        run.console.print(f"[yellow]step {record['step']}: {what}[/yellow]")
    if record.get("logprob_mismatch", 0.0) > MISMATCH_WARNING and run.recipe.grpo.importance_correction == "none" \
            and "mismatch" not in run.warned:
        run.warned.add("mismatch")  # once a run: it is in every step line from here
        run.console.print(f"[yellow]step {record['step']}: the rollouts' engine log-probabilities differ from the "
                          f"trainer's by {record['logprob_mismatch']:.3g} nats a token on average (logprob_mismatch): "
                          "the update is biased; grpo.importance_correction: mis (or tis) corrects it "
                          "(docs/rl.md)[/yellow]")
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
    # A streamed plan's rows are this rank's own already (data/stream.py): nothing to deal to the other ranks.
    size, rank = (1, 0) if getattr(run.plan, "rank_local", False) else (world.size, world.rank)
    micro = step_micro_batches(run.objective, step_rows, recipe, run.tokenizer.pad_token_id, size, rank,
                               run.device, run.context, run.padding_free)
    return epoch, step_rows, micro


def _samples(run: Run, step_rows: list[dict]) -> int:
    """This rank's part of the step's sample count, which step_counts sums over the ranks: every rank has the step's
    rows, so rank 0 counts them all, except where each reads its own (a streamed plan): each counts its own."""
    if not (run.world.is_main or getattr(run.plan, "rank_local", False)):
        return 0
    return sum(len(r["doc_lengths"]) if "doc_lengths" in r else 1 for r in step_rows)


def _check_bad_streak(bad_streak: int, most: int) -> None:
    if bad_streak >= most:
        raise UserError(f"{bad_streak} consecutive steps with a non-finite loss or gradient (train.max_bad_steps = "
                        f"{most}); lower train.lr, check the data, or use float32")


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


def _eval_ends_run(run: Run, step: int) -> bool:
    """Evaluate at `step`; True when early stopping (eval.early_stopping_patience) ends the run here."""
    if not run.early_stopping.stops(step, _evaluate(run, step)):
        return False
    run.console.print(run.early_stopping.message(step))
    return True


def _evaluate(run: Run, step: int) -> float | None:
    """Log the eval at `step`; its eval loss (None without eval samples, or for GRPO's mean reward)."""
    qat.at_step(run.lm, run.recipe.qat, step)  # as the next step will run
    if run.plan.evaluator is not None:  # GRPO: the mean reward of greedy completions of held-out prompts
        record = {"step": step, **run.plan.evaluator()}
        if run.logger:
            run.logger.log(record)
        return None
    if not run.eval_samples:
        return None
    micro = run.recipe.eval.micro_batch_size or run.recipe.train.micro_batch_size
    result = evaluate_loss(run.objective, run.net, run.eval_samples, run.recipe, micro,
                           run.tokenizer.pad_token_id, run.world, run.device, run.context)
    run.net.train()
    if run.logger:
        run.logger.log(result.record(step))
    return result.loss


def _save_checkpoint(run: Run, done: Progress, epoch: int) -> Path:
    state = checkpoint.trainer_state(run.recipe, step=done.step, epoch=epoch, samples_key=run.samples_key,
                                     global_batch=run.plan.global_batch, world_size=run.world.size,
                                     tokens_seen=done.tokens_seen, samples_seen=done.samples_seen,
                                     reference=getattr(run.objective, "reference_digest", None),
                                     images_key=run.images_key, frozen=run.frozen, config=run.config,
                                     early_stopping=run.early_stopping.state())
    rollouts = run.plan.resume_state(done.step) if isinstance(run.plan, RolloutPlan) else None
    if isinstance(run.plan, StreamPlan):  # every rank's place in its share of the stream, in rank order
        mine = [run.plan.resume_state(done.step)]
        state["stream"] = dist.all_gather_objects(mine) if run.world.distributed else mine
    return checkpoint.save(run.out.root, done.step, run.lm, run.optimizer, run.scheduler, state,
                           run.recipe.checkpoint.keep_last, rollouts)


def _save_final(run: Run) -> None:
    """final/ is written like a checkpoint: into a temporary directory renamed into place, so a disk that fills
    during the save leaves no half final/ (and no debris), only a message."""
    full_state = gather_full_state(run.net, run.lm)  # a collective under FSDP: every rank takes part
    if run.world.is_main:
        # final/ holds the quantized model (model/qat.py): under FSDP converted in an unsharded copy from full_state
        model, full_state = qat.final_model(run.lm, run.recipe.qat, full_state, run.qat_unsharded)
        atomic.write_dir(run.out.final, lambda tmp: save_final(model, run.tokenizer, tmp, state_dict=full_state),
                         "nothing was half-written: final/ is as it was before this save. Free disk space, then "
                         "run again: with resume: auto it continues from the newest checkpoint (without "
                         "checkpoints, use --overwrite)")
        run.logger.close()
        run.console.print(f"done: {run.out.final}")
