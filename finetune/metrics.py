"""Per-step metrics records and their sinks (console, metrics.jsonl, TensorBoard), and run directory files.

A record is computed once per optimizer step by the trainer and fanned out to every sink. A sink that fails
warns once and is dropped: training never dies from a tracker.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl: one JSON object per line, flushed each write so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        self.handle = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record, allow_nan=True) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class ConsoleSink:
    """A progress bar (step/total, loss, lr, tokens/s, time left) on a terminal; plain lines otherwise.

    Lines come every `every` steps; a line's loss is the token-weighted mean of the steps since the last line,
    and it says so (`loss(avg N)`), so no window average is ever shown as a single step's value.
    """

    def __init__(self, console: Console, total_steps: int, every: int, start_step: int = 0) -> None:
        self.console, self.every, self.total = console, every, total_steps
        self.window: list[dict[str, Any]] = []
        self.progress = None
        if console.is_terminal:
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def write(self, record: dict[str, Any]) -> None:
        if "eval_loss" in record:
            self.console.print(f"eval  step {record['step']:>5}  eval_loss {record['eval_loss']:.4f}  "
                               f"({record['eval_tokens']} tokens)")
            return
        self.window.append(record)
        if self.progress is not None:
            info = f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s"
            self.progress.update(self.task, completed=record["step"], info=info)
        if record["step"] % self.every == 0 or record["step"] == self.total:
            self.console.print(format_window(self.window))
            self.window = []

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def format_window(records: list[dict[str, Any]]) -> str:
    """One console line for the steps since the last line, loss token-weighted over them."""
    last = records[-1]
    tokens = sum(r["tokens"] for r in records)
    loss = sum(r["loss"] * r["tokens"] for r in records) / tokens if tokens else float("nan")
    label = "loss" if len(records) == 1 else f"loss(avg {len(records)})"
    return (f"step {last['step']:>5}/{last.get('total_steps', '?')}  {label} {loss:.4f}  "
            f"grad_norm {last['grad_norm']:.3f}  lr {last['lr']:.2e}  {last['tokens_per_s']:.0f} tok/s  "
            f"upd {last.get('update_ratio', float('nan')):.1e}")


class TensorBoardSink:
    """TensorBoard events under output_dir/tensorboard (needs the `tensorboard` package)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency

        self.writer = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        prefix = "eval" if "eval_loss" in record else "train"
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricsLogger:
    """Fans each record out to the sinks; a sink that raises is reported once and dropped."""

    def __init__(self, sinks: list[Sink], console: Console) -> None:
        self.sinks, self.console = list(sinks), console

    def log(self, record: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as e:  # a tracker must never end a training run
                self.console.print(f"[yellow]warning: metrics sink {type(sink).__name__} failed ({e}); "
                                   "it is dropped for the rest of the run[/yellow]")
                self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks:
            with contextlib.suppress(Exception):  # closing a broken tracker is best effort
                sink.close()


def open_sinks(output_dir: Path, logging_cfg: Any, console: Console, total_steps: int,
               start_step: int) -> MetricsLogger:
    """The sinks a recipe asks for. Optional trackers that cannot start warn and are left out."""
    sinks: list[Sink] = [JsonlSink(output_dir / "metrics.jsonl"),
                         ConsoleSink(console, total_steps, logging_cfg.every_steps, start_step)]
    if logging_cfg.tensorboard:
        try:
            sinks.append(TensorBoardSink(output_dir / "tensorboard"))
        except ImportError:
            console.print("[yellow]warning: logging.tensorboard needs tensorboard: "
                          "pip install 'finetune[tracking]'; continuing without it[/yellow]")
    return MetricsLogger(sinks, console)


def peak_memory_mb() -> float:
    """Peak CUDA memory when on a GPU, else the process's peak resident set size."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux
    except ImportError:  # not on Windows
        return float("nan")


class Stopwatch:
    """Elapsed seconds since creation, and per-step durations."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def finite(x: float) -> bool:
    return math.isfinite(x)
