"""Step measurements: model FLOPs utilization, the weights' update ratio, step time and peak memory.

They make a broken run visible in its first steps: an update ratio of 0 means the weights did not move, an
MFU far below the usual says the GPU idles.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is heavy: the functions that need it import it
    import torch


# Dense (no sparsity) peak bf16 tensor-core FLOP/s per GPU, from the vendors' data sheets. Checked in order
# against torch.cuda.get_device_name(); specific variants come before the family name.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2.5e15),
    (r"\bB200\b", 2.25e15),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\b(H100|H800|H200|GH200)\b", 989e12),  # SXM / HBM3 parts
    (r"\b(A100|A800)\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
    (r"\bRTX 6000 Ada\b", 364e12),
    (r"\bA6000\b", 155e12),
    (r"\b4090\b", 165e12),  # GeForce: bf16 with fp32 accumulation
    (r"\b3090\b", 71e12),
    (r"\bMI300X\b", 1307e12),
    (r"\bMI250X?\b", 383e12),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU by its name, None when it is not in the table."""
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops
    return None


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·H·T (PaLM, appendix B).

    6N: every weight does one multiply-add (2 FLOPs) per token in the forward and two in the backward (the
    gradients with respect to the activations and to the weight). 12·L·H·T: attention's QK^T and AV products,
    2·2·H·T FLOPs per token and layer forward, times 3 with the backward. N counts every parameter, frozen
    ones too (the convention; for LoRA, whose frozen weights need no weight gradient, it overstates the
    work by up to a third). T is the sequence length the model attends over (data.max_seq_len).
    """
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def model_depth_width(lm: Any) -> tuple[int | None, int | None]:
    """(layers, hidden size) of the text model, for MFU; None where a config has no such figure (BLT's parts)."""
    text = lm.config.get_text_config()
    return getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)


def mfu(tokens_per_s: float, n_params: int, n_layers: int, hidden: int, seq_len: int,
        device: torch.device) -> float | None:
    """Model FLOPs utilization: achieved FLOP/s (tokens/s x `flops_per_token`) over the GPU's bf16 peak.

    `tokens_per_s` is this GPU's throughput (divide a global figure by the world size). None on a CPU or a GPU
    that is not in PEAK_BF16_FLOPS: a made-up peak would give a made-up utilization.
    """
    if device.type != "cuda" or not math.isfinite(tokens_per_s):
        return None
    import torch

    try:
        name = torch.cuda.get_device_name(device)
    except Exception:  # no driver, bad index: no figure rather than a crash
        return None
    peak = peak_flops(name)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token(n_params, n_layers, hidden, seq_len) / peak



def peak_memory_mb(device: torch.device | None = None) -> float:
    """Peak CUDA memory of `device` when it is a GPU (default: whenever CUDA is available), else the process's
    peak resident set size (a run on the CPU of a CUDA machine, FINETUNE_DEVICE=cpu, is measured on the CPU)."""
    import torch

    on_gpu = torch.cuda.is_available() if device is None else device.type == "cuda"
    if on_gpu:
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux
    except ImportError:  # not on Windows
        return float("nan")


def weight_sample(p: torch.Tensor, size: int = 4096) -> torch.Tensor:
    """A fixed strided view of a weight (this rank's shard under FSDP2), at most ~2 x size elements (all of a
    smaller one): update_ratio compares it before and after the step, because copying every trainable weight
    each step would double their memory in a full fine-tune."""
    flat = (p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
    return flat[:: max(1, flat.numel() // size)]


def update_sums(before: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """[sum of squared changes, sum of squares before] over the weight samples, float64, on the weights' device:
    computed there with foreach norms (float32 per tensor, summed in float64) and never read back here, so the
    caller decides when the host waits for it (the trainer: once per step, with its other figures)."""
    import torch

    if not before:
        return torch.zeros(2, dtype=torch.float64)
    old = [b.float() for b in before]
    changes = torch._foreach_sub([weight_sample(p).float() for p in params], old)
    squares = [torch.stack(torch._foreach_norm(ts)).double().square().sum() for ts in (changes, old)]
    return torch.stack(squares)


def update_ratio(before: list[torch.Tensor], params: list[torch.Tensor],
                 reduce: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
    """||w_after - w_before|| / ||w_before|| over the sampled elements of the trainable weights (0 means the step
    changed none of them), as a float64 0-dim tensor on the weights' device (not read: no host sync). `reduce`
    sums the two sums over ranks where each rank holds a shard (FSDP2)."""
    sums = update_sums(before, params)
    if reduce is not None:
        reduce(sums)
    return sums[0].sqrt() / sums[1].sqrt().clamp_min(1e-12)


class WeightSamples:
    """The weight samples of a run's trainable tensors, for the update ratio at a cost that does not grow with their
    number: the strided views are made once (they share the weights' storage, so they follow every in-place update
    of the optimizer), a step copies them in one op (`take`) and compares them afterwards in about a dozen (`ratio`),
    where a sample per tensor took ~7 ops per tensor each step (a step of a 1B model: ~1,000 ops after its read).
    Under FSDP2 the views of each rank's shard are made afresh each time (the shards are DTensors' local tensors)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = list(params)
        views = [weight_sample(p) for p in self.params]
        # Kept only where each is a view of its weight (not a copy that reshape made of a non-contiguous one).
        self._views = views if all(not hasattr(p, "to_local") and _shares_storage(v, p)
                                   for v, p in zip(views, self.params)) else None

    def _current(self) -> list[torch.Tensor]:
        return self._views if self._views is not None else [weight_sample(p) for p in self.params]

    def take(self) -> torch.Tensor:
        """The samples now, one float32 copy (before the optimizer step)."""
        import torch

        views = self._current()
        return torch.cat(views).to(torch.float32) if views else torch.zeros(0)

    def ratio(self, before: torch.Tensor, reduce: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
        """||w_after - w_before|| / ||w_before|| over the samples, a float64 0-dim tensor on the weights' device (not
        read); `reduce` sums the two sums of squares over ranks where each holds a shard (FSDP2)."""
        import torch

        after = self.take()
        # Both norms in one op (after - before in place: `after` is this call's own copy): about nine ops a step in
        # all, on the device, after the step's read. In float32 as before, then float64: a change below float32's
        # range (lr 1e-30 on a weight of 0) stays a ratio of 0, "did not move".
        norms = torch.linalg.vector_norm(torch.stack([after.sub_(before), before]), dim=1).double()
        if reduce is not None:  # each rank holds a shard: the sums of squares are summed over ranks
            sums = norms.square()
            reduce(sums)
            norms = sums.sqrt()
        return norms[0] / norms[1].clamp_min(1e-12)


def _shares_storage(view: torch.Tensor, p: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()


class Stopwatch:
    """Elapsed seconds since creation, and per-step durations."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def start_lap(self) -> None:
        self.last = time.perf_counter()

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent in the body does not count in the current lap (logging a line inside a step)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.last += time.perf_counter() - began

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

