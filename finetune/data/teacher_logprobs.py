"""Offline distillation's teacher, stored in the dataset (distill.teacher_logprobs: FIELD; docs/distill.md): each
row's per-token top-k log-probabilities, read in Axolotl's KD layouts, checked, and kept for the row's trained tokens.

The field holds one entry per token position, aligned with the END of the row's tokens (Axolotl's rule: vLLM's prompt
log-probabilities have no entry for the first token, so a list one shorter than the tokens starts at the second). An
entry is null or [] (a position that is not trained needs none), or the token's top-k, either

    [{"token": "token_id:42", "logprob": -0.1}, ...]     Axolotl's first layout (vLLM's), or
    [-0.1, -2.3, ...]                                    its second, with the ids in the row's `target_token_ids`
                                                         field (one list of ints per position, the same shape).

Each trained token needs an entry, and every entry the same number of values; ids must be the tokenizer's, distinct,
and the probabilities sum to at most 1 (1 + SUM_SLACK: stored values are rounded). Kept in descending order, so a
smaller distill.top_k takes a prefix; the mass outside is the loss's tail bucket (finetune/loss/distill.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from finetune.data.sources import BadRow
from finetune.labels import IGNORE_INDEX, trained_count

# A sample's stored teacher: two arrays [trained tokens, k], in the order of the sample's trained tokens.
KEYS = ("teacher_ids", "teacher_logprobs")
IDS_FIELD = "target_token_ids"  # Axolotl's second layout keeps the ids here
SUM_SLACK = 1e-3  # how far above 1 a token's stored probabilities may sum (rounding); more is a bad row
_PREFIX = "token_id:"


@dataclass(slots=True)
class StoredTeacher:
    """A row's stored entries as read (a few checks of shape only: the tokens are not known yet): per position, None
    or (ids, log-probabilities)."""

    field: str
    positions: list[tuple[list[int], list[float]] | None]


def read_stored(origin: str, data: dict[str, Any], field: str) -> StoredTeacher:
    """The row's field as a StoredTeacher; BadRow for a missing or malformed one, naming the position."""
    raw = data.get(field)
    if not isinstance(raw, list):
        got = "missing" if raw is None else f"a {type(raw).__name__}"
        raise BadRow(f"{origin}: distill.teacher_logprobs: the field {field!r} is {got}; want a list with one entry "
                     "of top-k log-probabilities per token (docs/distill.md)")
    ids_by_position = data.get(IDS_FIELD)
    positions = []
    for p, entry in enumerate(raw):
        if entry is None or entry == []:
            positions.append(None)
        elif isinstance(entry, list) and all(isinstance(x, dict) for x in entry):
            positions.append(_first_layout(origin, field, p, entry))
        elif isinstance(entry, list):
            positions.append(_second_layout(origin, field, p, entry, ids_by_position, len(raw)))
        else:
            raise BadRow(f"{origin}: {field}[{p}] is a {type(entry).__name__}; want null or a list of top-k entries")
    return StoredTeacher(field, positions)


def _first_layout(origin: str, field: str, p: int, entry: list[dict]) -> tuple[list[int], list[float]]:
    ids, values = [], []
    for e in entry:
        token, value = e.get("token"), e.get("logprob")
        if not (isinstance(token, str) and token.startswith(_PREFIX) and token[len(_PREFIX):].isdigit()):
            raise BadRow(f"{origin}: {field}[{p}]: an entry's \"token\" is {token!r}; want \"token_id:N\"")
        ids.append(int(token[len(_PREFIX):]))
        values.append(_number(origin, field, p, value))
    return ids, values


def _second_layout(origin: str, field: str, p: int, entry: list, ids_by_position: Any,
                   n: int) -> tuple[list[int], list[float]]:
    if not isinstance(ids_by_position, list) or len(ids_by_position) != n:
        raise BadRow(f"{origin}: {field} holds bare log-probabilities, so the row's {IDS_FIELD!r} field must list "
                     f"their ids, one list per position ({n})")
    ids = ids_by_position[p]
    if not isinstance(ids, list) or len(ids) != len(entry) or not all(type(i) is int for i in ids):
        raise BadRow(f"{origin}: {IDS_FIELD}[{p}] must be a list of {len(entry)} ints, as {field}[{p}]")
    return ids, [_number(origin, field, p, v) for v in entry]


def _number(origin: str, field: str, p: int, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value > 1e-6:
        raise BadRow(f"{origin}: {field}[{p}]: a log-probability is {value!r}; want a number <= 0")
    return float(value)


def trained_entries(stored: StoredTeacher, labels: list[int], vocab: int, origin: str) -> dict[str, np.ndarray]:
    """The stored entries of the sample's trained tokens (labels not IGNORE_INDEX), sorted by descending
    probability, as {"teacher_ids": int32 [m, k], "teacher_logprobs": float32 [m, k]}; BadRow when the field does not
    fit the tokens, a trained token has no entry, entries differ in size, or an entry is not a distribution."""
    n, have, field = len(labels), len(stored.positions), stored.field
    if have > n:
        raise BadRow(f"{origin}: {field} has {have} positions but the row has {n} tokens: was the teacher given "
                     "other tokens than this tokenizer and chat template make?")
    start = n - have  # aligned with the end
    trained = [t for t in range(n) if labels[t] != IGNORE_INDEX]
    ids = np.zeros((len(trained), 0), np.int32)
    values = np.zeros((len(trained), 0), np.float32)
    for row, t in enumerate(trained):
        entry = stored.positions[t - start] if t >= start else None
        if entry is None:
            raise BadRow(f"{origin}: token {t} of {n} is trained, and {field} has no entry for it")
        if row == 0:
            k = len(entry[0])
            ids, values = np.zeros((len(trained), k), np.int32), np.zeros((len(trained), k), np.float32)
        ids[row], values[row] = _checked(entry, ids.shape[1], vocab, origin, f"{field}[{t - start}]")
    return {"teacher_ids": ids, "teacher_logprobs": values}


def _checked(entry: tuple[list[int], list[float]], k: int, vocab: int, origin: str,
             where: str) -> tuple[np.ndarray, np.ndarray]:
    ids, values = np.asarray(entry[0], np.int64), np.asarray(entry[1], np.float64)
    if len(ids) != k:
        raise BadRow(f"{origin}: {where} has {len(ids)} entries and the row's first trained token {k}: every token "
                     "needs the same number")
    if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != k:
        raise BadRow(f"{origin}: {where}: its ids must be distinct token ids below {vocab} (the tokenizer's), got "
                     f"{ids.tolist()[:8]}")
    if k >= vocab:
        raise BadRow(f"{origin}: {where}: {k} entries for a vocabulary of {vocab}; store fewer than all ids")
    mass = float(np.exp(values).sum())
    if mass > 1 + SUM_SLACK:
        raise BadRow(f"{origin}: {where}: its probabilities sum to {mass:.4f}, over 1: log-probabilities of one "
                     "distribution sum to at most 1")
    order = np.argsort(-values, kind="stable")
    return ids[order], values[order]


def kept_entries(sample: dict[str, Any], labels: Any) -> dict[str, Any]:
    """The stored teacher of a sample cut to `labels` (a prefix of its own): the entries of the trained tokens kept."""
    m = trained_count(labels)
    return {key: sample[key][:m] for key in KEYS if key in sample}
