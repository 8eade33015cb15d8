"""`python -m finetune ARGS` in processes forked from a server that imported the trainer once.

A fresh `python -m finetune train` spends ~3 s importing torch and transformers before it reads its recipe, and the
integration tests start a few hundred of them. Each is instead forked from a server process (one per pytest
process, started on first use) that has done those imports: still its own process running `python -m finetune ARGS`
(runpy), with its own cwd, environment, stdout, stderr, exit status and signal handling, stdin /dev/null. Only
modules are shared; each run loads its own tokenizer, data and model. What the server has not imported yet is
imported by each run, as before.

The environment a run is given is applied in it before it starts (os.environ, and PYTHONPATH's entries put in
front of sys.path, where an interpreter would have put them); what a library read from the environment when the
server imported it is the server's (TEST_ENV's: one OpenMP thread, offline). A run past its timeout prints its
threads' stacks (faulthandler) and exits 1. FINETUNE_TEST_PLAIN_CLI=1, or a system without fork, runs each as a
plain subprocess instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SERVER = r'''
import faulthandler, json, os, runpy, sys, traceback
sys.path.insert(0, os.getcwd())  # the repository, absolute: each run has its own cwd
import finetune.train.loop  # noqa: F401  the heavy imports (torch, transformers), paid once
# transformers imports lazily: touch what every run needs so its import is paid once too. Only modules are shared
# with the runs; each still loads its own tokenizer and model.
import datasets, transformers  # noqa: E401,F401
from transformers.models.llama import modeling_llama  # noqa: F401
import transformers.quantizers.auto  # noqa: F401  model loading imports it, and with it torchao (0.4 s a run)
transformers.AutoTokenizer.from_pretrained(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:  # one `python -m finetune ARGS`: own cwd, environment, stdout, stderr and exit status
        code = 1
        try:
            os.setsid()  # its own session: signals sent to it, or to its group, do not reach the server
            os.environ.update(job["env"])
            extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[1:1] = [p for p in extra if p not in sys.path]
            faulthandler.dump_traceback_later(job["timeout"], exit=True)
            os.chdir(job["cwd"])
            for fd, name, mode in ((0, os.devnull, os.O_RDONLY), (1, job["stdout"], os.O_WRONLY),
                                   (2, job["stderr"], os.O_WRONLY)):
                target = os.open(name, mode | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
                os.dup2(target, fd)
                os.close(target)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.argv = ["finetune", *job["args"]]
            try:
                runpy.run_module("finetune", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:  # what the interpreter does with it
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
'''


class CliServer:
    """The server: `run` sends it one job and waits for that run's exit status."""

    def __init__(self, root: Path, tokenizer: Path, env: dict[str, str]) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's stderr, open as long as the server
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tokenizer)], cwd=root, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.lock = threading.Lock()  # one job at a time
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"CLI server did not start: {self._log()}")

    def _log(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of `python -m finetune ARGS` run in `cwd` with `env` added."""
        with tempfile.TemporaryDirectory(prefix="finetune-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            job = {"args": args, "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "env": env,
                   "timeout": max(1, int(timeout))}
            with self.lock:
                self.proc.stdin.write(json.dumps(job) + "\n")
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"CLI server died: {self._log()}")
            read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
            return json.loads(line), read(out), read(err)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


def forking() -> bool:
    return hasattr(os, "fork") and os.environ.get("FINETUNE_TEST_PLAIN_CLI") != "1"
