"""Phase: a named stretch of work that can take more than a few seconds, and what it says while it runs.

A phase over in less than `DELAY_S` says nothing. A longer one says what it is doing once it has taken that long,
then, every `every` seconds while it runs, how far it is: items done of
the total with a rate and an estimate of the time left when the caller counts them (`advance`), the seconds so far
when it cannot (work inside a library: GGUF conversion). A watcher thread wakes it, so a phase the caller cannot count
still speaks. On a terminal the line is rewritten in place; off one (a pipe, a cloud job's log) each update is its
own line, so a log reads as one line per update. Under torchrun only rank 0 speaks.

Libraries' own tqdm bars write carriage returns that become one 10 KB line in a log: off a terminal they are turned
off through huggingface_hub's own switch, which transformers reads too (log_friendly_libraries).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

DELAY_S = 2.0  # a phase quicker than this is not worth a line
EVERY_S = 30.0  # off a terminal: a line every half minute, as training tools' logs do
TERMINAL_EVERY_S = 1.0


def on_terminal(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


class _Without(logging.Filter):
    """Drops a logger's records whose message contains all of one of `patterns`' parts."""

    def __init__(self, *patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(all(part in message for part in parts) for parts in self.patterns)


def _quiet_torchao_import() -> None:
    """transformers imports torchao whenever it is installed (the qat extra: its quantizer module does, with
    transformers' modeling code), and that import logs a warning for each of torchao's CUDA extensions a CPU (or
    another torch's) build cannot load, and torch one for each enum torchao registers with pytree: four lines on
    every run, about nothing finetune uses (its QAT is torch code). Those two messages are dropped, nothing else."""
    logging.getLogger("torchao").addFilter(_Without(("Failed to load", "torchao", ".so")))
    logging.getLogger("torch.utils._pytree").addFilter(_Without(("is an Enum subclass", "register_constant()")))


def log_friendly_libraries() -> None:
    """Off a terminal, turn off the libraries' progress bars: huggingface_hub's and transformers' through their
    documented switch (HF_HUB_DISABLE_PROGRESS_BARS, or their disable functions once they are imported), every other
    tqdm bar (transformers' GGUF conversion uses tqdm directly) through tqdm's own TQDM_DISABLE, read when tqdm is
    imported. Our phases say the progress in lines instead. A value the user set is left as it is. On a terminal
    too: torchao's import noise (_quiet_torchao_import)."""
    _quiet_torchao_import()
    if on_terminal():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if "huggingface_hub" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from transformers.utils import logging

        logging.disable_progress_bar()


def _seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Phase:
    """`with Phase("reference log-probabilities", total=pairs, unit="pairs") as phase: ... phase.advance(n)`."""

    def __init__(self, what: str, total: int | None = None, unit: str = "", every: float | None = None,
                 stream: TextIO | None = None) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream or sys.stderr
        self.terminal = on_terminal(self.stream)
        self.every = every if every is not None else TERMINAL_EVERY_S if self.terminal else EVERY_S
        self.done = 0
        self.started = time.monotonic()
        self.quiet = os.environ.get("RANK", "0") != "0"
        self.said = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> Phase:
        self.started = time.monotonic()
        self._watcher = threading.Thread(target=self._watch, name="finetune-progress", daemon=True)
        self._watcher.start()
        return self

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n

    def status(self) -> str:
        """How far the phase is: done of total, rate and time left; or the seconds so far."""
        elapsed = time.monotonic() - self.started
        if self.total is None:
            return f"{self.what}: {_seconds(elapsed)} so far"
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = f", about {_seconds((self.total - self.done) / rate)} left" if rate > 0 else ""
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.what}: {self.done:,}/{self.total:,}{unit} ({rate:,.1f}/s{left})"

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        if not self.said:
            return
        if kind is None:
            done = f"{self.done:,} {self.unit} " if self.total else ""
            self._say(f"{self.what}: {done}done in {_seconds(time.monotonic() - self.started)}", final=True)
        elif self.terminal and not self.quiet:
            self.stream.write("\n")  # the error's message starts on a line of its own

    def _watch(self) -> None:
        if self._stop.wait(DELAY_S):
            return
        self._say(self.status(), final=False)
        while not self._stop.wait(self.every):
            self._say(self.status(), final=False)

    def _say(self, text: str, final: bool) -> None:
        if self.quiet:
            return
        with self._lock:
            self.said = True
            if self.terminal:  # one line rewritten in place, ended when the phase ends
                self.stream.write(f"\r\x1b[K{text}" + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
