"""train/stop.py: SIGTERM is noted once (the run then stops after its step); a second one is not caught, and the
handlers in place before come back after."""

from __future__ import annotations

import os
import signal
import threading

from finetune.train.stop import StopRequest


def test_the_first_sigterm_is_noted_the_second_goes_through_and_the_old_handler_comes_back():
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        previous = signal.getsignal(signal.SIGTERM)
        with StopRequest().watching() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and seen == []
            os.kill(os.getpid(), signal.SIGTERM)  # not caught again: what was there before gets it
            assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, before)


def test_outside_the_main_thread_nothing_is_caught():
    result: list[bool] = []

    def body() -> None:
        with StopRequest().watching() as stop:
            result.append(stop.requested)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert result == [False]
