"""Shared helpers for integration tests: run the real CLI, read a run's metrics and weights."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from cli_server import CliServer, forking
from conftest import TINY_MODEL_CONFIG
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "yaml" / "quickstart.yaml"

# The quickstart with the tests' one tiny model (conftest.TINY_MODEL_CONFIG), same data and tokenizer: integration
# tests stay fast.
TINY = [*(f"model.config.{key}={value}" for key, value in TINY_MODEL_CONFIG.items() if key != "model_type"),
        "data.max_seq_len=256", "eval.at_start=false", "eval.every_steps=null", "logging.every_steps=1"]


# One thread per test process: the models are tiny, and on a shared 2-core machine OpenMP threads spinning
# against other processes made each run ~3x slower (measured: 30 s -> 9 s for a 3-step run under load).
# PYTHONFAULTHANDLER: a process that hangs past its timeout is sent SIGABRT (run_process), and every Python process
# of the tree then prints where each of its threads stood: a hang in CI says where it hung.
TEST_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m finetune ARGS` in its own process from the repo root, `env` added to TEST_ENV; returns the
    completed process. Forked from a server that imported the trainer once (cli_server.py: ~3 s less a run)."""
    cmd = [sys.executable, "-m", "finetune", *args]
    if not forking():
        return run_process(cmd, env={**TEST_ENV, **(env or {})}, timeout=timeout)
    rc, out, err = _server().run(list(args), ROOT, dict(env or {}), timeout)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def run_ranks(nproc: int, *args: str, env: dict | None = None, timeout: float = 300,
              script: Path | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=NPROC -m finetune ARGS` (or `SCRIPT ARGS`: a test's worker), `env` added
    to TEST_ENV: each rank forked from the CLI server with torchrun's environment (cli_server.py), its outputs
    joined in rank order; a plain torchrun where the server does not fork."""
    target = [str(script)] if script else ["-m", "finetune"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target, *args]
    if not forking():
        return run_process(cmd, env={**TEST_ENV, **(env or {})}, timeout=timeout)
    rc, out, err = _server().run_ranks(nproc, list(args), ROOT, dict(env or {}), timeout, str(script) if script else None)
    return subprocess.CompletedProcess(cmd, rc, out, err)


_SERVERS: list[CliServer] = []


def _server() -> CliServer:
    """This test process's CLI server, started on first use, closed when the process exits."""
    if not _SERVERS:
        _SERVERS.append(CliServer(ROOT, ROOT / "examples" / "tokenizer", TEST_ENV))
        atexit.register(_SERVERS[0].close)
    return _SERVERS[0]


def run_process(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) from the repo root, but a command still running after
    `timeout` s has each Python process of its tree (torchrun's workers included) dump its threads' stacks (SIGABRT
    under PYTHONFAULTHANDLER) before it is killed; the test then fails with those stacks in its message."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [proc.pid, *descendants(proc.pid)]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f} s: {' '.join(cmd)[:300]}\n--- stdout (tail) ---\n"
                             f"{out[-3000:]}\n--- stderr with the stacks (tail) ---\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(root: int) -> list[int]:
    """Every process below `root` (children first found by their parent pid in /proc), deepest last."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside (as the suite's CLI runs, OMP_NUM_THREADS=1): one reduction order whatever the
    shapes, and a fair share of a shared machine; the thread count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_resume_checks_reference_weights(args: list[str], run: Path, reference: Path, key: str,
                                           moved: Path | None, said: str | None = None) -> None:
    """A model a resume loads again (`key`: dpo.reference, grpo.reference, model.path) is identified by its weights:
    `run` (`finetune` + args) resumed from its step-1 checkpoint with one weight changed at `reference` exits 2 with
    `said` (default: naming the reference at `key`) and trains nothing; put back, or moved to `moved` (another path:
    the same weights), it resumes."""
    def resume_from_step_1(path: Path) -> subprocess.CompletedProcess:
        shutil.rmtree(run / "final", ignore_errors=True)
        shutil.rmtree(run / "checkpoints" / "step-2", ignore_errors=True)
        return run_cli(*args, "resume=auto", f"{key}={path}")

    file = reference / "model.safetensors"
    original = file.read_bytes()
    weights = load_file(str(file))
    weights[sorted(weights)[0]].view(-1)[0] += 1e-3
    save_file(weights, str(file), metadata={"format": "pt"})
    done = resume_from_step_1(reference)  # the same path, other weights
    assert done.returncode == 2, done.stderr[-3000:]
    assert (said or f"the weights of the reference model at {key} {reference}") in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not (run / "checkpoints" / "step-2").exists()
    file.write_bytes(original)
    if moved is not None:
        reference = reference.rename(moved)  # another path, the same weights
    done = resume_from_step_1(reference)
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-3000:]
    assert (run / "checkpoints" / "step-2").exists()


def train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r]


def assert_same_steps(lines: list[dict], ref: list[dict], tolerance: float = 1e-5,
                      equal: tuple[str, ...] = ("tokens",)) -> None:
    """Two runs' training lines: the same steps, the same `equal` counts, and losses and grad norms within
    `tolerance` of the reference (relative)."""
    assert [r["step"] for r in lines] == [r["step"] for r in ref]
    for a, b in zip(lines, ref):
        assert all(a[k] == b[k] for k in equal), (a["step"], {k: (a[k], b[k]) for k in equal})
        assert abs(a["loss"] - b["loss"]) <= tolerance * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= tolerance * b["grad_norm"], (a["step"], a["grad_norm"],
                                                                                    b["grad_norm"])


def eval_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "eval_loss" in r]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the strictest elementwise relative error."""
    scale = b.abs().max().clamp_min(1e-30)
    return float((a.double() - b.double()).abs().max() / scale)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius) for one tensor: the usual relative difference of two weight tensors."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """A full disk for this process alone, without a small filesystem: any write that would take a file past
    `nbytes` fails with EFBIG (RLIMIT_FSIZE, with SIGXFSZ ignored), whoever writes it (safetensors, torch.save,
    open()), each raising its own exception type. The limit is lifted again on exit."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


class CountingTokenizer:
    """A tokenizer that counts its chat-template renderings (delegates everything else)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.renders = 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)


def profile_events(fn: Any) -> int:
    """How many calls and returns (of Python and C functions) fn() makes: a count of work that, unlike seconds, does
    not depend on how busy the machine is. Tests bound work with it (linear, not quadratic; refused at once)."""
    events = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal events
        events += 1

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return events


def teacher_dir(path, vocab: int = 1024, seed: int = 1, hidden: int = 48):
    """A tiny Llama teacher (wider than the student) with the quickstart's tokenizer, saved as a model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = {k: v for k, v in TINY_MODEL_CONFIG.items() if k != "model_type"} | {"hidden_size": hidden,
                                                                                   "intermediate_size": 2 * hidden}
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config, vocab_size=vocab)).save_pretrained(path)
    AutoTokenizer.from_pretrained(ROOT / "examples" / "tokenizer").save_pretrained(path)
    return path


def load_benchmark(name: str) -> Any:
    """benchmarks/NAME.py imported as the module NAME, once (benchmarks/ joins sys.path: the benchmarks import
    each other and benchmarks/trl_compare.py by name)."""
    import importlib

    benchmarks = str(ROOT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.append(benchmarks)
    return importlib.import_module(name)


def example_after_quickstart(example: str, tmp_path: Path) -> Path:
    """examples/yaml/EXAMPLE.yaml's commands: the quickstart's SFT, then the example from its model; the example's run
    directory (tmp_path/run)."""
    sft = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'sft'}", timeout=1800)
    assert sft.returncode == 0, sft.stderr[-3000:]
    recipe = ROOT / "examples" / "yaml" / f"{example}.yaml"
    done = run_cli("train", str(recipe), f"model.path={tmp_path / 'sft' / 'final'}", f"output_dir={tmp_path / 'run'}",
                   timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "run"


def first_cli_step(bench: Any, case: Any, work: Path, files: list[Path]) -> dict[str, Any]:
    """A TRL side-by-side's case through `finetune train` (its recipe from the benchmark, in work/cli): the run's
    first metrics line."""
    (work / "cli").mkdir()
    recipe = bench.write_recipe(case, work / "cli", *files)
    done = run_cli("train", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in (work / "cli" / f"ours-{case.name}" / "metrics.jsonl").read_text().splitlines()]
    return next(x for x in lines if "loss" in x)


def trl_or_skip() -> str:
    """The directory that holds TRL (installed, or by `pip install --target /tmp/trl_pkgs`), for a benchmark's
    --trl-path; the test is skipped where there is none (CI has no TRL)."""
    import importlib.machinery
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("trl") or importlib.machinery.PathFinder.find_spec("trl", ["/tmp/trl_pkgs"])
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("TRL is not installed (CI has no TRL)")
    return str(next(iter(spec.submodule_search_locations))).removesuffix("/trl")
