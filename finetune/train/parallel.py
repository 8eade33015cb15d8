"""Wrap the model for data parallelism per `distributed.strategy`: DDP, or FSDP2 (`fully_shard`).

Both average gradients over ranks, which is why the trainer scales each micro-batch's loss by the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from finetune.dist import World, is_sharded
from finetune.model.loading import DTYPES
from finetune.recipe import Recipe


def wrap_model(module: torch.nn.Module, recipe: Recipe, world: World, device: torch.device) -> torch.nn.Module:
    """The module as the trainer runs it: unchanged in one process, DDP- or FSDP2-wrapped under torchrun."""
    if not world.distributed:
        return module
    if recipe.distributed.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)
    return _fully_shard(module, recipe, device)


def _fully_shard(module: torch.nn.Module, recipe: Recipe, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dtype = DTYPES[recipe.model.dtype]
    # Gradients are reduced in float32 whatever the compute dtype: summation order matters less in fp32.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    kwargs = {"mp_policy": policy}
    if recipe.distributed.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # Each decoder layer is its own shard group (gathered just in time); the rest goes with the root.
    for layer in _decoder_layers(module):
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    return module


def _decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    layers = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) and "DecoderLayer" in type(sub[0]).__name__:
            layers.extend(sub)
    return layers


@contextlib.contextmanager
def gradient_sync(net: torch.nn.Module, last: bool) -> Iterator[None]:
    """Run one micro-batch's forward and backward, reducing its gradients over ranks only when it is the step's
    `last`: the earlier micro-batches accumulate locally and the last one's reduction carries their sum.

    DDP: `no_sync()` on the earlier ones. FSDP2 has no `no_sync`: `set_requires_gradient_sync(False)` keeps each
    layer's unsharded gradient (accumulated in the reduce dtype, float32) instead of reduce-scattering it, at the
    cost of that memory until the last micro-batch. One process: nothing to reduce.
    """
    if last:
        yield
    elif hasattr(net, "no_sync"):
        with net.no_sync():
            yield
    elif hasattr(net, "set_requires_gradient_sync"):
        net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)
    else:
        yield


def gather_full_state(net: torch.nn.Module, lm: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict of `lm` on CPU under FSDP2, else None (save_pretrained reads the model).

    Every rank must call this: gathering the shards is a collective.
    """
    if not is_sharded(lm):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Tied weights (embeddings = output layer) appear under both names; keep the names a plain save_pretrained
    # writes: named_parameters() lists a tied parameter once.
    keep = {n for n, _ in lm.named_parameters()} | {n for n, _ in lm.named_buffers()}
    return {k: v for k, v in full.items() if k in keep}
