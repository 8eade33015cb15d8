"""Reward functions (finetune/rl/rewards.py): the built-ins, the user's own behind the consent gate, what a function
may return and what it is told when it returns something else, and a call ended by its time limit or the run's stop
request (finetune/rl/deadline.py)."""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
import torch

from finetune.errors import Interrupted, UserError
from finetune.recipe import GRPOConfig, Recipe, RewardConfig
from finetune.rl.rewards import BUILT_INS, load_rewards, score, total
from finetune.train.stop import StopRequest


def rewards_of(*configs: RewardConfig, allow_code: bool = True) -> list:
    return load_rewards(Recipe(grpo=GRPOConfig(rewards=list(configs)), allow_code=allow_code))


def where(i: int) -> str:
    return f"p.jsonl:{i + 1}"


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A module of reward functions, importable as user_rewards."""
    (tmp_path / "user_rewards.py").write_text(
        "import time\n"
        "def boom(prompts, completions, **kw):\n    return [float({'x': 1}[c]) for c in completions]\n"
        "def pairs(prompts, completions, **kw):\n    assert len(completions) == 1, 'one at a time'\n    return [1.0]\n"
        "def bad(prompts, completions, **kw):\n    return [float('inf')] * len(completions)\n"
        "def hangs(prompts, completions, **kw):\n    time.sleep(3600)\n"
        "def swallows(prompts, completions, **kw):\n"
        "    while True:\n        try:\n            time.sleep(3600)\n        except Exception:\n            pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_built_in_rewards_and_their_total():
    rewards = rewards_of(RewardConfig(function="exact_answer"), RewardConfig(
        function="format_regex", weight=0.5, args={"pattern": r".*\\boxed\{.*\}"}))
    completions = ["so \\boxed{12}", "it is 1,200", "no idea"]
    got = score(rewards, ["p"] * 3, completions, {"answer": ["12", "1200", "3"]}, lambda i: f"row {i}")
    assert got == {"exact_answer": [1.0, 1.0, 0.0], "format_regex": [1.0, 0.0, 0.0]}
    assert total(got, {"exact_answer": 1.0, "format_regex": 0.5}) == [1.5, 1.0, 0.0]
    assert total({"a": [math.nan, 1.0], "b": [math.nan, math.nan]}, {})[1] == 1.0
    assert math.isnan(total({"a": [math.nan], "b": [math.nan]}, {})[0])  # no function had an opinion


def test_every_built_in_has_its_args_schema():
    from finetune.recipe.code import BUILT_IN_REWARDS
    from finetune.recipe.rl import BUILT_IN_ARGS

    assert set(BUILT_INS) == set(BUILT_IN_ARGS) == set(BUILT_IN_REWARDS)


def test_a_reward_function_that_raises_is_named_with_the_row(user_rewards):
    """The function and the one row whose completion makes it raise (found by calling it again one completion at a
    time), not the batch's range; the range only when no single completion raises alone."""
    batch = ["x", "x", "oops", "y"]
    for name, message in (("boom", r"'boom' raised KeyError: 'oops' \(on a completion of p.jsonl:3: 'oops'\)$"),
                          ("pairs", r"'pairs' raised AssertionError: one at a time \(on the completions of p.jsonl:1 "
                                    r"to p.jsonl:4; no single one raises alone\)"),
                          ("bad", "returned inf for p.jsonl:1")):
        fn = rewards_of(RewardConfig(function=f"user_rewards:{name}"))
        with pytest.raises(UserError, match=message):
            score(fn, ["p"] * 4, batch, {}, where)


def test_user_code_is_not_imported_without_consent(user_rewards):
    """The gate every import goes through: a recipe without allow_code names the code and imports nothing."""
    import sys

    sys.modules.pop("user_rewards", None)
    with pytest.raises(UserError, match=r"grpo.rewards.0.function: user_rewards:boom \(from the command line\)"):
        rewards_of(RewardConfig(function="user_rewards:boom"), allow_code=False)
    assert "user_rewards" not in sys.modules
    assert rewards_of(RewardConfig(function="length"), allow_code=False)[0].fn is BUILT_INS["length"]


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), np.int64(1), np.bool_(True), True,
                                   torch.tensor(0.5), torch.tensor(1, dtype=torch.int32), np.array(0.5)],
                         ids=["np.float32", "np.float64", "np.int64", "np.bool_", "bool", "tensor", "int tensor",
                              "0-d array"])
def test_any_real_scalar_is_a_reward(value):
    """TRL's reward functions return numpy values and 0-d tensors; the docs promise they work unchanged."""
    reward = rewards_of(RewardConfig(function="length"))[0]
    reward.fn = lambda prompts, completions, **kw: [value] * len(completions)
    got = score([reward], ["p"] * 2, ["a", "b"], {}, where)
    assert got == {"length": [float(value.item() if hasattr(value, "item") else value)] * 2}
    reward.fn = lambda prompts, completions, **kw: np.array([value.item() if hasattr(value, "item") else value] * 2)
    assert len(score([reward], ["p"] * 2, ["a", "b"], {}, where)["length"]) == 2  # an array of them too


@pytest.mark.parametrize(("returned", "message"), [
    (None, "returned None (a NoneType); expected a list of 3 numbers"),
    ("abc", "returned 'abc' (a str); expected a list of 3 numbers"),
    ({"a": 1}, "returned {'a': 1} (a dict); expected a list of 3 numbers"),
    (1.0, "returned 1.0 (a float); expected a list of 3 numbers"),
    ([1.0, 2.0], "returned 2 values for 3 completions; expected a list of 3 numbers"),
    ([1.0, "x", 2.0], "returned 'x' (a str) for p.jsonl:2: rewards are real numbers"),
    ([1.0, torch.ones(2), 2.0], "returned tensor([1., 1.]) (a torch.Tensor) for p.jsonl:2"),
    ([1.0, 2.0, np.float32("inf")], "returned inf for p.jsonl:3: rewards are finite numbers or None"),
])
def test_what_a_function_returned_is_said_with_its_type(returned, message):
    reward = rewards_of(RewardConfig(function="length"))[0]
    reward.fn = lambda prompts, completions, **kw: returned
    with pytest.raises(UserError, match=re.escape(message)):
        score([reward], ["p"] * 3, ["a", "b", "c"], {}, where)


def test_a_hung_reward_stops_the_run_naming_it_after_its_time_limit(user_rewards):
    """time.sleep(3600) is ended by the limit, also when the function swallows every Exception."""
    for name in ("hangs", "swallows"):
        fn = rewards_of(RewardConfig(function=f"user_rewards:{name}"))
        with pytest.raises(UserError, match=rf"reward function '{name}' \(scoring the completions of p.jsonl:1 to "
                                            r"p.jsonl:2\) did not return within 0.3 s \(grpo.reward_timeout_s\)"):
            score(fn, ["p"] * 2, ["a", "b"], {}, where, timeout_s=0.3)


def test_sigterm_while_a_reward_runs_ends_it_and_the_batch(user_rewards):
    """The run's stop request (SIGTERM, noted by train/stop.py) ends a hung call at once: errors.Interrupted, which the
    loop turns into a stop after the steps done (the batch is generated again on resume)."""
    fn = rewards_of(RewardConfig(function="user_rewards:hangs"))
    request = StopRequest()
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    with request.watching():
        timer.start()
        with pytest.raises(Interrupted):
            score(fn, ["p"] * 2, ["a", "b"], {}, where, timeout_s=None, stop=lambda: request.requested)
    timer.join()
    assert request.requested


def test_a_reward_may_use_signal_timeouts_of_its_own():
    """The call runs in the main thread, where signal-based timeouts (math_verify's) work; theirs and ours coexist."""
    reward = rewards_of(RewardConfig(function="length"))[0]

    def with_alarm(prompts, completions, **kw):
        def on_alarm(signum, frame):
            raise TimeoutError

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            time.sleep(5)
            return [0.0] * len(completions)
        except TimeoutError:
            return [1.0] * len(completions)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    reward.fn = with_alarm
    before = signal.getsignal(signal.SIGUSR2)
    assert score([reward], ["p"], ["a"], {}, where, timeout_s=60) == {"length": [1.0]}
    assert signal.getsignal(signal.SIGUSR2) is before  # the watcher's handler was set for the call only
