"""One call of the user's code (a reward function today; tools and environments later) that a time limit or the
run's stop request can end.

The call runs in the main thread, where the user's code expects to be: timeouts built on signals (math_verify's
parsing timeout, `signal.alarm`) work only there. A watcher thread waits beside it; once the limit has passed or
the stop request (SIGTERM) is noted, it sends the main thread SIGUSR2, whose handler (set only for the call) raises
inside it. That interrupts Python code and blocking system calls alike. The exception is a BaseException, so an
`except Exception` in the user's code does not swallow it, and it is sent again every second until the call
returns. A C extension that never returns to Python cannot be interrupted; the watcher cannot help there.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from finetune.errors import Interrupted, UserError

T = TypeVar("T")
SIGNAL = getattr(signal, "SIGUSR2", None)
POLL_S = 0.05  # how often the watcher asks the stop request and the clock
RESEND_S = 1.0  # how often the signal is sent again while the call has not returned


class Timeout(UserError):
    """A call past its limit (call_limited): a reward's stops the run; a tool's becomes its error result."""


class _Ended(BaseException):
    """Raised inside the user's call by the watcher's signal (never seen outside call_limited)."""


def call_limited(fn: Callable[[], T], timeout_s: float | None, stop: Callable[[], bool], what: str,
                 limit_key: str) -> T:
    """fn(), ended by `timeout_s` (None: no limit) or `stop()` turning true. Raises errors.Interrupted on a stop,
    and a UserError naming `what` and `limit_key` on a timeout. Outside the main thread (or where there is no
    SIGUSR2) it is a plain call."""
    if SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return fn()
    reason: list[str] = []
    done = threading.Event()
    main = threading.main_thread().ident
    assert main is not None
    previous = signal.getsignal(SIGNAL)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if reason and not done.is_set():
            raise _Ended
        if callable(previous):  # someone else's SIGUSR2, during the call: theirs to handle
            previous(signum, frame)

    def watch() -> None:
        deadline = time.monotonic() + timeout_s if timeout_s is not None else math.inf
        while not done.wait(POLL_S):
            if not reason and (stop() or time.monotonic() >= deadline):
                reason.append("stop" if stop() else "timeout")
            if reason:
                signal.pthread_kill(main, SIGNAL)
                done.wait(RESEND_S)

    signal.signal(SIGNAL, on_signal)
    watcher = threading.Thread(target=watch, name="finetune-deadline", daemon=True)
    result: Any = None
    try:
        watcher.start()
        try:
            result = fn()
        except _Ended:
            pass
        finally:
            done.set()  # from here on the handler raises nothing
        watcher.join()
    finally:
        signal.signal(SIGNAL, previous)
    if (reason and reason[0] == "stop") or (not reason and stop()):  # a stop noted during the call, however short
        raise Interrupted
    if reason:
        raise Timeout(f"{what} did not return within {timeout_s:g} s ({limit_key}), so the run stops: a function "
                      f"that hangs? If it is only slow, raise {limit_key} (null: no limit)")
    return result
