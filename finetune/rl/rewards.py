"""Reward functions: the built-ins and the user's own (`module.path:function`), and their weighted total.

A reward function is called once per batch of rollouts as f(prompts, completions, **fields) -> one float per
completion (None: no opinion), where `fields` holds every other field of the prompt rows as lists, one entry per
completion (TRL's calling convention, so a function written for TRL's GRPOTrainer works unchanged).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.errors import UserError
from finetune.recipe import RewardConfig

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
    return [1.0 if _same(extract_answer(c), want) else 0.0 for c, want in zip(completions, fields[field])]


def format_regex(prompts: list, completions: list[str], pattern: str = "", **fields: Any) -> list[float | None]:
    """1.0 when the whole completion matches `pattern` (re.fullmatch, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(c.strip()) else 0.0 for c in completions]


def length(prompts: list, completions: list[str], target: int = 100, scale: float = 100.0,
           **fields: Any) -> list[float | None]:
    """-|characters - target| / scale: a completion near `target` characters scores highest (0)."""
    return [-abs(len(c) - target) / scale for c in completions]


BUILT_INS: dict[str, RewardFn] = {"exact_answer": exact_answer, "format_regex": format_regex, "length": length}


def load_function(spec: str) -> RewardFn:
    """A built-in by name, or `module.path:function` imported from the user's code."""
    if spec in BUILT_INS:
        return BUILT_INS[spec]
    if ":" not in spec:
        raise UserError(f"grpo.rewards: unknown reward function {spec!r}; built-ins: {', '.join(BUILT_INS)}, "
                        "or module.path:function from your code")
    module_name, name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"grpo.rewards: cannot import {module_name!r} for {spec!r}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"grpo.rewards: {module_name!r} has no function {name!r}")
    return fn


@dataclass
class Reward:
    """One configured reward function."""

    name: str
    weight: float
    fn: RewardFn
    args: dict[str, Any]


def load_rewards(configs: Sequence[RewardConfig]) -> list[Reward]:
    names = [c.label for c in configs]
    if len(set(names)) != len(names):
        raise UserError(f"grpo.rewards: two reward functions share a name ({names}); give each a `name`")
    return [Reward(c.label, c.weight, load_function(c.function), dict(c.args)) for c in configs]


def score(rewards: Sequence[Reward], prompts: list, completions: list[str], fields: dict[str, list],
          where: Callable[[int], str]) -> dict[str, list[float]]:
    """Each function's rewards (NaN for None) by name. A function that raises, or returns the wrong number of
    values or a non-finite one, is a UserError naming it and the row (`where(i)`: the prompt's file:line)."""
    out: dict[str, list[float]] = {}
    for reward in rewards:
        try:
            values = reward.fn(prompts, completions, **reward.args, **fields)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: any failure is reported with its name
            raise UserError(f"reward function {reward.name!r} raised {type(e).__name__}: {e} "
                            f"({_culprit(reward, e, prompts, completions, fields, where)})") from e
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise UserError(f"reward function {reward.name!r} returned {len(values)} values for "
                            f"{len(completions)} completions")
        for i, v in enumerate(values):
            if v is not None and (not isinstance(v, int | float) or not math.isfinite(v)):
                raise UserError(f"reward function {reward.name!r} returned {v!r} for {where(i)}: rewards are "
                                "finite numbers or None")
        out[reward.name] = [math.nan if v is None else float(v) for v in values]
    return out


def _culprit(reward: Reward, error: Exception, prompts: list, completions: list[str], fields: dict[str, list],
             where: Callable[[int], str]) -> str:
    """Which row made the batch call raise: the first completion whose call alone raises the same exception type
    (the function is called again, one completion at a time, only on this failure path); the batch's rows when no
    single one does (a failure that needs the whole batch)."""
    for i, completion in enumerate(completions):
        try:
            reward.fn(prompts[i:i + 1], [completion], **reward.args, **{k: v[i:i + 1] for k, v in fields.items()})
        except Exception as e:  # noqa: BLE001 - the user's code, as above
            if type(e) is type(error):
                text = completion if len(completion) <= 60 else completion[:57] + "..."
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
