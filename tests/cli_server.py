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

`run_ranks` forks N such runs at once with the environment torchrun --standalone gives its workers (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, ...): a 2-rank run without torchrun's agent and each worker's
imports (~12 s of CPU a launch on the 2-core machine). The training is the same code under the same environment;
what is torchrun's own (its agent, signal forwarding, --nproc) is tested with torchrun itself. Once a rank fails,
the others are given 30 s to end on their own and then killed, as torchrun tears down a failed group.
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
import faulthandler, json, os, runpy, signal, socket, sys, time, traceback
sys.path.insert(0, os.getcwd())  # the repository, absolute: each run has its own cwd
import finetune.train.loop  # noqa: F401  the heavy imports (torch, transformers), paid once
# transformers imports lazily: touch what every run needs so its import is paid once too. Only modules are shared
# with the runs; each still loads its own tokenizer and model.
import datasets, transformers  # noqa: E401,F401
from transformers.models.llama import modeling_llama  # noqa: F401
import transformers.quantizers.auto  # noqa: F401  model loading imports it, and with it torchao (0.4 s a run)
transformers.AutoTokenizer.from_pretrained(sys.argv[1])
print("ready", flush=True)
def child(job, env, stdout, stderr):
    """One `python -m finetune ARGS` in this forked process: own session, cwd, environment, stdout, stderr and exit
    status; never returns."""
    code = 1
    try:
        os.setsid()  # its own session: signals sent to it, or to its group, do not reach the server
        os.environ.update(env)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        faulthandler.dump_traceback_later(job["timeout"], exit=True)
        os.chdir(job["cwd"])
        for fd, name, mode in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
            target = os.open(name, mode | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        script = job.get("script")  # a worker script instead of `-m finetune`
        sys.argv = [script or "finetune", *job["args"]]
        try:
            if script:
                runpy.run_path(script, run_name="__main__")
            else:
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


def rank_env(rank, ranks, port):
    """What torchrun --standalone gives each worker that finetune and torch.distributed read."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def wait_all(pids):
    """Every rank's exit status, in rank order. Once one fails, the others get GRACE_S to end on their own (the
    trainer's own failure handling), then are killed, as torchrun tears a failed group down."""
    codes, failed_at = {}, None
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                    if codes[pid] != 0 and failed_at is None:
                        failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for pid in pids:
                if pid not in codes:
                    os.killpg(pid, signal.SIGKILL)
        time.sleep(0.02)
    return [codes[pid] for pid in pids]


GRACE_S = 30
for line in sys.stdin:
    job = json.loads(line)
    ranks = job.get("ranks")
    if ranks is None:
        pid = os.fork()
        if pid == 0:
            child(job, job["env"], job["stdout"], job["stderr"])
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
        continue
    with socket.socket() as s:  # a free port for rank 0's store, as torchrun --standalone finds one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            child(job, {**job["env"], **rank_env(rank, ranks, port)}, job["stdouts"][rank], job["stderrs"][rank])
        pids.append(pid)
    print(json.dumps(wait_all(pids)), flush=True)
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
            code = self._send({"args": args, "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "env": env,
                               "timeout": max(1, int(timeout))})
            return code, _read(out), _read(err)

    def run_ranks(self, ranks: int, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
                  script: str | None = None) -> tuple[int, str, str]:
        """(the first failed rank's exit status or 0, every rank's stdout, every rank's stderr, in rank order) of
        `python -m finetune ARGS` (or `python SCRIPT ARGS`) run as `ranks` processes with torchrun's environment,
        each forked from the server."""
        with tempfile.TemporaryDirectory(prefix="finetune-ranks-") as tmp:
            outs = [str(Path(tmp) / f"stdout{r}") for r in range(ranks)]
            errs = [str(Path(tmp) / f"stderr{r}") for r in range(ranks)]
            codes = self._send({"args": args, "cwd": str(cwd), "stdouts": outs, "stderrs": errs, "env": env,
                                "ranks": ranks, "timeout": max(1, int(timeout)), "script": script})
            return next((c for c in codes if c), 0), "".join(map(_read, outs)), "".join(map(_read, errs))

    def _send(self, job: dict) -> object:
        """Hand the server one job and wait for its answer (the exit status, or each rank's)."""
        with self.lock:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"CLI server died: {self._log()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


def _read(path: str | Path) -> str:
    """A run's output file, or "" when the run never opened it."""
    path = Path(path)
    return path.read_text(errors="replace") if path.exists() else ""


def forking() -> bool:
    return hasattr(os, "fork") and os.environ.get("FINETUNE_TEST_PLAIN_CLI") != "1"
