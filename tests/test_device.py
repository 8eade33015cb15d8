"""Where a run computes: FINETUNE_DEVICE (auto, cpu, cuda) and one GPU per rank (finetune/dist.py).

On a machine with one GPU, two ranks under auto once both reached for the GPU and failed inside NCCL; now such a
start is a UserError that says what to do, and FINETUNE_DEVICE=cpu runs every rank on the CPU with gloo.
"""

from __future__ import annotations

import pytest
import torch
from helpers import QUICKSTART, TINY, run_cli

from finetune import dist
from finetune.errors import UserError

ONE = dist.World()
RANK_1_OF_2 = dist.World(rank=1, size=2, local_rank=1)


@pytest.mark.parametrize(("setting", "world", "gpus", "want"), [
    ("auto", ONE, 0, "cpu"),
    ("auto", ONE, 1, "cuda:0"),
    ("auto", RANK_1_OF_2, 2, "cuda:1"),
    ("cpu", RANK_1_OF_2, 1, "cpu"),  # more ranks than GPUs: all on the CPU
    ("cpu", ONE, 8, "cpu"),
    ("cuda", ONE, 1, "cuda:0"),
])
def test_choose_device(setting, world, gpus, want):
    assert dist.choose_device(world, setting, cuda_count=gpus) == torch.device(want)


def test_two_ranks_on_one_gpu_is_refused_with_what_to_do():
    with pytest.raises(UserError) as err:
        dist.choose_device(RANK_1_OF_2, "auto", cuda_count=1)
    message = str(err.value)
    assert "local rank 1 needs GPU 1" in message and "has 1 visible" in message
    assert "FINETUNE_DEVICE=cpu" in message and "--nproc" in message


def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(UserError, match="FINETUNE_DEVICE=cuda, but torch sees no CUDA device"):
        dist.choose_device(ONE, "cuda", cuda_count=0)


@pytest.mark.parametrize(("value", "want"), [(None, "auto"), ("", "auto"), ("CPU", "cpu"), (" cuda ", "cuda"),
                                             ("auto", "auto")])
def test_device_setting_reads_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(dist.DEVICE_ENV, raising=False)
    else:
        monkeypatch.setenv(dist.DEVICE_ENV, value)
    assert dist.device_setting() == want


def test_device_setting_names_the_choices(monkeypatch):
    monkeypatch.setenv(dist.DEVICE_ENV, "gpu")
    with pytest.raises(UserError, match="FINETUNE_DEVICE='gpu': choose one of auto, cpu, cuda"):
        dist.device_setting()


def test_the_cli_honours_finetune_device(tmp_path):
    """`FINETUNE_DEVICE=cpu finetune train` runs on the CPU (on a CUDA machine too); a bad value exits 2."""
    args = ["train", str(QUICKSTART), *TINY, "train.max_steps=1", "eval.at_start=false"]
    r = run_cli(*args, f"output_dir={tmp_path / 'cpu'}", env={"FINETUNE_DEVICE": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device: cpu; world size 1" in r.stdout and "loss: chunked" in r.stdout
    r = run_cli(*args, f"output_dir={tmp_path / 'bad'}", env={"FINETUNE_DEVICE": "gpu"})
    assert r.returncode == 2 and "FINETUNE_DEVICE='gpu'" in r.stderr and "Traceback" not in r.stderr
