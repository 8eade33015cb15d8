"""Rank and world facts from torchrun's environment, and the few collectives the trainer needs.

Everything is a no-op in a single process, so the trainer reads the same with and without torchrun.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from finetune.errors import UserError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def from_env() -> World:
    """The world as torchrun describes it (RANK, WORLD_SIZE, LOCAL_RANK); one process otherwise."""
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


# Where ranks compute: auto (a GPU per rank when CUDA is there, else the CPU), cpu or cuda. `cpu` runs every rank
# on the CPU with gloo on a CUDA machine too (tests, debugging, more ranks than GPUs); `finetune train` and
# torchrun workers read it from the environment.
DEVICE_ENV = "FINETUNE_DEVICE"
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def device_setting() -> str:
    """FINETUNE_DEVICE, lower-cased; unset or empty is auto. Anything else is a UserError naming the choices."""
    value = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    if value not in DEVICE_CHOICES:
        raise UserError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r}: choose one of {', '.join(DEVICE_CHOICES)} "
                        "(auto: a GPU per rank when CUDA is available, else the CPU)")
    return value


def choose_device(world: World, setting: str | None = None, cuda_count: int | None = None) -> torch.device:
    """This rank's device under FINETUNE_DEVICE (`setting` and `cuda_count` default to the environment's).

    auto and cuda give rank LOCAL_RANK the GPU of that index, so a machine needs one GPU per rank: two ranks on
    one GPU would both need it under NCCL, which refuses that. Such a start is a UserError that says what to do.
    """
    setting = device_setting() if setting is None else setting
    count = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_count is None else cuda_count
    if setting == "cpu" or (setting == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        raise UserError(f"{DEVICE_ENV}=cuda, but torch sees no CUDA device (torch {torch.__version__}, built for "
                        f"CUDA {torch.version.cuda}); unset it to run on the CPU")
    if world.local_rank >= count:
        raise UserError(f"local rank {world.local_rank} needs GPU {world.local_rank}, but this machine has {count} "
                        f"visible: start at most {count} process(es) per machine (torchrun --nproc_per_node / "
                        f"--nproc), or set {DEVICE_ENV}=cpu to run every rank on the CPU with gloo")
    return torch.device("cuda", world.local_rank)


def default_device() -> torch.device:
    """The device of a command that runs in one process (verify, generate): choose_device of this process."""
    return choose_device(from_env())


def init(world: World, timeout_s: float = 600.0) -> torch.device:
    """Start the process group (nccl on CUDA, gloo on the CPU) and return this rank's device (choose_device)."""
    device = choose_device(world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world.distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=max(timeout_s, WAIT_FOR_MAIN_S)),
                                device_id=device if device.type == "cuda" else None)
    return device


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum across ranks, in place; returns the tensor."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (picklable objects: RL rollouts)."""
    gathered: list[list] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (a collective: every rank calls it); `flag` itself in one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    return bool(all_reduce_sum(torch.tensor([float(flag)], device=device)).item() > 0)


def from_main(value: Any) -> Any:
    """Rank 0's `value` on every rank (a collective; picklable values): what rank 0 alone decided, e.g. the
    checkpoint to resume from after verifying it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_sharded(model: torch.nn.Module) -> bool:
    """True under FSDP2: the parameters are DTensor shards (gathering or saving them is a collective)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


# How long ranks wait for rank 0's one-time work (tokenizing a large dataset); generous on purpose.
WAIT_FOR_MAIN_S = float(os.environ.get("FINETUNE_DIST_WAIT_S", 3 * 3600))


def wait_for_main(what: str) -> None:
    """A barrier with a long timeout, for work rank 0 does alone while the others wait (rank 0 calls it too).

    A rank that waits too long fails with a message that says what it was waiting for, not a bare timeout.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    work = dist.monitored_barrier if dist.get_backend() == "gloo" else None
    try:
        if work is not None:
            work(timeout=timedelta(seconds=WAIT_FOR_MAIN_S))
        else:
            dist.barrier()  # nccl: bounded by the process group's timeout, set from WAIT_FOR_MAIN_S at init
    except RuntimeError as e:
        raise UserError(f"rank {dist.get_rank()} gave up waiting for {what} after {WAIT_FOR_MAIN_S:.0f} s "
                        f"({e}); set FINETUNE_DIST_WAIT_S to wait longer, or run `finetune preprocess` first") from None


@contextlib.contextmanager
def main_first(world: World, what: str) -> Iterator[None]:
    """Rank 0 runs the body first while the other ranks wait, then they run it (e.g. rank 0 tokenizes and fills
    the data cache, the others read it). No barrier after rank 0 fails in the body: it exits, and the waiting
    ranks are stopped by torchrun rather than left to wait for a rank that is gone."""
    if not world.is_main:
        wait_for_main(what)
    yield
    if world.is_main:
        wait_for_main(what)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def process_group(world: World) -> Iterator[torch.device]:
    """init(world) for the body, then shutdown: clean after success, without the barrier after a failure."""
    device = init(world)
    try:
        yield device
    except BaseException:
        shutdown(failed=True)
        raise
    shutdown()


def shutdown(failed: bool = False) -> None:
    """Barrier, then destroy the group: destroying without the barrier is flaky under gloo.

    After a failure (`failed`), neither: the other ranks may be waiting in a collective this rank will never
    join (rank 0 failing while the others wait for its preprocessing), so a barrier here would hang every rank.
    This rank exits instead, with its message, and torchrun stops the others.
    """
    if dist.is_initialized() and not failed:
        # FSDP2's modules sit in reference cycles, so dropping the last name leaves them, with their mesh and
        # collective work, to a later collection, perhaps at interpreter exit after the group is gone, where a gloo
        # thread releasing a tensor aborted a rank ("terminate called without an active exception", seen in CI).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
