"""Shared fixtures: the repository root, the example tokenizer, and a writer for small recipe files.

Kept import-light on purpose (no torch, no transformers at import time): recipe tests must stay fast, and
the tokenizer fixture imports transformers only when a test asks for it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

# Test runs must not read or fill the user's data cache (~/.cache/finetune/data): one temporary cache per
# session, inherited by every CLI subprocess the tests start.
os.environ.setdefault("FINETUNE_CACHE_DIR", tempfile.mkdtemp(prefix="finetune-test-cache-"))

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "examples" / "tokenizer"
QUICKSTART_YAML = REPO_ROOT / "examples" / "yaml" / "quickstart.yaml"

# `python -m pytest` puts the repo root on sys.path, `.venv/bin/pytest` does not: make both import `finetune`.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The tests' one tiny model: the quickstart's Llama shrunk to the smallest that still runs the real code paths
# (2 layers, hidden 32, grouped-query attention, tied embeddings). tiny_recipe uses it with one optimizer step;
# helpers.TINY puts it into the quickstart recipe for the CLI tests.
TINY_MODEL_CONFIG = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def tiny_recipe(output_dir: str | Path, data: str | Path = "train.jsonl", fmt: str = "chat") -> dict[str, Any]:
    """A small valid recipe dict: random-init tiny Llama, the example tokenizer, one dataset, one step."""
    return {
        "output_dir": str(output_dir),
        "seed": 0,
        "model": {"init": "random", "config": dict(TINY_MODEL_CONFIG)},
        "tokenizer": {"path": str(TOKENIZER_DIR)},
        "datasets": [{"path": str(data), "format": fmt}],
        "data": {"max_seq_len": 128, "packing": True, "packing_check": False},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 1, "lr": 1.0e-3},
        "eval": {"at_start": False},
    }


# --- the environment a test assumes ------------------------------------------------------------------------
# CI (`make test`) runs in the tested environment: the pins of finetune/versions.py, torch in its tested range,
# bitsandbytes, liger-kernel (run on the CPU by Triton's interpreter) and the dev extras installed, flash-attn
# absent. Tests that read that environment itself (not a faked one) are marked `pinned_env` and skip elsewhere (a
# GPU machine with torch 2.11 and flash-attn, say), naming each difference; an optional package a test needs is asked for with `needs()`, which
# skips where it is missing. With FINETUNE_TEST_ENV=require (`make test` sets it) neither skips: in CI a
# difference is a failure, never a silent skip.
STRICT_ENV = "FINETUNE_TEST_ENV"


def strict_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() == "require"


def pinned_env_differences() -> list[str]:
    """How this environment differs from the tested one, one phrase per library; empty when it is the same."""
    from finetune import versions  # light: metadata only, no torch

    out = []
    for package in ("torch", "transformers", "peft", "bitsandbytes", "liger-kernel"):
        wanted, installed = versions.wanted_spec(package), versions.installed_version(package)
        if versions.compare_version(package, wanted, installed) is not None:
            out.append(f"{package} {installed or 'missing'} (tested {wanted})")
    if (installed := versions.installed_version("flash-attn")) is not None:
        out.append(f"flash-attn {installed} installed (the tested environment has none)")
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("pinned_env")]
    differences = pinned_env_differences() if marked else []
    if not differences or strict_env():
        return
    skip = pytest.mark.skip(reason="assumes the tested environment; here: " + "; ".join(differences))
    for item in marked:
        item.add_marker(skip)


def needs(module: str, distribution: str | None = None, minimum: str | None = None) -> Any:
    """Import an optional module a test needs; skip the test where it is missing or older than `minimum` (a
    version of `distribution`, default the module's name), or fail there under FINETUNE_TEST_ENV=require."""
    import importlib

    from finetune import versions

    try:
        found = importlib.import_module(module)
    except ImportError as e:
        if strict_env():
            raise
        pytest.skip(f"{module} is not installed here ({e})")
    installed = versions.installed_version(distribution or module)
    if minimum and not (installed and versions.satisfies(installed, f">={minimum}")):
        if strict_env():
            pytest.fail(f"{distribution or module} {installed} is older than the {minimum} this test needs")
        pytest.skip(f"{distribution or module} {installed} is older than the {minimum} this test needs")
    return found


# --- Liger's kernels under Triton's interpreter ------------------------------------------------------------
# Tests of our Liger path run Liger's Triton kernels on the CPU with Triton's interpreter, which must be on before
# Triton is imported (it decides when each kernel is defined). It is switched on in a child process, never in the
# pytest process: setting TRITON_INTERPRET here, before any import, would also change every other test's process
# (Triton importable and interpreting, Liger importable: resolve_impl, the kernels' checks and bitsandbytes see
# another environment), and under pytest-xdist each worker is its own process anyway. One child per worker, started
# by the first test that asks for it, then reused: the function runs there and its result (or its exception, with
# the child's traceback) comes back. The function must be importable by name (module level in a tests/ module).

def _liger_installed() -> None:
    import importlib.util

    missing = [m for m in ("triton", "liger_kernel") if importlib.util.find_spec(m) is None]
    if missing:
        message = f"{', '.join(missing)} not installed here (`make test` installs them: the dev extra)"
        if strict_env():
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def _interpreter_pool() -> Any:
    import multiprocessing

    import liger_interpreter

    pool = multiprocessing.get_context("spawn").Pool(1, initializer=liger_interpreter.enable)
    yield pool
    # Ended, not awaited: a child that takes seconds to exit (torch's cleanup) would keep the xdist worker past
    # execnet's 5 s shutdown grace, which then interrupts it.
    pool.terminate()


@pytest.fixture
def interpreted(_interpreter_pool: Any) -> Callable[..., Any]:
    """`interpreted(fn, *args)`: fn(*args) in the worker's child process with TRITON_INTERPRET=1; its result, or its
    exception (with the child's traceback as its cause)."""
    _liger_installed()
    return lambda fn, *args: _interpreter_pool.apply_async(fn, args).get(timeout=600)


def python_path(*first: Path | str, without: Path | None = None) -> str:
    """A PYTHONPATH for a child process: `first`, then this process's PYTHONPATH (on a GPU machine the libraries
    may live only there, e.g. /tmp/site), less `without` (e.g. the checkout, when a test must import an installed
    copy of finetune instead)."""
    inherited = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    if without is not None:
        inherited = [e for e in inherited if Path(e).resolve() != Path(without).resolve()]
    return os.pathsep.join(dict.fromkeys([*map(str, first), *inherited]))


@pytest.fixture(scope="module")
def single_thread() -> Any:
    """One torch thread for a whole module (helpers.one_thread): the TRL side-by-sides' tests run as their
    benchmarks do, in the same reduction order, and take a fair share of a shared machine."""
    from helpers import one_thread

    with one_thread():
        yield


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The committed example tokenizer (ChatML byte-level BPE; pad id 0, eos `<|im_end|>` id 2)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """`write_recipe(content, name="recipe.yaml")` writes a dict (as YAML) or a str verbatim under tmp_path."""

    def write(content: dict[str, Any] | str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
        path.write_text(text, encoding="utf-8")
        return path

    return write
