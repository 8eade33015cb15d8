"""What the CLI turns into a message and an exit status: UserError ("the user can fix this", exit 2), and Stopped (a
run stopped on SIGTERM with a checkpoint, exit 143)."""


class UserError(Exception):
    """A problem in the recipe, the data, the files or the environment that the user can fix.

    The message must name the key or file/line and say how to fix it. The CLI prints it without a
    traceback (unless --debug) and exits with status 2.
    """


class Stopped(Exception):
    """The run stopped on SIGTERM after writing a checkpoint (train/stop.py): the CLI prints this and exits
    EXIT_STOPPED."""


class Interrupted(Exception):
    """Generation cut short by the run's stop request (rl/generation.py): its rollouts are dropped, and the loop stops
    the run after the steps done (it never reaches the CLI)."""


EXIT_STOPPED = 143  # 128 + SIGTERM: what a shell reports for a process SIGTERM ended; schedulers requeue it


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (library messages run long), or its type name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
