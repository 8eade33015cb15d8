"""The one exception type that means "the user can fix this": the CLI prints it and exits 2."""


class UserError(Exception):
    """A problem in the recipe, the data, the files or the environment that the user can fix.

    The message must name the key or file/line and say how to fix it. The CLI prints it without a
    traceback (unless --debug) and exits with status 2.
    """
