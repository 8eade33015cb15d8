"""Reward functions: the built-ins and the user's own (`module.path:function`), and their weighted total.

A reward function is called once per batch of rollouts as f(prompts, completions, **fields) -> one float per
completion (None: no opinion), where `fields` holds every other field of the prompt rows as lists, one entry per
completion (TRL's calling convention, so a function written for TRL's GRPOTrainer works unchanged).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.errors import Interrupted, UserError
from finetune.recipe import Recipe, code
from finetune.rl.deadline import call_limited
from finetune.rl.reward_model import reward_model

RewardFn = Callable[..., list[float | None]]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    r"""The answer a completion gives: the content of its last \boxed{...}, else what follows its last '####',
    else its last number (commas dropped); None when it gives none."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _text(completion: Any) -> str:
    """A completion's text: itself, or, for a multi-turn rollout's messages, the last assistant message's content."""
    if isinstance(completion, list):
        said = [m.get("content") for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        return said[-1] if said and isinstance(said[-1], str) else ""
    return completion


def _same(given: str | None, expected: Any) -> bool:
    if given is None or expected is None:
        return False
    want = str(expected).strip().replace(",", "")
    try:
        return math.isclose(float(given), float(want), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return given.strip() == want


def exact_answer(prompts: list, completions: list[str], field: str = "answer", **fields: Any) -> list[float | None]:
    """1.0 when the completion's extracted answer (extract_answer) equals the row's `field`, else 0.0."""
    if field not in fields:
        raise UserError(f"reward exact_answer compares with the rows' {field!r} field, which they do not have "
                        f"(fields: {sorted(fields) or 'none'}); set args: {{field: NAME}}")
    return [1.0 if _same(extract_answer(_text(c)), want) else 0.0 for c, want in zip(completions, fields[field])]


def format_regex(prompts: list, completions: list[str], pattern: str, **fields: Any) -> list[float | None]:
    """1.0 when the whole completion matches `pattern` (re.fullmatch, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(_text(c).strip()) else 0.0 for c in completions]


def length(prompts: list, completions: list[str], target: int = 100, scale: float = 100.0,
           **fields: Any) -> list[float | None]:
    """-|characters - target| / scale: a completion near `target` characters scores highest (0)."""
    return [-abs(len(_text(c)) - target) / scale for c in completions]


BUILT_INS: dict[str, RewardFn] = {"exact_answer": exact_answer, "format_regex": format_regex, "length": length,
                                  "reward_model": reward_model}


@dataclass
class Reward:
    """One configured reward function."""

    name: str
    weight: float
    fn: RewardFn
    args: dict[str, Any]
    key: str = ""
    """Its recipe key (grpo.rewards.0), for messages."""


def load_rewards(recipe: Recipe) -> list[Reward]:
    """The recipe's reward functions: built-ins by name; the user's own imported, only with the user's consent
    (recipe/code.py: this is the gate every import of a recipe's code goes through)."""
    configs = recipe.grpo.rewards
    names = [c.label for c in configs]
    if len(set(names)) != len(names):
        raise UserError(f"grpo.rewards: two reward functions share a name ({names}); give each a `name`")
    refs = {ref.key: ref for ref in code.references(recipe)}
    rewards = []
    for i, c in enumerate(configs):
        if c.function in BUILT_INS:
            fn = BUILT_INS[c.function]
        else:
            code.require_consent(recipe)
            fn = code.import_ref(refs[f"grpo.rewards.{i}.function"])
        rewards.append(Reward(c.label, c.weight, fn, dict(c.args), f"grpo.rewards.{i}"))
    return rewards


def environment_rewards(environment: Callable[[], Any] | None) -> list[Reward]:
    """The reward of an environment class that defines get_reward() (TRL's convention: named after the class, weight
    1), read from each rollout's own instance after its episode; none otherwise."""
    if environment is None or not callable(getattr(environment, "get_reward", None)):
        return []

    def read(prompts: list, completions: list, environments: list, **fields: Any) -> list[float | None]:
        return [e.get_reward() for e in environments]

    return [Reward(environment.__name__, 1.0, read, {}, "grpo.environment")]


def score(rewards: Sequence[Reward], prompts: list, completions: list[str], fields: dict[str, list],
          where: Callable[[int], str], timeout_s: float | None = None, stop: Callable[[], bool] = lambda: False,
          ) -> dict[str, list[float]]:
    """Each function's rewards (NaN for None) by name. A function that raises, returns anything but one real number
    (or None) per completion, or a non-finite one, is a UserError naming it and the row (`where(i)`: the prompt's
    file:line); so is a call longer than `timeout_s`. `stop` (the run's stop request) ends a call at once
    (errors.Interrupted)."""
    out: dict[str, list[float]] = {}
    for reward in rewards:
        span = f"the completions of {where(0)} to {where(len(completions) - 1)}"

        def call(reward: Reward = reward) -> Any:
            return reward.fn(prompts, completions, **reward.args, **fields)

        try:
            values = call_limited(call, timeout_s, stop, f"reward function {reward.name!r} (scoring {span})",
                                  "grpo.reward_timeout_s")
        except (UserError, Interrupted):
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: any failure is reported with its name
            raise UserError(f"reward function {reward.name!r} raised {type(e).__name__}: {e} "
                            f"({_culprit(reward, e, prompts, completions, fields, where, timeout_s, stop)})") from e
        out[reward.name] = _numbers(reward, values, len(completions), where)
    return out


def _numbers(reward: Reward, values: Any, n: int, where: Callable[[int], str]) -> list[float]:
    """One float per completion (NaN: None) from what a function returned: any sequence of real scalars (int,
    float, bool, numpy scalars, 0-d arrays or tensors) or None; anything else is a UserError saying what came."""
    expected = f"expected a list of {n} numbers (one per completion; None for no opinion)"
    if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise UserError(f"reward function {reward.name!r} returned {_shown(values)}; {expected}")
    values = list(values)
    if len(values) != n:
        raise UserError(f"reward function {reward.name!r} returned {len(values)} values for {n} completions; "
                        f"{expected}")
    out = []
    for i, v in enumerate(values):
        number = _real(v)
        if number is None and v is not None:
            raise UserError(f"reward function {reward.name!r} returned {_shown(v)} for {where(i)}: rewards are real "
                            "numbers (int, float, bool, a numpy scalar, a 0-d tensor) or None")
        if number is not None and not math.isfinite(number):
            raise UserError(f"reward function {reward.name!r} returned {number!r} for {where(i)}: rewards are "
                            "finite numbers or None")
        out.append(math.nan if number is None else number)
    return out


def _real(v: Any) -> float | None:
    """v as a float when it is one real scalar (a numpy scalar or a 0-d array or tensor: its item), else None."""
    if getattr(v, "shape", None) == () and callable(getattr(v, "item", None)):
        v = v.item()
    if isinstance(v, numbers.Real):  # bool, int, float, numpy's registered scalar types
        return float(v)
    return None


def _shown(v: Any) -> str:
    """A returned value for a message: its repr (cut at 60 characters) and its type."""
    text = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
    kind = type(v).__name__ if type(v).__module__ == "builtins" else f"{type(v).__module__}.{type(v).__qualname__}"
    return f"{text} (a {kind})"


def _culprit(reward: Reward, error: Exception, prompts: list, completions: list[str], fields: dict[str, list],
             where: Callable[[int], str], timeout_s: float | None, stop: Callable[[], bool]) -> str:
    """Which row made the batch call raise: the first completion whose call alone raises the same exception type
    (the function is called again, one completion at a time, only on this failure path, each call under the same
    limits); the batch's rows when no single one does (a failure that needs the whole batch)."""
    for i, completion in enumerate(completions):
        def one(i: int = i, completion: str = completion) -> Any:
            return reward.fn(prompts[i:i + 1], [completion], **reward.args,
                             **{k: v[i:i + 1] for k, v in fields.items()})

        try:
            call_limited(one, timeout_s, stop, f"reward function {reward.name!r} (scoring {where(i)} alone)",
                         "grpo.reward_timeout_s")
        except (UserError, Interrupted):
            raise
        except Exception as e:  # noqa: BLE001 - the user's code, as above
            if type(e) is type(error):
                said = _text(completion)
                text = said if len(said) <= 60 else said[:57] + "..."
                return f"on a completion of {where(i)}: {text!r}"
    return f"on the completions of {where(0)} to {where(len(completions) - 1)}; no single one raises alone"


def total(per_function: dict[str, list[float]], weights: dict[str, float]) -> list[float]:
    """The weighted sum per completion (TRL's nansum): NaN only where every function gave None."""
    names = list(per_function)
    n = len(next(iter(per_function.values()))) if names else 0
    totals = []
    for i in range(n):
        values = [(per_function[k][i], weights.get(k, 1.0)) for k in names]
        scored = [v * w for v, w in values if not math.isnan(v)]
        totals.append(sum(scored) if scored else math.nan)
    return totals
