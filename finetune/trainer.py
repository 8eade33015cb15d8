"""The training loop, written out. Read it top to bottom: setup, then one optimizer step at a time.

The loss contract (DESIGN.md section 5): for one optimizer step, every rank gathers its micro-batches first,
the step's target-token count N is all-reduced before the first backward, and each micro-batch
backpropagates `loss_sum / N` (times the world size, because DDP/FSDP average gradients over ranks). The
logged loss is the sum of every token loss of the step over N: exactly the quantity whose gradient we apply.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
from rich.console import Console

from finetune import checkpoint, dist, versions
from finetune.data import DataStats, collate, epoch_rows, rank_micro_batches, steps_in
from finetune.data.cache import prepare
from finetune.data.cache import preprocess as preprocess_data
from finetune.data.isolation import check_packing_isolation
from finetune.errors import UserError
from finetune.evaluate import CausalLMWithLoss, evaluate_loss, model_inputs
from finetune.loss import resolve_impl
from finetune.metrics import Stopwatch, mfu, open_sinks, peak_memory_mb, update_sums, weight_sample
from finetune.model import count_parameters, load_model, load_tokenizer, save_final
from finetune.optim import build_optimizer, build_scheduler
from finetune.recipe import Recipe, features, recipe_hash, to_yaml, training_keys
from finetune.rundir import (
    check_disk_room,
    check_output_dir,
    check_resume_recipe,
    remove_previous_run,
    resume_path,
    truncate_metrics,
)
from finetune.wrap import gather_full_state, wrap_model


class StepPlan:
    """Which rows each global optimizer step uses, worked out lazily one epoch at a time.

    Step s of an epoch takes rows [s * global_batch, (s + 1) * global_batch) of that epoch's rows, the same
    for every world size. Epochs are (re)packed only when reached, so `epochs: null` with a large max_steps
    costs nothing up front.
    """

    def __init__(self, samples: list[dict], recipe: Recipe, world_size: int) -> None:
        t = recipe.train
        self.samples, self.recipe = samples, recipe
        self.global_batch = t.micro_batch_size * t.gradient_accumulation_steps * world_size
        self._steps_per_epoch: list[int] = []
        self._rows: tuple[int, list[dict]] | None = None  # (epoch, rows): the current epoch only
        if t.epochs is not None:
            total = sum(self.steps_in_epoch(e) for e in range(t.epochs))
            self.total = min(total, t.max_steps) if t.max_steps else total
        else:
            self.steps_in_epoch(0)  # fail early if one epoch cannot fill a step
            self.total = t.max_steps

    def rows_of_epoch(self, epoch: int) -> list[dict]:
        if self._rows is None or self._rows[0] != epoch:
            self._rows = (epoch, epoch_rows(self.samples, self.recipe.data, self.recipe.seed, epoch))
        return self._rows[1]

    def steps_in_epoch(self, epoch: int) -> int:
        while len(self._steps_per_epoch) <= epoch:
            e = len(self._steps_per_epoch)
            n_rows = len(self.rows_of_epoch(e))
            n_steps = steps_in(n_rows, self.global_batch, self.recipe.data.drop_last)
            if n_steps == 0:
                raise UserError(f"one optimizer step needs {self.global_batch} rows but an epoch has only {n_rows} "
                                "(data.drop_last: true drops them all); lower train.micro_batch_size or "
                                "gradient_accumulation_steps, or set data.drop_last: false")
            self._steps_per_epoch.append(n_steps)
        return self._steps_per_epoch[epoch]

    def step(self, step: int) -> tuple[int, list[dict]]:
        """(epoch, rows) of global optimizer step `step` (0-based)."""
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        rows = self.rows_of_epoch(epoch)
        return epoch, rows[step * self.global_batch: (step + 1) * self.global_batch]


def train(recipe: Recipe, *, overwrite: bool = False, allow_unpinned: bool = False,
          console: Console | None = None) -> Path:
    """Run a recipe to the end; returns the output directory. Works alone and under torchrun."""
    world = dist.from_env()
    # soft_wrap: log lines stay whole when the output is a file or a pipe (rich would wrap them at 80 columns).
    console = console or Console(soft_wrap=True)
    if not world.is_main:
        console = Console(quiet=True, soft_wrap=True)
    with dist.process_group(world) as device:
        return _train(recipe, world, device, console, overwrite, allow_unpinned)


def preprocess(recipe: Recipe, *, show: int = 0, rebuild: bool = False) -> None:
    """`finetune preprocess`: lives here because the tokenizer (model) and the data meet only in the trainer."""
    preprocess_data(recipe, load_tokenizer(recipe.tokenizer, recipe.model), show=show, rebuild=rebuild)


def _train(recipe: Recipe, world: dist.World, device: torch.device, console: Console, overwrite: bool,
           allow_unpinned: bool) -> Path:
    out = Path(recipe.output_dir)
    impl = resolve_impl(recipe.loss.impl, device)
    used = features(recipe)
    if "liger" not in used and impl == "liger":
        used.append("liger")  # loss.impl auto runs Liger on CUDA whenever it imports: hold it to its pin too
    warnings = versions.enforce(versions.packages_for(used), allow_unpinned=allow_unpinned)
    for w in warnings:
        console.print(f"[yellow]warning: {w}[/yellow]")
    resume_from = resume_path(recipe, out, console)
    # Checked now, before anything slow; an old run is only removed once everything has loaded (below).
    replaced = check_output_dir(out, fresh=resume_from is None, overwrite=overwrite,
                                 restart_incomplete=recipe.resume == "auto") if world.is_main else []
    dist.barrier()

    torch.manual_seed(recipe.seed)
    if recipe.model.trust_remote_code:  # said before the tokenizer and the model load, i.e. before that code runs
        console.print("[yellow]model.trust_remote_code is on: running code shipped with the model[/yellow]")
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    # Under torchrun, rank 0 tokenizes and writes the cache while the others wait, then read it: one process
    # tokenizes, not all of them at once.
    if not world.is_main:
        dist.wait_for_main("rank 0 to preprocess the data")
    prepared = prepare(recipe, tokenizer)
    train_samples, eval_samples, stats = prepared.train, prepared.evals, prepared.train_stats
    if world.is_main:
        dist.wait_for_main("rank 0 to preprocess the data")
    console.print(prepared.note, markup=False, highlight=False)  # reused the preprocessed-data cache, or wrote it
    _report_data(console, stats, len(eval_samples))
    plan = StepPlan(train_samples, recipe, world.size)

    lm = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed).to(device)
    trainable, total = count_parameters(lm)
    if world.is_main:
        check_disk_room(out, lm, checkpointing=recipe.checkpoint.every_steps is not None)
    if trainable == 0:
        raise UserError("the model has no trainable parameters; nothing would be learned")
    if recipe.data.packing and recipe.data.packing_check:
        err = check_packing_isolation(lm, len(tokenizer))
        console.print(f"packing isolation check passed (max logit difference {err:.1e})")
    attn = getattr(lm.config, "_attn_implementation", "?")
    console.print(f"model: {total / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable; loss: {impl}; "
                  f"attention: {attn}; device: {device}; world size {world.size}; {plan.total} optimizer steps of "
                  f"{plan.global_batch} rows")
    net = wrap_model(CausalLMWithLoss(lm, impl, recipe.loss.chunk_size, recipe.loss.z_loss, recipe.loss.softcap),
                     recipe, world, device)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = build_optimizer(((n, p) for n, p in lm.named_parameters()), recipe.train)
    scheduler = build_scheduler(optimizer, plan.total, recipe.train)

    start_step, tokens_seen, samples_seen = 0, 0, 0
    if resume_from is not None:
        state = checkpoint.load(resume_from, lm, optimizer, scheduler)
        check_resume_recipe(recipe, state, plan.global_batch, prepared.samples_key)
        start_step, tokens_seen, samples_seen = state["step"], state["tokens_seen"], state.get("samples_seen", 0)
        console.print(f"resumed from {resume_from} at step {start_step}")
    if world.is_main:
        remove_previous_run(out, replaced)
        (out / "recipe.yaml").write_text(to_yaml(recipe))
        (out / "versions.json").write_text(json.dumps(versions.snapshot(warnings), indent=2))
    if world.is_main and start_step:
        truncate_metrics(out / "metrics.jsonl", start_step)
    logger = open_sinks(out, recipe.logging, console, plan.total, start_step) if world.is_main else None
    pad_id = tokenizer.pad_token_id
    eval_every = recipe.eval.every_steps
    eval_micro = recipe.eval.micro_batch_size or recipe.train.micro_batch_size

    def evaluate(step: int) -> None:
        if not eval_samples:
            return
        loss, n = evaluate_loss(net, eval_samples, recipe, eval_micro, pad_id, world, device)
        if logger:
            logger.log({"step": step, "eval_loss": loss, "eval_tokens": n})

    try:
        if start_step == 0 and recipe.eval.at_start:
            evaluate(0)
        clock, bad_streak = Stopwatch(), 0
        for step in range(start_step, plan.total):
            clock.start_lap()  # the step alone: the previous step's eval, checkpoint and logging are not in it
            epoch, step_rows = plan.step(step)
            micro = [collate(rows, recipe.data, pad_id) for rows in rank_micro_batches(
                step_rows, recipe.train.micro_batch_size, world.size, world.rank, recipe.data.group_by_length)]

            # N_step: the step's target tokens over all micro-batches and ranks, known before any backward.
            local_targets = sum(m["targets"] for m in micro)
            counts = dist.all_reduce_sum(torch.tensor([local_targets, sum(m["seq_tokens"] for m in micro),
                                                       sum(m["padded_tokens"] for m in micro)], device=device))
            n_step, seq_tokens, padded_tokens = (int(x) for x in counts.tolist())
            loss_total = torch.zeros((), device=device, dtype=torch.float32)
            net.train()
            for i, batch in enumerate(micro):
                # DDP: synchronize gradients only on the step's last micro-batch.
                sync = i == len(micro) - 1
                with contextlib.nullcontext() if sync or not hasattr(net, "no_sync") else net.no_sync():
                    loss_sum, _ = net(**model_inputs(batch, device))
                    (loss_sum * (world.size / max(n_step, 1))).backward()
                loss_total += loss_sum.detach()
            step_loss = float(dist.all_reduce_sum(loss_total)) / max(n_step, 1)

            max_norm = recipe.train.max_grad_norm or math.inf
            grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm)))
            healthy = math.isfinite(step_loss) and math.isfinite(grad_norm) and n_step > 0
            before = [weight_sample(p).clone() for p in params] if healthy else None
            if healthy:
                optimizer.step()
                bad_streak = 0
            elif n_step > 0:
                bad_streak += 1
                console.print(f"[red]step {step + 1}: non-finite loss or gradient; update skipped "
                              f"({bad_streak} in a row)[/red]")
            else:
                console.print(f"[yellow]step {step + 1}: no target tokens (every label masked); skipped[/yellow]")
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            update_ratio = _update_ratio(before, params, dist.is_sharded(lm)) if before is not None else 0.0
            if healthy and (update_ratio == 0.0 or grad_norm == 0.0):  # weight decay alone still moves them
                what = "the trainable weights did not change" if update_ratio == 0.0 else "every gradient was 0"
                console.print(f"[yellow]step {step + 1}: {what}[/yellow]")
            seconds = clock.lap()
            tokens_seen += seq_tokens
            samples_seen += sum(len(r["doc_lengths"]) if "doc_lengths" in r else 1 for r in step_rows)
            step_mfu = mfu(seq_tokens / seconds / world.size, total, lm.config.num_hidden_layers,
                           lm.config.hidden_size, recipe.data.max_seq_len or 2048, device)
            if logger:
                logger.log({
                    "step": step + 1, "total_steps": plan.total, "epoch": epoch, "loss": step_loss,
                    "grad_norm": grad_norm, "grad_norm_clipped": min(grad_norm, max_norm), "lr": lr,
                    "tokens": n_step, "seq_tokens": seq_tokens, "padded_tokens": padded_tokens,
                    "tokens_seen": tokens_seen, "samples": samples_seen, "tokens_per_s": seq_tokens / seconds,
                    "padded_tokens_per_s": padded_tokens / seconds, "update_ratio": update_ratio,
                    "skipped": not healthy, "peak_memory_mb": peak_memory_mb(), "elapsed_s": clock.elapsed,
                    **({"mfu": step_mfu} if step_mfu is not None else {}),
                })
            if bad_streak >= recipe.train.max_bad_steps:  # after logging, so the metrics show the bad steps
                raise UserError(f"{bad_streak} consecutive steps with a non-finite loss or gradient "
                                f"(train.max_bad_steps = {recipe.train.max_bad_steps}); lower train.lr, "
                                "check the data, or use float32")
            done = step + 1
            if eval_every and done % eval_every == 0 and done != plan.total:
                evaluate(done)
            if recipe.checkpoint.every_steps and done % recipe.checkpoint.every_steps == 0:
                checkpoint.save(out, done, lm, optimizer, scheduler,
                                {"step": done, "epoch": epoch, "recipe_hash": recipe_hash(recipe),
                                 "training_keys": training_keys(recipe), "samples_key": prepared.samples_key,
                                 "global_batch": plan.global_batch, "world_size": world.size,
                                 "tokens_seen": tokens_seen, "samples_seen": samples_seen},
                                recipe.checkpoint.keep_last)
        evaluate(plan.total)
        full_state = gather_full_state(net, lm)  # a collective under FSDP: every rank takes part
        if world.is_main:
            save_final(lm, tokenizer, out / "final", state_dict=full_state)
            logger.close()
            console.print(f"done: {out / 'final'}")
    except BaseException:
        if logger:
            logger.close(ok=False)  # trackers record the run as failed
        raise
    return out


def _full(norm: torch.Tensor) -> torch.Tensor:
    """FSDP2 returns the norm as a DTensor; its full value is what we log and compare."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _update_ratio(before: list[torch.Tensor], params: list[torch.Tensor], sharded: bool) -> float:
    """||w_after - w_before|| / ||w_before|| over the sampled elements of all trainable weights: 0 means the step
    changed none of them."""
    sums = update_sums(before, params)
    if sharded:  # each rank holds a shard: the norms are sums over all ranks
        dist.all_reduce_sum(sums)
    return math.sqrt(float(sums[0])) / max(math.sqrt(float(sums[1])), 1e-12)


def _report_data(console: Console, stats: DataStats, n_eval: int) -> None:
    line = (f"data: {stats.samples} samples, {stats.tokens} tokens, {stats.target_tokens} target tokens; "
            f"{n_eval} eval samples")
    if stats.truncated or stats.dropped_too_long:
        line += f"; {stats.truncated} truncated, {stats.dropped_too_long} dropped (too long)"
    if stats.bad_rows_skipped:
        line += f"; [yellow]{stats.bad_rows_skipped} bad rows skipped[/yellow]"
    console.print(line)
    for example in stats.bad_row_examples:  # the first few, so a user can see which rows and why
        console.print(f"  skipped: {example}", markup=False)
