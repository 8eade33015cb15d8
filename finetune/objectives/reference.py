"""The reference model's log-probabilities of every preference pair, computed once before training and cached.

DPO compares the policy with a fixed reference. Its summed log-probabilities of each pair's chosen and rejected
completion are constants of the run: computed in one no-grad pass before the first step (or read from the
cache), they are independent of the batch split, of packing and of the number of ranks, which keeps the loss
exact, and no second model stays in memory while training. The reference (dpo.reference):

* auto without an adapter: the model as loaded, before any step (on a resume, loaded again);
* auto with LoRA/QLoRA: the same model with its adapter switched off (its base);
* a model path: that model, loaded for the pass and freed after it.

Cached under <data cache root>/reference/<key>.npz, keyed by the samples' identity, the reference's weights (a
digest of every byte of every tensor, taken from the reference as loaded: not its path), the numerics (dtype, attention, loss implementation) and the library versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune import dist
from finetune.data import collate, rank_micro_batches
from finetune.data.cache import cache_root
from finetune.model.digest import weights_digest
from finetune.model.loading import load_model
from finetune.model.with_loss import CausalLMWithLoss
from finetune.objectives.pairs import pair_logps
from finetune.progress import Phase
from finetune.recipe import AdapterConfig, Recipe

REFERENCE_VERSION = 2  # bump when what is computed here changes


def attach_reference_logps(recipe: Recipe, splits: dict[str, list[dict]], lm: torch.nn.Module, tokenizer: Any,
                           impl: str, device: torch.device, *, samples_key: str | None, fresh_model: bool,
                           say: Any = print) -> str | None:
    """Give every pair sample of every split its reference log-probabilities (sample["ref_logps"]); returns the
    digest of the reference's weights (None for auto with an adapter, or without a data cache), which checkpoints
    record: a resume loads it again, from dpo.reference's path or, for auto without an adapter, from model.path.

    `lm` is the policy as loaded; `fresh_model` says it has not trained yet (False on a resume, where the
    reference for auto without an adapter is loaded again). The reference is loaded (or switched on) first: the
    cache is keyed by its weights as loaded, so a model replaced at dpo.reference's path is never mistaken for
    the one that was cached, and a resume against it is refused (run/checkpoint.py check_resume_recipe)."""
    with _reference(recipe, lm, tokenizer, device, fresh_model) as ref:
        base = ref.get_base_model() if hasattr(ref, "get_base_model") else ref
        digest = weights_digest(base) if samples_key is not None or recipe.dpo.reference != "auto" else None
        key = _cache_key(recipe, samples_key, digest)
        file = cache_root(recipe) / "reference" / f"{key}.npz" if key else None
        cached = _read(file, splits)
        if cached is not None:
            say(f"reference log-probabilities reused from {file}")
        else:
            net = CausalLMWithLoss.for_recipe(ref, recipe.loss, impl).eval()
            cached = {name: _compute(net, samples, recipe, tokenizer.pad_token_id, device)
                      for name, samples in splits.items()}
            if file is not None and dist.from_env().is_main:
                _write(file, cached)
            say(f"reference log-probabilities computed for {sum(len(v) for v in cached.values())} pairs"
                + (f"; cached at {file}" if file else ""))
    for name, samples in splits.items():
        for sample, ref_logps in zip(samples, cached[name].tolist()):
            sample["ref_logps"] = ref_logps
    # auto with an adapter is the policy's frozen base, which checkpoints record anyway (model/digest.py).
    return None if _adapter_off(recipe, lm) else digest


def _adapter_off(recipe: Recipe, lm: torch.nn.Module) -> bool:
    """Whether the reference is the policy with its adapter switched off (dpo.reference auto, LoRA/QLoRA)."""
    return recipe.dpo.reference == "auto" and hasattr(lm, "disable_adapter")


@contextlib.contextmanager
def _reference(recipe: Recipe, lm: torch.nn.Module, tokenizer: Any, device: torch.device,
               fresh_model: bool) -> Iterator[torch.nn.Module]:
    path = recipe.dpo.reference
    if _adapter_off(recipe, lm):
        with lm.disable_adapter():
            yield lm
    elif path == "auto" and fresh_model:
        yield lm
    else:
        cfg = recipe.model if path == "auto" else recipe.model.model_copy(
            update={"path": path, "init": "pretrained", "gguf_file": None, "config_overrides": {}})
        key = "model.path" if path == "auto" else "dpo.reference"  # which key a bad file's message names
        # device: liger_kernels need it
        ref = load_model(cfg, AdapterConfig(), tokenizer, recipe.seed, device, key=key).to(device)
        try:
            yield ref
        finally:
            del ref


def _compute(net: CausalLMWithLoss, samples: list[dict], recipe: Recipe, pad_id: int,
             device: torch.device) -> np.ndarray:
    """[n, 2] float64: each pair's summed log-probability of its chosen and rejected completion, dealt to ranks
    like an eval and summed back (each rank fills its own rows)."""
    world = dist.from_env()
    out = torch.zeros(len(samples), 2, dtype=torch.float64, device=device)
    data = recipe.data.model_copy(update={"packing": False})  # one layout for every recipe: pairs, padded
    tagged = [{**s, "index": i} for i, s in enumerate(samples)]
    micro = recipe.eval.micro_batch_size or recipe.train.micro_batch_size
    training = net.training
    net.eval()
    # Minutes on a CPU before the first step: said with a rate and the time left (this rank's share).
    mine = -(-len(samples) // world.size)
    with torch.no_grad(), Phase("reference log-probabilities (once, before training)", mine, "pairs") as phase:
        for rows in rank_micro_batches(tagged, micro, world.size, world.rank):
            batch = collate(rows, data, pad_id)
            p = pair_logps(net, batch, device)
            if batch.pairs.count:
                index = torch.tensor([r["index"] for r in rows], device=device)
                out[index] = torch.stack([p.chosen, p.rejected], dim=1).double()
            phase.advance(len(rows))
    net.train(training)
    return dist.all_reduce_sum(out).cpu().numpy()


def _cache_key(recipe: Recipe, samples_key: str | None, digest: str | None) -> str | None:
    """None when the samples have no identity (the data cache was not usable): then nothing is cached. `digest`
    is that of the reference's weights as it will run (the base of an adapter model: its adapter is off)."""
    if samples_key is None:
        return None
    import transformers

    inputs = {"version": REFERENCE_VERSION, "samples": samples_key, "reference": digest,
              "model": recipe.model.model_dump(mode="json"), "adapter_off": recipe.adapter.type,
              "loss": recipe.loss.model_dump(mode="json"), "torch": torch.__version__,
              "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def _read(file: Path | None, splits: dict[str, list[dict]]) -> dict[str, np.ndarray] | None:
    if file is None or not file.is_file():
        return None
    try:
        with np.load(file, allow_pickle=False) as data:
            out = {name: data[name] for name in splits}
    except (OSError, ValueError, KeyError):
        return None  # unreadable or another layout: computed again
    fits = all(out[name].shape == (len(samples), 2) for name, samples in splits.items())
    return out if fits else None


def _write(file: Path, arrays: dict[str, np.ndarray]) -> None:
    """Atomically (a temporary file renamed into place); a cache that cannot be written is skipped."""
    tmp = None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=file.parent)
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, file)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
