"""The run directory: refuse to overwrite a run by accident, choose the checkpoint to resume, refuse a resume
whose recipe changed the training, and keep metrics.jsonl consistent after a resume."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from rich.console import Console

from finetune import checkpoint
from finetune.errors import UserError
from finetune.recipe import Recipe, training_keys

RUN_FILES = ("metrics.jsonl", "recipe.yaml", "versions.json", "checkpoints", "final", "tensorboard", "wandb",
             "mlflow.db", "mlartifacts", "mlruns")


def resume_path(recipe: Recipe, out: Path, console: Console) -> Path | None:
    """The checkpoint to resume from: none, the newest complete one (auto), or the one the recipe names."""
    if recipe.resume is None:
        return None
    if recipe.resume == "auto":
        found = checkpoint.find_latest(out, warn=lambda m: console.print(f"[yellow]{m}[/yellow]"))
        console.print(f"resume: auto -> {found or 'no complete checkpoint, starting fresh'}")
        return found
    return Path(recipe.resume)


# How one step's rows are split (micro-batch x accumulation x ranks) does not change the training: only the
# global batch does. So a run may resume on another number of GPUs with the same global batch.
BATCH_SPLIT_KEYS = ("train.micro_batch_size", "train.gradient_accumulation_steps")


# Paths of inputs whose content is in the samples key (data/cache.py): when the content is the same, a moved
# checkout, a copied dataset or another machine's mount point continues the same run.
_CONTENT_KEYED = re.compile(r"^(datasets\.\d+\.path|tokenizer\.path)$")


def check_resume_recipe(recipe: Recipe, state: dict[str, Any], global_batch: int,
                        samples_key: str | None = None) -> None:
    """Refuse a resume whose recipe changes the training, naming each changed key. The split of the global batch
    may change; so may the paths of the data and tokenizer when their content (samples_key) has not."""
    saved, now = state.get("training_keys", {}), training_keys(recipe)
    same_content = samples_key is not None and state.get("samples_key") == samples_key
    changed = [f"  - {k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k) and k not in BATCH_SPLIT_KEYS
               and not (same_content and _CONTENT_KEYED.match(k))]
    if samples_key is not None and state.get("samples_key") not in (None, samples_key):
        changed.append("  - the training data or tokenizer content (files changed, though their paths may not have)")
    if state.get("global_batch", global_batch) != global_batch:
        changed.append(f"  - global batch (micro_batch_size x gradient_accumulation_steps x world size): "
                       f"{state['global_batch']} -> {global_batch}")
    if changed:
        lines = "\n".join(changed)
        raise UserError(f"resume refused: the recipe changed in ways that alter training:\n{lines}\n"
                        "  Restore these keys, or start a new run in another output_dir.")


def check_output_dir(out: Path, *, fresh: bool, overwrite: bool, restart_incomplete: bool = False) -> list[str]:
    """Refuse to start a fresh run over an existing one unless asked; check the directory is writable.

    Returns the earlier run's files that --overwrite will replace. They are removed only after the tokenizer,
    the data and the model have loaded, so a bad input never costs the user the run they already had.
    """
    existing = [name for name in RUN_FILES if (out / name).exists()]
    # resume: auto with no complete checkpoint restarts a run that never finished (killed before its first
    # checkpoint); a finished run (final/ exists) is never replaced without --overwrite.
    if fresh and existing and restart_incomplete and "final" not in existing:
        overwrite = True
    if fresh and existing and not overwrite:
        raise UserError(f"output_dir {out} already holds a run ({', '.join(existing)}). Use resume: auto to "
                        "continue it, another output_dir, or --overwrite to replace it.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output_dir {out} is not writable ({e})") from None
    return existing if fresh and overwrite else []


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics lines up to the resumed step: a killed run may have logged steps that are re-run now."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


def remove_previous_run(out: Path, names: list[str]) -> None:
    for name in names:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def check_disk_room(out: Path, model: Any, checkpointing: bool) -> None:
    """Refuse to start when the disk cannot hold the final model (and a checkpoint, if the recipe writes them).

    A checkpoint holds the trainable weights and two float32 AdamW moments per trainable weight; the final
    model holds every weight (or only the adapter, when one is trained).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    adapter = hasattr(model, "peft_config")
    final_bytes = trainable_bytes if adapter else sum(p.numel() * p.element_size() for p in model.parameters())
    needed = final_bytes + (trainable_bytes + 8 * sum(p.numel() for p in trainable) if checkpointing else 0)
    free = shutil.disk_usage(out).free
    if free < needed * 1.1:  # a margin for tokenizer files, metrics and filesystem overhead
        raise UserError(f"output_dir {out}: {free / 2**30:.2f} GiB free, but the final model"
                        f"{' and a checkpoint' if checkpointing else ''} need about {needed * 1.1 / 2**30:.2f} GiB. "
                        "Free disk space or choose another output_dir.")
