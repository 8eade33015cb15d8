"""The process's memory as Linux reports it, for the CPU memory benchmarks (loss_memory, distill_memory,
context_parallel_memory): imported by them as a sibling module (a script's folder is on sys.path)."""

from __future__ import annotations


def status_kib(field: str) -> int:
    """A kB field of /proc/self/status: VmRSS (resident now), VmHWM (the resident peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")
