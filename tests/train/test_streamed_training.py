"""A streamed completion corpus (data.streaming) trained by the real CLI for train.max_steps, packed, and resumed
mid-stream bit for bit: the resumed run's losses, grad norms, sample counts and final weights equal the uninterrupted
run's exactly, in one process and in two (torchrun, gloo), where each process reads its own share of the stream."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import QUICKSTART, TINY, final_weights, run_cli, run_ranks, train_lines

# 60 short texts, windows of 25 samples: a checkpoint at step 3 falls inside a window, and 6 steps of 8 packed rows
# read the corpus more than once (the stream starts again from the top).
STREAM = ["datasets.0.format=completion", "data.streaming=true", "data.stream_buffer=25", "train.epochs=null",
          "checkpoint.every_steps=3", "checkpoint.keep_last=2", "eval_datasets.0.max_rows=20"]


def corpus(tmp_path: Path) -> Path:
    """Texts made from the quickstart's conversations (user and assistant turns joined)."""
    rows = (QUICKSTART.parent / ".." / "data" / "quickstart_train.jsonl").read_text().splitlines()[:60]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(m["content"] for m in json.loads(r)["messages"])}) + "\n"
                            for r in rows))
    return path


def assert_bit_identical(a: Path, b: Path) -> None:
    fields = ("step", "epoch", "loss", "grad_norm", "tokens", "tokens_seen", "samples")
    la, lb = ([tuple(x[f] for f in fields) for x in train_lines(run)] for run in (a, b))
    assert la == lb and la
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def interrupted_copy(straight: Path, into: Path, last: int) -> Path:
    """What a run stopped right after its step-3 checkpoint would have left."""
    shutil.copytree(straight, into)
    shutil.rmtree(into / "final")
    shutil.rmtree(into / "checkpoints" / f"step-{last}")
    return into


def test_a_streamed_run_resumed_mid_stream_is_bit_identical(tmp_path):
    args = [*TINY, f"datasets.0.path={corpus(tmp_path)}", *STREAM, "train.max_steps=6"]
    straight = tmp_path / "straight"
    r = run_cli("train", str(QUICKSTART), f"output_dir={straight}", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data: streamed, tokenized and packed 25 samples at a time" in r.stdout
    assert max(x["epoch"] for x in train_lines(straight)) >= 1  # the corpus was read again from its start
    record = json.loads((straight / "versions.json").read_text())["run"]["data"]
    assert record == {"streamed": True, "stream_buffer": 25, "processes": 1}
    state = json.loads((straight / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["stream"][0]["emitted"] > 0  # step 3 ended inside a window
    resumed = interrupted_copy(straight, tmp_path / "resumed", 6)
    r = run_cli("train", str(QUICKSTART), f"output_dir={resumed}", *args, "resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step-3" in r.stdout
    assert_bit_identical(straight, resumed)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return run_ranks(2, *args, env={"FINETUNE_DEVICE": "cpu"})


@pytest.mark.dist
def test_two_processes_stream_their_shares_and_resume_bit_identical(tmp_path):
    """Two ranks (gloo), each reading its share of the corpus: a run resumed from its step-2 checkpoint on two ranks
    equals the uninterrupted one (a resume on another number of processes is refused: tests/data/
    test_streamed_datasets.py)."""
    args = [*TINY, f"datasets.0.path={corpus(tmp_path)}", *STREAM, "train.max_steps=4", "checkpoint.every_steps=2",
            "train.micro_batch_size=2", "train.gradient_accumulation_steps=2"]
    straight = tmp_path / "straight"
    r = torchrun("train", str(QUICKSTART), f"output_dir={straight}", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "each of 2 processes its share" in r.stdout and "world size 2" in r.stdout
    positions = json.loads((straight / "checkpoints" / "step-2" / "trainer_state.json").read_text())["stream"]
    assert len(positions) == 2 and positions[0] != positions[1]
    resumed = interrupted_copy(straight, tmp_path / "resumed", 4)
    r = torchrun("train", str(QUICKSTART), f"output_dir={resumed}", *args, "resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bit_identical(straight, resumed)
