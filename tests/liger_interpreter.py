"""The child process of the `interpreted` fixture (conftest.py): Triton's interpreter on before anything imports
Triton. Imports nothing but `os`: the pool's child unpickles `enable` before it runs, so this module is imported first."""

import os


def enable() -> None:
    """Runs first in the child: Triton reads TRITON_INTERPRET when Liger's kernels are defined (liger_kernel's
    import), so it is set before any import; one OpenMP thread, as in the tests' other child processes."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
