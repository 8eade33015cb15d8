"""Weights identified by content: every byte of every tensor (a strided sample would miss a changed weight).

`weights_digest`: a whole model as it will be run, buffers included; DPO's reference cache is keyed by it, and
checkpoints record the objective's reference by it.

`frozen_digest`: what a resume takes from model.path rather than from the checkpoint.

`config_digest`: the model's configuration, without where it was loaded from; with the frozen digest (and the
tokenizer's content, in the samples' cache key) it tells a model moved to another model.path from another model.

A checkpoint holds the trainable parameters only (run/checkpoint.py). Everything frozen, the base of a LoRA or
QLoRA adapter, a frozen vision tower, what train.trainable_parameters leaves out, is loaded again from model.path
when the run resumes. A model replaced at that path in between (a hub id whose newest revision changed, a
re-downloaded or re-converted folder) would silently continue the adapter on other weights; the digest recorded
at the start lets the resume refuse that.

The frozen parameters are hashed a few tensors at once on threads (hashlib lets go of the GIL): sha256 runs at ~1.1
GB/s a core (2.2 GB/s measured on 2 cores), so a 16 GB base takes seconds. Each tensor goes through in slices of
SLICE_BYTES, so that a device's weights are never copied to the host whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

SLICE_BYTES = 64 << 20  # a slice is copied off the device on its own: host memory stays at THREADS slices
THREADS = 4


def frozen_digest(model: torch.nn.Module) -> str | None:
    """sha256 (hex) of the parameters that do not train: their names, shapes, dtypes and bytes, in the model's
    order. None when every parameter trains (a checkpoint then restores them all)."""
    # Plain tensors: a quantized parameter class (bitsandbytes' Params4bit) may treat .to() as a cue to (de)quantize.
    frozen = [(name, p.detach().as_subclass(torch.Tensor)) for name, p in model.named_parameters()
              if not p.requires_grad]
    if not frozen:
        return None
    with ThreadPoolExecutor(max(1, min(THREADS, os.cpu_count() or 1))) as pool:
        hashed = list(pool.map(_tensor_digest, (tensor for _, tensor in frozen)))
    digest = hashlib.sha256()
    for (name, tensor), value in zip(frozen, hashed):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}{value}".encode())
    return digest.hexdigest()


# Where and by what a config was written, not what it says: a moved or re-saved model keeps its digest.
_PROVENANCE = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def config_digest(config: Any) -> str:
    """sha256 (hex) of a transformers config as a dict (sub-configs included), its provenance keys left out."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if k not in _PROVENANCE}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    text = json.dumps(plain(config.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of the weights as they will be run (sha256, hex): every tensor's name, shape, dtype and bytes, in
    the state dict's order. Buffers count too (rotary tables)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor):
            continue
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        _feed(digest, tensor.detach())
    return digest.hexdigest()


def _tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes."""
    digest = hashlib.sha256()
    _feed(digest, tensor)
    return digest.hexdigest()


def _feed(digest: Any, tensor: torch.Tensor) -> None:
    """A tensor's bytes into `digest`, a slice at a time (the value does not depend on the slices)."""
    flat = tensor.reshape(-1)
    step = max(1, SLICE_BYTES // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        digest.update(memoryview(flat[start:start + step].to("cpu").contiguous().view(torch.uint8).numpy()))
