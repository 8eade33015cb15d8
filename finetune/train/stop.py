"""Stopping when asked: SIGTERM ends the run after the step it is in, with a checkpoint of that step.

SIGTERM is what a preempted spot instance, Kubernetes, `docker stop`, Slurm (`--signal=TERM@120`, or at its
time limit) and torchrun (passing its own on to every worker) send before they kill. Killed mid-run, a run loses
everything since its last checkpoint; stopped this way it loses nothing, and `resume: auto` continues exactly.

The handler only notes the signal. The ranks of a torchrun job may each get it during another step, so the note
rides along in the step's counts, which every rank sums before its backward (step.py step_counts): all ranks see
it at the same step, finish that step, write one checkpoint together and exit. A second SIGTERM is not caught: it
ends the process at once, as it would have without us.

Generated rollouts (GRPO) are made before their step's counts, and one batch's generation can take minutes: once
the run has a step to stop after, the generator asks the note between tokens and, once it is set, stops and raises
errors.Interrupted (rl/live.py has every rank agree). The rollouts are dropped, the run stops after the steps done,
and a resume generates the same ones again (their sampling is seeded by the batch).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM,)


class StopRequest:
    """Whether a stop signal arrived while `watching`."""

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def watching(self) -> Iterator[StopRequest]:
        """Catch the stop signals inside (the previous handlers come back after). Outside the main thread, where
        Python cannot catch signals, nothing is caught."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        # None: a handler set outside Python, which cannot be put back; the default is what it would do.
        previous = {s: signal.getsignal(s) or signal.SIG_DFL for s in STOP_SIGNALS}

        def note(signum: int, _frame: FrameType | None) -> None:
            self.requested = True
            signal.signal(signum, previous[signum])  # a second one is not caught

        for s in STOP_SIGNALS:
            signal.signal(s, note)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def stopped_message(step: int, total: int, saved: Path | None) -> str:
    """What every rank says (some may not have had the signal themselves). `saved`: the checkpoint of step `step`;
    None when a resumed run stopped (generating) before taking a step of its own."""
    if saved is not None:
        return f"stopped on SIGTERM after step {step} of {total}: {saved} (resume: auto continues from it)"
    return (f"stopped on SIGTERM after step {step} of {total}, before another step: the checkpoint this run resumed "
            "from holds it (resume: auto continues from it)")
