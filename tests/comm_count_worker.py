"""A torchrun worker for tests/train/test_distributed.py: `finetune train ARGS` with its step loop under the torch
profiler, then rank 0
prints how many gradient reductions ran, as one JSON line: {"reduce_scatter": n, "all_reduce": n}.

The profiler records every c10d collective by name on gloo too (`c10d::_reduce_scatter_base_` is FSDP2's
gradient reduce-scatter; `gloo:all_reduce` counts DDP's gradient buckets and the trainer's own per-step
all-reduces). Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from torch.profiler import ProfilerActivity, profile

from finetune import dist
from finetune.cli import main
from finetune.train import loop
from finetune.train.loop import train_loop

names: Counter[str] = Counter()


def profiled_loop(run: Any, stop: Any = None) -> Any:
    """The step loop under the profiler: the steps' collectives are what the test counts, and profiling the setup
    (imports, the model, the data) too only made each run slower."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = train_loop(run, stop)
    names.update(event.name for event in prof.events())
    return result


if __name__ == "__main__":
    loop.train_loop = profiled_loop  # train() looks it up in its module when it runs
    code = main(["train", *sys.argv[1:]])
    if dist.from_env().is_main:
        print(json.dumps({"reduce_scatter": names["c10d::_reduce_scatter_base_"],
                          "all_reduce": names["gloo:all_reduce"], "exit": code}))
    sys.exit(code)
