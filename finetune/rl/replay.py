"""The replay file: rollouts read from JSON lines instead of generated (grpo.replay; docs/rl.md, "The replay file").

One line per completion: `group` (a JSON scalar; a group's lines are consecutive, exactly num_generations of them),
`prompt_ids` or `prompt` (messages or text, rendered with the recipe's chat template and its generation prompt),
`completion_ids` (used exactly as given) or `completion` (text, tokenized without special tokens), `reward` (the
total) or `rewards` (name -> value, weighted by the recipe's reward weights; null: unscored), optional `logprobs`
(the sampling policy's, one per completion token). Any bad line is a UserError naming file:line, including a prompt
the chat template refuses and text the tokenizer cannot encode (a lone surrogate from a JSON `\\ud800` escape).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from finetune.chat.spans import render_chat
from finetune.data.tokenize import encode
from finetune.errors import UserError
from finetune.rl.prompts import prompt_messages
from finetune.rl.rewards import total
from finetune.rl.rollout import Rollout

KNOWN = {"group", "prompt", "prompt_ids", "completion", "completion_ids", "reward", "rewards", "logprobs", "env_mask"}


def read_replay(path: str | Path, tokenizer: Any, group_size: int, weights: dict[str, float],
                template_kwargs: dict[str, Any] | None = None) -> list[Rollout]:
    """Every rollout of the file, checked: ids inside the vocabulary, whole consecutive groups, finite rewards."""
    path = Path(path)
    try:
        # "\n" only, as JSON lines are: str.splitlines would also split inside a string at U+2028, U+0085, ...
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"grpo.replay: cannot read {path}: {e}") from e
    vocab = len(tokenizer)
    rollouts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        rollouts.append(_rollout(_object(line, where), where, tokenizer, vocab, weights, template_kwargs))
    if not rollouts:
        raise UserError(f"grpo.replay: {path} holds no rollouts")
    _check_groups(rollouts, group_size)
    return rollouts


def _object(line: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg})") from e
    except RecursionError:  # valid JSON nested past the depth Python's reader can follow
        raise UserError(f"{where}: JSON nested too deeply to read (past Python's recursion limit)") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: a rollout is a JSON object, not {type(obj).__name__}")
    unknown = sorted(set(obj) - KNOWN)
    if unknown:
        raise UserError(f"{where}: unknown field(s) {unknown}; a rollout has {sorted(KNOWN)}")
    if "group" not in obj or isinstance(obj["group"], dict | list):
        raise UserError(f"{where}: `group` (a string or number naming the prompt's group) is required")
    return obj


def _ids(value: Any, name: str, where: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise UserError(f"{where}: {name} must be a list of token ids")
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise UserError(f"{where}: {name} holds id {bad[0]}, outside the tokenizer's vocabulary of {vocab}")
    return value


def _prompt_ids(obj: dict, where: str, tokenizer: Any, vocab: int, template_kwargs: dict | None) -> list[int]:
    if "prompt_ids" in obj:
        return _ids(obj["prompt_ids"], "prompt_ids", where, vocab)
    prompt = obj.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt_messages(prompt, where)  # SFT's rule for messages, as prompt datasets have
        try:
            prompt = render_chat(tokenizer, prompt, template_kwargs, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own error, for this line
            why = f"{type(e).__name__}: {e}".encode("utf-8", "backslashreplace").decode("utf-8")
            raise UserError(f"{where}: the chat template cannot render the prompt ({why})") from None
    if not isinstance(prompt, str) or not prompt:
        raise UserError(f"{where}: give prompt_ids, or prompt (text or messages)")
    return _tokens(tokenizer, prompt, where)


def _tokens(tokenizer: Any, text: str, where: str) -> list[int]:
    """The text's ids without added special tokens; text the tokenizer cannot encode is an error naming the line."""
    return encode(tokenizer, where, text, add_special_tokens=False)["input_ids"]


def _completion_ids(obj: dict, where: str, tokenizer: Any, vocab: int) -> list[int]:
    if "completion_ids" in obj:
        ids = _ids(obj["completion_ids"], "completion_ids", where, vocab)
    elif isinstance(obj.get("completion"), str):
        ids = _tokens(tokenizer, obj["completion"], where)
    else:
        raise UserError(f"{where}: give completion_ids, or completion (text)")
    if not ids:
        raise UserError(f"{where}: the completion is empty (a sampled completion has at least its end token)")
    return ids


def _rewards(obj: dict, where: str, weights: dict[str, float]) -> tuple[dict[str, float], float]:
    if ("reward" in obj) == ("rewards" in obj):
        raise UserError(f"{where}: give `reward` (the total) or `rewards` (name -> value), one of them")
    given = {"reward": obj["reward"]} if "reward" in obj else obj["rewards"]
    if not isinstance(given, dict):
        raise UserError(f"{where}: rewards is an object of name -> value")
    if "rewards" in obj and weights:
        unknown = sorted(set(given) - set(weights))
        if unknown:
            raise UserError(f"{where}: rewards {unknown} are not among grpo.rewards ({sorted(weights)})")
    values = {}
    for name, v in given.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)):
            raise UserError(f"{where}: reward {name!r} is {v!r}; rewards are finite numbers or null")
        values[name] = math.nan if v is None else float(v)
    return values, total({k: [v] for k, v in values.items()}, weights if "rewards" in obj else {})[0]


def _rollout(obj: dict, where: str, tokenizer: Any, vocab: int, weights: dict[str, float],
             template_kwargs: dict | None) -> Rollout:
    prompt_ids = _prompt_ids(obj, where, tokenizer, vocab, template_kwargs)
    completion_ids = _completion_ids(obj, where, tokenizer, vocab)
    rewards, reward = _rewards(obj, where, weights)
    env_mask = _env_mask(obj.get("env_mask"), len(completion_ids), where)
    logprobs = _logprobs(obj.get("logprobs"), env_mask or [1] * len(completion_ids), where)
    return Rollout(obj["group"], prompt_ids, completion_ids, rewards, reward, logprobs, where, env_mask=env_mask)


def _env_mask(value: Any, n: int, where: str) -> list[int] | None:
    """A multi-turn line's env_mask: one 1 (sampled by the policy) or 0 (written by the environment) per completion
    token, at least one 1. TRL pads a short mask with 1s and trains what the environment wrote; here any other
    length is refused."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(x) is int and x in (0, 1) for x in value):
        raise UserError(f"{where}: env_mask must be a list of 0 and 1 (1: a token the policy sampled, 0: one the "
                        "environment wrote), one per completion token")
    if len(value) != n:
        raise UserError(f"{where}: env_mask has {len(value)} entries for a completion of {n} tokens; one per "
                        "completion token (a shorter mask would train the environment's tokens)")
    if not any(value):
        raise UserError(f"{where}: env_mask marks no completion token as sampled by the policy: nothing to train")
    return [int(x) for x in value]


def _logprobs(value: Any, sampled: list[int], where: str) -> list[float] | None:
    """The sampling policy's log-probability of each completion token: a finite number <= 0 for each token the
    policy sampled; a token the environment wrote may have null (never read: it carries no loss)."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == len(sampled) and all(
        (x is None and not mine) or (isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                                     and x <= 0) for x, mine in zip(value, sampled))
    if not ok:
        raise UserError(f"{where}: logprobs must be {len(sampled)} finite numbers <= 0, one per completion token "
                        "(null allowed where env_mask is 0)")
    return [0.0 if x is None else float(x) for x in value]


def _check_groups(rollouts: list[Rollout], group_size: int) -> None:
    """A group's lines are consecutive and number exactly group_size; a group name is not used twice."""
    seen: set = set()
    i = 0
    while i < len(rollouts):
        group = rollouts[i].group
        if json.dumps(group) in seen:
            raise UserError(f"{rollouts[i].where}: group {group!r} appears again after other groups; a group's "
                            "lines are consecutive")
        seen.add(json.dumps(group))
        j = i
        while j < len(rollouts) and rollouts[j].group == group:
            j += 1
        if j - i != group_size:
            raise UserError(f"{rollouts[i].where}: group {group!r} has {j - i} completions; grpo.num_generations "
                            f"is {group_size}")
        i = j


def row_limit(recipe: Any, lm: Any) -> tuple[int, str] | None:
    """The most tokens a rollout's row (prompt + completion) may hold, and what sets it: data.max_seq_len, or the
    model's position limit (max_position_embeddings) when that is lower or the only one; None when neither is set."""
    limits = []
    if recipe.data.max_seq_len is not None:
        limits.append((recipe.data.max_seq_len, "data.max_seq_len"))
    positions = getattr(getattr(lm, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits.append((positions, "the model's position limit (max_position_embeddings)"))
    return min(limits) if limits else None


def fitting(rollouts: list[Rollout], limit: tuple[int, str] | None, on_bad_row: str, group_size: int,
            max_new_tokens: int | None = None) -> tuple[list[Rollout], int]:
    """The rollouts within the limits generated ones keep, checked as generated rows are: a completion of at most
    `max_new_tokens` (grpo.max_new_tokens: the whole multi-turn completion, as TRL's max_completion_length) and a
    row (prompt + completion) within `limit`. A line over either stops the run naming it (data.on_bad_row: error),
    or its whole group is skipped and counted (skip: advantages are group-relative, so a group is used whole or not
    at all). Returns the rollouts kept and the number of lines skipped."""
    kept: list[Rollout] = []
    for start in range(0, len(rollouts), group_size):
        group = rollouts[start:start + group_size]
        problem = next((p for r in group if (p := _over(r, limit, max_new_tokens)) is not None), None)
        if problem is None:
            kept.extend(group)
        elif on_bad_row == "error":
            raise UserError(f"{problem}. Fix the line, or set data.on_bad_row: skip to skip its group (counted)")
    return kept, len(rollouts) - len(kept)


def _over(rollout: Rollout, limit: tuple[int, str] | None, max_new_tokens: int | None) -> str | None:
    """Why `rollout` is over a limit a generated one keeps (None when it is within them)."""
    n_prompt, n_completion = len(rollout.prompt_ids), len(rollout.completion_ids)
    if max_new_tokens is not None and n_completion > max_new_tokens:
        return (f"{rollout.where}: the completion is {n_completion} tokens, over grpo.max_new_tokens "
                f"({max_new_tokens}), which a generated one never passes (the `constant` normalizer counts it)")
    if limit is not None and n_prompt + n_completion > limit[0]:
        return (f"{rollout.where}: the rollout is {n_prompt + n_completion} tokens (prompt {n_prompt} + completion "
                f"{n_completion}), over {limit[1]} ({limit[0]}); it would train on a row the model is not trained "
                "for")
    return None
