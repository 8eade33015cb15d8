"""Atomic, resumable checkpoints: trainable weights (safetensors), optimizer, scheduler, RNG, data position.

A checkpoint is written into a temporary directory, every file fsynced, a COMPLETE marker written last, and
the directory renamed into place: a crash at any instant leaves the previous checkpoint intact and loadable,
and a half-written one is never mistaken for a checkpoint. Resuming picks a checkpoint (`resume_path`),
refuses one whose recipe changed the training (`check_resume_recipe`), and restores everything (`load`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from finetune import dist
from finetune.errors import UserError
from finetune.recipe import Recipe, default_training_keys, recipe_hash, training_keys
from finetune.run.directory import RunDir

MARKER = "COMPLETE"
PREFIX = "step-"


def checkpoint_root(output_dir: Path) -> Path:
    return RunDir(output_dir).checkpoints


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (tied parameters appear once), as contiguous CPU tensors."""
    return {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(output_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoints/step-N atomically and prune all but the newest `keep_last`. Returns its path.

    Every rank calls this. Unsharded (one process, DDP): rank 0 writes the weights as safetensors. Sharded
    (FSDP2): every rank writes its shards through torch.distributed.checkpoint, which can be loaded back with
    another world size. Either way rank 0 writes the marker last and renames the directory into place.
    """
    root = checkpoint_root(output_dir)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}"
    main = dist.from_env().is_main
    error: OSError | None = None
    if main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            error = e
    dist.barrier()
    try:
        if error is not None:
            raise error
        if dist.is_sharded(model):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))
        elif main:
            save_file(trainable_state(model), str(tmp / "model.safetensors"))
            torch.save({"optimizer": optimizer.state_dict()}, tmp / "optimizer.pt")
        if main:
            torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state()}, tmp / "state.pt")
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            for file in tmp.rglob("*"):
                if file.is_file():
                    _fsync(file)
    except OSError as e:
        error = error or e
    dist.barrier()
    if main:
        if error is None:
            try:
                (tmp / MARKER).write_text(str(step))
                _fsync(tmp / MARKER)
                if final.exists():  # a rerun of the same step: replace it, never leave two
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(root)
            except OSError as e:
                error = e
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"writing checkpoint {final} failed ({error}); the previous checkpoints are intact. "
                            "Free disk space or fix permissions, then resume with resume: auto") from None
        _prune(root, keep_last)
    dist.barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(complete_checkpoints(root), key=_step_of)
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories that finished writing (have the marker), any order."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir()
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and (p / MARKER).exists()]


def find_latest(output_dir: Path, warn: Any = print) -> Path | None:
    """The newest checkpoint that is complete and readable; broken ones are skipped with a message."""
    for path in sorted(complete_checkpoints(checkpoint_root(output_dir)), key=_step_of, reverse=True):
        problem = _verify(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}")
    return None


def _verify(path: Path) -> str | None:
    try:
        json.loads((path / "trainer_state.json").read_text())
        if (path / "dcp").is_dir():
            if not (path / "dcp" / ".metadata").is_file():
                return "dcp/.metadata is missing"
        else:
            load_file(str(path / "model.safetensors"))
            if not (path / "optimizer.pt").is_file():
                return "optimizer.pt is missing"
        if not (path / "state.pt").is_file():
            return "state.pt is missing"
    except Exception as e:  # any failure to read means this checkpoint cannot be resumed
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns its trainer_state."""
    problem = _verify(path)
    if problem:
        raise UserError(f"resume: checkpoint {path} cannot be used: {problem}")
    if (path / "dcp").is_dir() != dist.is_sharded(model):
        kind = "sharded (fsdp)" if (path / "dcp").is_dir() else "unsharded (single process / ddp)"
        raise UserError(f"resume: checkpoint {path} is {kind}; resume it with the same distributed.strategy")
    if dist.is_sharded(model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        _load_unsharded(path, model, optimizer)
    # weights_only: a checkpoint is data; loading it must not be able to run code.
    state = torch.load(path / "state.pt", weights_only=True)
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return json.loads((path / "trainer_state.json").read_text())


def _load_unsharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in tensors]
    if missing:
        raise UserError(f"resume: checkpoint {path} lacks {len(missing)} trainable tensors (e.g. {missing[0]}); "
                        "it belongs to a different model or adapter")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True)["optimizer"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories; rename is still atomic
        _fsync(path)


# --- what a checkpoint records about the run, and resuming from it -------------------------------------------

def trainer_state(recipe: Recipe, *, step: int, epoch: int, samples_key: str | None, global_batch: int,
                  world_size: int, tokens_seen: int, samples_seen: int) -> dict[str, Any]:
    """trainer_state.json: where the run stands, and what it was, so a resume can refuse a different training."""
    return {"step": step, "epoch": epoch, "recipe_hash": recipe_hash(recipe), "training_keys": training_keys(recipe),
            "samples_key": samples_key, "global_batch": global_batch, "world_size": world_size,
            "tokens_seen": tokens_seen, "samples_seen": samples_seen}


def resume_path(recipe: Recipe, out: Path, warn: Callable[[str], Any]) -> Path | None:
    """The checkpoint to resume from: none, the newest complete one (auto), or the one the recipe names.
    `warn` shows what the user should know (a skipped broken checkpoint, what auto chose)."""
    if recipe.resume is None:
        return None
    if recipe.resume == "auto":
        found = find_latest(out, warn=warn)
        warn(f"resume: auto -> {found or 'no complete checkpoint, starting fresh'}")
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
    # A key the checkpoint's finetune did not have yet counts as its default (it could not have been set).
    saved, now = dict(state.get("training_keys", {})), training_keys(recipe)
    defaults = default_training_keys()
    saved.update({k: defaults[k] for k in now if k not in saved and k in defaults})
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
