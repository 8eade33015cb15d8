"""The learning-rate schedule: warmup, then cosine, linear or constant down to lr * min_lr_ratio."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.recipe import TrainConfig
from finetune.train.optim import build_optimizer, build_scheduler, lr_factor


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 1.0, **kw})


def test_warmup_is_linear_from_the_first_step():
    cfg = _cfg(warmup_steps=4, lr_scheduler="constant")
    assert [lr_factor(s, 10, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_cosine_and_linear_decay_to_the_floor(floor):
    total, warm = 12, 2
    cos = _cfg(warmup_steps=warm, lr_scheduler="cosine", min_lr_ratio=floor)
    lin = _cfg(warmup_steps=warm, lr_scheduler="linear", min_lr_ratio=floor)
    for step in range(warm, total + 1):
        progress = (step - warm) / (total - warm)
        assert lr_factor(step, total, cos) == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert lr_factor(step, total, lin) == pytest.approx(floor + (1 - floor) * (1 - progress))
    assert lr_factor(warm, total, cos) == 1.0 and lr_factor(total, total, cos) == pytest.approx(floor)
    assert lr_factor(total + 5, total, lin) == pytest.approx(floor)  # past the end: stays at the floor


def test_the_scheduler_applies_the_factor_per_optimizer_step():
    cfg = _cfg(lr=0.01, warmup_steps=2, lr_scheduler="linear")
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model.named_parameters(), cfg)
    scheduler = build_scheduler(optimizer, 6, cfg)
    seen = []
    for _ in range(6):
        seen.append(scheduler.get_last_lr()[0])  # the lr the step about to run uses (the trainer logs this)
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.01 * lr_factor(s, 6, cfg) for s in range(6)])
    assert seen[0] == pytest.approx(0.005) and seen[1] == pytest.approx(0.01)
