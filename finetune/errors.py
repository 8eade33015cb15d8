"""The one exception type that means "the user can fix this": the CLI prints it and exits 2."""


class UserError(Exception):
    """A problem in the recipe, the data, the files or the environment that the user can fix.

    The message must name the key or file/line and say how to fix it. The CLI prints it without a
    traceback (unless --debug) and exits with status 2.
    """


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (library messages run long), or its type name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
