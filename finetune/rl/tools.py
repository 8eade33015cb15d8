"""Tools the policy may call in a multi-turn rollout (grpo.tools, and an environment's public methods): their JSON
schemas for the chat template, and one call's result (docs/rl.md, "Tools and environments").

A tool is a Python function with type hints and a docstring; its schema is transformers' own (get_json_schema), the
one `apply_chat_template(tools=[fn])` would write. A call follows TRL's conventions, so that tools written for TRL run
unchanged: the result is `str(result)`; an exception, a call to a name not offered, or a call past
grpo.tool_timeout_s becomes the result `{'error': '...'}` (str of the dict, as TRL writes it) and is counted
(tool_errors, tool_timeouts). A result longer than grpo.tool_result_max_tokens is cut to it, keeping its head or its
tail (counted in tool_results_cut). Each call runs in the main thread under rl/deadline.py's watcher, so the run's
stop request ends a hung call at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from finetune.errors import Interrupted, UserError
from finetune.rl.deadline import Timeout, call_limited


@dataclass(frozen=True)
class Tool:
    """One tool: its name (the function's), the callable, and its JSON schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


def tool_of(fn: Callable[..., Any], key: str) -> Tool:
    """A Tool from a function or bound method; a UserError naming `key` when its schema cannot be made (type hints
    and a docstring with an Args section are what transformers reads)."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException, ...
        raise UserError(f"{key}: {getattr(fn, '__qualname__', fn)!r} cannot be offered as a tool: "
                        f"{type(e).__name__}: {e} (a tool needs type hints and a docstring with an Args: section; "
                        "transformers.utils.get_json_schema reads them)") from None
    return Tool(fn.__name__, fn, schema)


def environment_tools(instance: Any, key: str) -> list[Tool]:
    """An environment instance's public methods but reset and get_reward (found on its class, as TRL does, so a
    property is never evaluated)."""
    names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
             if not n.startswith("_") and n not in ("reset", "get_reward")]
    return [tool_of(getattr(instance, n), f"{key} method {n}") for n in names]


@dataclass
class CallCounts:
    """What the calls of a batch of rollouts came to (the step's tool figures)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    cut: int = 0
    seconds: float = 0.0
    by_rollout: list[int] = field(default_factory=list)


def run_call(tools: Mapping[str, Tool], call: Mapping[str, Any], timeout_s: float | None,
             stop: Callable[[], bool], counts: CallCounts) -> str:
    """The text of one call's result (TRL's conventions: the module docstring)."""
    function = call.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments") or {}
    counts.calls += 1
    tool = tools.get(name)
    if tool is None:
        counts.errors += 1
        return str({"error": f"Tool {name} not found."})
    try:
        value = call_limited(lambda: tool.fn(**arguments), timeout_s, stop, f"tool {name!r}", "grpo.tool_timeout_s")
    except Interrupted:
        raise
    except Timeout:
        counts.timeouts += 1
        counts.errors += 1
        return str({"error": f"Tool {name} did not return within {timeout_s:g} s."})
    except Exception as e:  # noqa: BLE001 - the user's tool: any failure is its result, as TRL gives it
        counts.errors += 1
        return str({"error": str(e)})
    return str(value)


def capped(text: str, tokenizer: Any, most: int | None, keep: str, counts: CallCounts) -> str:
    """`text` cut to `most` tokens (of the tokenizer, alone), keeping its head or its tail, with a note of the cut."""
    if most is None:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= most:
        return text
    counts.cut += 1
    kept = tokenizer.decode(ids[:most] if keep == "head" else ids[-most:])
    note = f"[... {len(ids) - most} tokens cut]"
    return f"{kept} {note}" if keep == "head" else f"{note} {kept}"


def load_tools(recipe: Any) -> list[Tool]:
    """grpo.tools imported (with the user's consent: recipe/code.py) and made Tools."""
    from finetune.recipe import code

    refs = {ref.key: ref for ref in code.references(recipe)}
    if recipe.grpo.tools:
        code.require_consent(recipe)
    tools = [tool_of(code.import_ref(refs[f"grpo.tools.{i}"]), f"grpo.tools.{i}") for i in range(len(recipe.grpo.tools))]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise UserError(f"grpo.tools: two tools share a name ({names}): the policy calls a tool by its name")
    return tools


def load_environment(recipe: Any) -> tuple[Callable[[], Any] | None, list[Tool]]:
    """grpo.environment's class (with the user's consent) and the tools one instance of it offers (found on a probe
    instance, as TRL's trainer does, for the prompts' rendering): (None, []) without one."""
    from finetune.recipe import code

    if not recipe.grpo.environment:
        return None, []
    code.require_consent(recipe)
    ref = next(r for r in code.references(recipe) if r.key == "grpo.environment")
    cls = code.import_ref(ref)
    try:
        probe = cls()
    except Exception as e:  # noqa: BLE001 - the user's class: a failure to make one names it
        raise UserError(f"grpo.environment {ref.spec!r}: making an instance raised {type(e).__name__}: {e}") from e
    if not callable(getattr(probe, "reset", None)):
        raise UserError(f"grpo.environment {ref.spec!r} has no reset(**row) method (TRL's environment_factory "
                        "classes define one)")
    return cls, environment_tools(probe, "grpo.environment")
