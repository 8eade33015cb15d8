"""Atomic, resumable checkpoints: trainable weights (safetensors), optimizer, scheduler, RNG, data position.

A checkpoint is written into a temporary directory, every file fsynced, a COMPLETE marker and then a manifest
(every file's size and sha256, run/manifest.py) written last, and the directory renamed into place: a crash at
any instant leaves the previous checkpoint intact, and a half-written or damaged one is never mistaken for a
checkpoint. Resuming picks a checkpoint that verifies (`resume_path`), refuses one whose recipe changed the
training (`check_resume_recipe`), and restores everything (`load`).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from finetune import dist
from finetune.errors import UserError, first_line
from finetune.recipe import Recipe, default_training_keys, recipe_hash, training_keys
from finetune.run import atomic, manifest
from finetune.run.directory import RunDir

MARKER = "COMPLETE"
PREFIX = "step-"
ROLLOUTS = "rollouts.json"  # GRPO: the batch a checkpoint inside its iterations is in (RolloutPlan.resume_state)


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
         scheduler: Any, trainer_state: dict[str, Any], keep_last: int, rollouts: dict[str, Any] | None = None
         ) -> Path:
    """Write checkpoints/step-N atomically and prune all but the newest `keep_last`. Returns its path.

    Every rank calls this. Unsharded (one process, DDP): rank 0 writes the weights as safetensors. Sharded
    (FSDP2): every rank writes its shards through torch.distributed.checkpoint, which can be loaded back with
    another world size. Either way rank 0 writes the marker and the manifest last and renames the directory into
    place. A failure on any rank, of any exception type, removes the temporary directory on rank 0 and ends every
    rank with one UserError naming the path and the free space. `rollouts` (GRPO inside a batch's iterations) is
    written as rollouts.json beside trainer_state.json.
    """
    root = checkpoint_root(output_dir)
    target = root / f"{PREFIX}{step}"
    tmp = atomic.temporary(target)
    main = dist.from_env().is_main
    error: Exception | None = None
    try:
        if main:
            error = _attempt(atomic.make_temporary, tmp)
        if not dist.any_rank(error is not None):
            error = _attempt(_write_state, tmp, model, optimizer, scheduler, trainer_state, main, rollouts)
        failed = dist.any_rank(error is not None)
        if main and not failed:
            error = _attempt(_commit, tmp, target, step)
            failed = error is not None
    except BaseException:  # interrupted mid-write: no debris; the interrupt goes on
        if main:
            atomic.discard(tmp)
        raise
    if failed:
        if main:
            atomic.discard(tmp)
        raise atomic.failure(target, error, f"the previous checkpoints are intact and the unfinished {tmp.name} "
                             "was removed. Free disk space or fix permissions, then resume with resume: auto")
    if main:
        _prune(root, keep_last, step)
    dist.barrier()
    return target


def _attempt(fn: Callable[..., Any], *args: Any) -> Exception | None:
    """Run fn(*args); the exception it raised, or None. Any type: safetensors and torch do not raise OSError."""
    try:
        fn(*args)
    except Exception as e:
        return e
    return None


def _write_state(tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 trainer_state: dict[str, Any], main: bool, rollouts: dict[str, Any] | None = None) -> None:
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
        if rollouts is not None:  # JSON: Python's float repr reads back to the same double
            (tmp / ROLLOUTS).write_text(json.dumps(rollouts))


def _commit(tmp: Path, target: Path, step: int) -> None:
    """The marker, then the manifest of everything (marker included), then the rename."""
    (tmp / MARKER).write_text(json.dumps({"step": step, "manifest": manifest.MANIFEST}))
    atomic.fsync_tree(tmp)
    manifest.write(tmp)
    atomic.commit(tmp, target)


def _prune(root: Path, keep_last: int, step: int) -> None:
    """Keep the newest `keep_last` checkpoints up to `step`. A newer one is left from a run that went further
    and was resumed from an older checkpoint (the newer one failed its check): this run rewrites it when it gets
    there, and it must not count among the kept, or the checkpoint just written could be pruned."""
    upto = sorted((p for p in complete_checkpoints(root) if _step_of(p) <= step), key=_step_of)
    for old in upto[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories that finished writing (have the marker), any order."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir()
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and (p / MARKER).exists()]


def find_latest(output_dir: Path, warn: Any = print, deep: bool = True) -> Path | None:
    """The newest checkpoint that passes `verify`; each one that fails is named in one line and skipped."""
    for path in sorted(complete_checkpoints(checkpoint_root(output_dir)), key=_step_of, reverse=True):
        problem = verify(path, deep)
        if problem is None:
            _note_legacy(path, warn)
            return path
        warn(f"skipping checkpoint {path}: {problem}")
    return None


def verify(path: Path, deep: bool = True) -> str | None:
    """None when the checkpoint can be resumed, else what is wrong with it, in words.

    With a manifest: every file's size and (deep) sha256. Without one (written before finetune wrote manifests):
    every file loaded (deep), which catches a truncated or garbled file but not a changed byte inside a tensor.
    Not deep: the sizes and which files are there, for a quick look (the CLI's check before torchrun).
    """
    if not path.is_dir():
        return "not a directory"
    if not (path / MARKER).is_file():
        return f"{MARKER} is missing: not a checkpoint, or one whose write did not finish"
    if (path / manifest.MANIFEST).exists() or _promises_manifest(path):
        return manifest.check(path, deep) or _layout_problem(path)
    return _load_everything(path) if deep else _layout_problem(path)


def _promises_manifest(path: Path) -> bool:
    """Whether the marker says a manifest was written (a checkpoint from before manifests has the step only)."""
    try:
        return "manifest" in json.loads((path / MARKER).read_text())
    except (OSError, ValueError, TypeError):
        return False


def _layout_problem(path: Path) -> str | None:
    sharded = (path / "dcp").is_dir()
    needed = ["trainer_state.json", "state.pt", *(["dcp/.metadata"] if sharded else ["model.safetensors",
                                                                                      "optimizer.pt"])]
    missing = [name for name in needed if not (path / name).is_file()]
    return f"{missing[0]} is missing" if missing else None


def _load_everything(path: Path) -> str | None:
    problem = _layout_problem(path)
    if problem:
        return problem
    try:
        json.loads((path / "trainer_state.json").read_text())
        if not (path / "dcp").is_dir():
            load_file(str(path / "model.safetensors"))
            torch.load(path / "optimizer.pt", weights_only=True)
        torch.load(path / "state.pt", weights_only=True)
    except Exception as e:  # any failure to read means this checkpoint cannot be resumed
        return f"unreadable ({type(e).__name__}: {first_line(e)})"
    return None


def _note_legacy(path: Path, warn: Callable[[str], Any]) -> None:
    if not (path / manifest.MANIFEST).exists():
        warn(f"checkpoint {path} has no {manifest.MANIFEST} (written by an older finetune): checked by loading "
             "its files, which cannot see a changed byte inside a tensor")


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns its trainer_state.

    The content was verified by `resume_path` (on rank 0); here only its layout is checked again."""
    problem = verify(path, deep=False)
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


def rollout_state(path: Path) -> dict[str, Any] | None:
    """The GRPO batch a checkpoint recorded (`save`'s `rollouts`), or None when it recorded none."""
    file = path / ROLLOUTS
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:  # verified by its manifest; this is for a file changed since
        raise UserError(f"resume: checkpoint {path}: {ROLLOUTS} is unreadable ({first_line(e)}); resume another "
                        "checkpoint") from None


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


# --- what a checkpoint records about the run, and resuming from it -------------------------------------------

def trainer_state(recipe: Recipe, *, step: int, epoch: int, samples_key: str | None, global_batch: int,
                  world_size: int, tokens_seen: int, samples_seen: int, reference: str | None = None,
                  images_key: str | None = None, frozen: str | None = None,
                  config: str | None = None, early_stopping: dict[str, Any] | None = None) -> dict[str, Any]:
    """trainer_state.json: where the run stands, and what it was, so a resume can refuse a different training.
    `reference`: the digest of the objective's reference model (grpo.reference, dpo.reference), which a resume
    loads again; `images_key`: the training images' bytes (data/cache.py images_key); `frozen`: the digest of the
    frozen weights, which a resume loads from model.path again, and `config` that of the model's config
    (model/digest.py); `early_stopping`: the evals' best loss and count (train/early_stop.py)."""
    return {"step": step, "epoch": epoch, "recipe_hash": recipe_hash(recipe), "training_keys": training_keys(recipe),
            "samples_key": samples_key, "global_batch": global_batch, "world_size": world_size,
            "tokens_seen": tokens_seen, "samples_seen": samples_seen, "reference_digest": reference,
            **({"images_key": images_key} if images_key else {}), **({"frozen_digest": frozen} if frozen else {}),
            **({"config_digest": config} if config else {}),
            **({"early_stopping": early_stopping} if early_stopping else {})}


def resume_path(recipe: Recipe, out: Path, warn: Callable[[str], Any], deep: bool = True) -> Path | None:
    """The checkpoint to resume from: none, the newest one that verifies (auto; None when none does), or the one
    the recipe names (a UserError when it does not verify). `warn` shows what the user should know (a skipped
    checkpoint, what auto chose). `deep=False` checks sizes only (the CLI's quick look before torchrun)."""
    if recipe.resume is None:
        return None
    if recipe.resume == "auto":
        found = find_latest(out, warn=warn, deep=deep)
        if found is not None:
            warn(f"resume: auto -> {found}")
        return found
    path = Path(recipe.resume)
    problem = verify(path, deep)
    if problem:
        raise UserError(f"resume: checkpoint {path} cannot be used: {problem}")
    _note_legacy(path, warn)
    return path


# How one step's rows are split (micro-batch x accumulation x ranks) does not change the training: only the
# global batch does. So a run may resume on another number of GPUs with the same global batch.
BATCH_SPLIT_KEYS = ("train.micro_batch_size", "train.gradient_accumulation_steps")

# Paths of inputs whose content is in the samples key (data/cache.py; GRPO's: rl/sources.py): when the content is
# the same, a moved checkout, a copied dataset or another machine's mount point continues the same run.
_CONTENT_KEYED = re.compile(r"^(datasets\.\d+\.path|tokenizer\.path|grpo\.replay)$")


def _same_model(recipe: Recipe, state: dict[str, Any], same_content: bool, frozen: str | None,
                config: str | None) -> bool:
    """Whether everything a resume takes from model.path is what the run started from, wherever it lies now: the
    config, the frozen weights (none for full fine-tuning: the checkpoint holds them all), and the tokenizer when it
    comes from there (its content is in the samples' key). Never with code shipped with the model
    (trust_remote_code), which no digest covers."""
    return (config is not None and state.get("config_digest") == config and state.get("frozen_digest") == frozen
            and (recipe.tokenizer.path is not None or same_content) and not recipe.model.trust_remote_code)


def check_resume_recipe(recipe: Recipe, state: dict[str, Any], global_batch: int,
                        samples_key: str | None = None, reference: str | None = None,
                        images_key: str | None = None, frozen: str | None = None,
                        config: str | None = None) -> None:
    """Refuse a resume whose recipe changes the training, naming each changed key. The split of the global batch
    may change; so may the paths of the data and tokenizer when their content (samples_key) has not, the path
    of the objective's reference (grpo.reference, dpo.reference) when its weights (`reference`, their digest)
    have not, and model.path when what the resume takes from it has not (_same_model). The weights a resume loads
    from model.path again (`frozen`; the reference when it is auto) must be those the run started from."""
    ref_key = f"{recipe.train.objective}.reference"
    # A key the checkpoint's finetune did not have yet counts as its default (it could not have been set).
    saved, now = dict(state.get("training_keys", {})), training_keys(recipe)
    defaults = default_training_keys()
    saved.update({k: defaults[k] for k in now if k not in saved and k in defaults})
    same_content = samples_key is not None and state.get("samples_key") == samples_key
    same_reference = reference is not None and state.get("reference_digest") == reference
    same_model = _same_model(recipe, state, same_content, frozen, config)
    changed = [f"  - {k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k) and k not in BATCH_SPLIT_KEYS
               and not (same_content and _CONTENT_KEYED.match(k)) and not (same_reference and k == ref_key)
               and not (same_model and k == "model.path")]
    if samples_key is not None and state.get("samples_key") not in (None, samples_key):
        changed.append("  - the training data or tokenizer content (files changed, though their paths may not have)")
    if images_key is not None and state.get("images_key") not in (None, images_key):
        changed.append("  - the training images' bytes (image files changed, though their paths did not; put the "
                       "originals back)")
    if reference is not None and state.get("reference_digest") not in (None, reference):
        where = (f"model.path {recipe.model.path} ({ref_key}: auto)" if now.get(ref_key) == "auto"
                 else f"{ref_key} {now.get(ref_key)}")
        changed.append(f"  - the weights of the reference model at {where}: sha256 "
                       f"{state['reference_digest'][:16]}... when the run started, {reference[:16]}... now (the model "
                       "there changed; put the original back)")
    if frozen is not None and state.get("frozen_digest") not in (None, frozen):
        changed.append(f"  - the frozen weights loaded from model.path {recipe.model.path} (an adapter's base, or "
                       f"parameters that do not train): sha256 {state['frozen_digest'][:16]}... when the run started, "
                       f"{frozen[:16]}... now (the model there changed; put the original back)")
    if state.get("global_batch", global_batch) != global_batch:
        changed.append(f"  - global batch (micro_batch_size x gradient_accumulation_steps x world size): "
                       f"{state['global_batch']} -> {global_batch}")
    if changed:
        lines = "\n".join(changed)
        raise UserError(f"resume refused: the recipe changed in ways that alter training:\n{lines}\n"
                        "  Restore these keys, or start a new run in another output_dir.")
