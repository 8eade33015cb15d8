"""Sample packing: several tokenized samples per row, best-fit decreasing, deterministic per (seed, epoch).

A packed row concatenates whole documents and records where each starts: ``position_ids`` restart at 0 for
every document (and ``doc_lengths`` lists them). What keeps the documents apart is the attention, not this
module: the collator passes no attention_mask, and the model's attention takes the documents from the position
restarts (``attn_implementation: auto`` runs attention one document at a time, finetune/attention/dispatch.py;
transformers' sdpa/eager build a block-diagonal mask from the same restarts). ``finetune.model.isolation`` proves it
on the real model before a packed run trains.

Labels stay unshifted (the loss shifts: position t predicts ``labels[t + 1]``), so the last token of document
A would be trained to predict the first token of document B; to keep every target inside its own document, the
first label of every document is set to -100. In an unpacked row that label is never a target anyway (nothing
precedes it), so packing trains exactly the same targets.

Packing needs the samples' lengths only (`plan_packing`: the token store's length array, never the tokens); a
row's tokens are read when the row is (`packed_row`), so an epoch's plan is two arrays of sample indices.

Why best-fit rather than first-fit decreasing, and how the (seed, epoch) determinism works: docs/design.md,
"Packing".
"""

from __future__ import annotations

import array
import bisect
import hashlib
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from finetune.data.store import pair_flags, sample_lengths, target_counts
from finetune.data.teacher_logprobs import KEYS as TEACHER_KEYS
from finetune.data.teacher_logprobs import kept_entries
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "PackPlan", "PackStats", "pack_samples", "packed_row", "plan_packing"]


@dataclass
class PackStats:
    """What packing did. Token identity: input_tokens == tokens + truncated_tokens + dropped_tokens."""

    samples: int  # samples given to pack_samples (including empty/dropped ones)
    rows: int  # packed rows produced
    tokens: int  # tokens in the packed rows
    target_tokens: int  # labels != -100 in the packed rows that the shifted loss trains on
    truncated: int  # samples cut to max_seq_len ("truncate" mode)
    dropped: int  # samples left out: empty ones, and over-long ones in "drop" mode
    capacity: int  # rows * max_seq_len
    # The token counts behind the identity above, so that "never drop a token silently" is checkable.
    input_tokens: int = 0
    truncated_tokens: int = 0  # tokens cut off the end of truncated samples
    dropped_tokens: int = 0  # tokens of dropped samples

    @property
    def efficiency(self) -> float:
        """Fraction of the row capacity (rows * max_seq_len) holding real tokens."""
        return self.tokens / self.capacity if self.capacity else 0.0


def _rng(seed: int, epoch: int) -> random.Random:
    # A stable digest rather than hash((seed, epoch)): identical on every rank, process and Python.
    digest = hashlib.sha256(f"finetune.pack:{int(seed)}:{int(epoch)}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass
class PackPlan:
    """An epoch's packed rows as sample indices: row r is samples members[starts[r]:starts[r + 1]], in that
    order, each cut to max_seq_len; `counts` says what was truncated or dropped (PackStats' fields)."""

    members: np.ndarray
    starts: np.ndarray
    max_seq_len: int
    counts: dict[str, int]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def row(self, r: int) -> np.ndarray:
        """The sample indices of row r."""
        return self.members[self.starts[r]:self.starts[r + 1]]

    @property
    def tokens(self) -> int:
        return self.counts["input_tokens"] - self.counts["truncated_tokens"] - self.counts["dropped_tokens"]


def pack_samples(
    samples: Sequence[dict],
    max_seq_len: int,
    *,
    seed: int,
    epoch: int = 0,
    truncation: Literal["truncate", "drop"] = "truncate",
) -> tuple[list[dict], PackStats]:
    """Pack tokenized samples into rows of at most ``max_seq_len`` tokens with best-fit decreasing.

    Each sample is ``{"input_ids": list[int], "labels": list[int]}`` (equal lengths, unshifted labels,
    -100 = no loss). Returns rows ``{"input_ids", "labels", "position_ids", "doc_lengths"}`` (lists)
    and a :class:`PackStats`. A sample is never split across rows; over-long samples are truncated to
    their first ``max_seq_len`` tokens or dropped (``truncation``); empty samples are dropped.
    """
    plan = plan_packing(checked_lengths(samples), pair_flags(samples), max_seq_len, seed=seed, epoch=epoch,
                        truncation=truncation)
    rows = [packed_row(samples, plan.row(r), max_seq_len) for r in range(len(plan))]
    stats = pack_stats(plan, len(samples), sum(sum(1 for x in r["labels"] if x != IGNORE_INDEX) for r in rows))
    # Never lose a token silently: whatever is not in a row was counted as truncated or dropped.
    assert stats.tokens == sum(len(r["input_ids"]) for r in rows), stats
    return rows, stats


def pack_stats(plan: PackPlan, n_samples: int, target_tokens: int) -> PackStats:
    """What a plan did, with the target tokens of its rows (counted by the caller)."""
    c = plan.counts
    return PackStats(samples=n_samples, rows=len(plan), tokens=plan.tokens, target_tokens=target_tokens,
                     truncated=c["truncated"], dropped=c["dropped"], capacity=len(plan) * plan.max_seq_len,
                     input_tokens=c["input_tokens"], truncated_tokens=c["truncated_tokens"],
                     dropped_tokens=c["dropped_tokens"])


def plan_stats(samples: Sequence[dict], plan: PackPlan) -> PackStats:
    """A plan's PackStats without building its rows: target tokens from the samples' labels, per document."""
    targets = target_counts(samples, plan.max_seq_len)
    return pack_stats(plan, len(samples), int(targets[plan.members].sum()))


def checked_lengths(samples: Sequence[dict]) -> np.ndarray:
    """The samples' lengths; a sample whose labels do not match its tokens one to one is the user's error."""
    for i, sample in enumerate(samples if isinstance(samples, list) else ()):  # the store checked its own
        if len(sample["input_ids"]) != len(sample["labels"]):
            # Data problem the user can fix (their tokenization/template step), not a bug here.
            raise UserError(
                f"sample {i}: input_ids has {len(sample['input_ids'])} tokens but labels has "
                f"{len(sample['labels'])}; every tokenized sample needs one label per token (-100 where no loss)"
            )
    return sample_lengths(samples)


def plan_packing(lengths: np.ndarray, pairs: np.ndarray, max_seq_len: int, *, seed: int, epoch: int = 0,
                 truncation: str = "truncate") -> PackPlan:
    """Which samples share each row, from their lengths alone (and which are preference pairs, never cut: a
    pair is fitted to max_seq_len when it is tokenized)."""
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > max_seq_len
    if np.any(over & pairs):
        i = int(np.flatnonzero(over & pairs)[0])
        raise ValueError(f"sample {i}: a pair of {lengths[i]} tokens does not fit max_seq_len {max_seq_len}")
    cut = over & (truncation == "truncate")
    dropped = (lengths == 0) | (over & (truncation == "drop"))
    counts = {"input_tokens": int(lengths.sum()), "truncated": int(cut.sum()), "dropped": int(dropped.sum()),
              "truncated_tokens": int((lengths[cut] - max_seq_len).sum()),
              "dropped_tokens": int(lengths[dropped].sum())}
    kept = np.flatnonzero(~dropped)
    rng = _rng(seed, epoch)
    order, row, n_rows = _best_fit(np.minimum(lengths[kept], max_seq_len), max_seq_len, rng)
    # Row order changes per epoch; contents are fixed for this (seed, epoch). The rows' new order is drawn as
    # shuffling a list of them would draw it (the same calls), so plans are what they were when rows were lists.
    shuffled = array.array("q", range(n_rows))
    rng.shuffle(shuffled)
    rank = np.empty(n_rows, dtype=np.int64)
    rank[np.frombuffer(shuffled, dtype=np.int64)] = np.arange(n_rows)
    key = rank[row]
    members = kept[order[np.argsort(key, kind="stable")]]  # each row's samples stay in placement order
    starts = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(key, minlength=n_rows), out=starts[1:])
    return PackPlan(members, starts, max_seq_len, counts)


# Samples placed per block: their lengths and rows are Python lists one block at a time, never for the corpus
# (10M samples as Python ints held ~1.2 GB).
_BLOCK = 1 << 16


def _best_fit(lengths: np.ndarray, max_seq_len: int,
              rng: random.Random) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions in `lengths` in placement order, the row each goes to, how many rows), rows numbered as they
    open: longest
    first, each into the row where it fits tightest (the least free capacity that holds it; of equal ones, the
    row opened first)."""
    # Ties broken by a seeded permutation so equal-length samples regroup per epoch (an array, shuffled with the
    # same draws as a list: the same permutation in 8 bytes a sample).
    tie = array.array("q", range(len(lengths)))
    rng.shuffle(tie)
    order = np.lexsort((np.frombuffer(tie, dtype=np.int64), -lengths)) if len(tie) else np.zeros(0, np.int64)
    del tie
    row_of = np.empty(len(order), dtype=np.int64)
    # Rows with free capacity c wait in by_free[c], a heap of row indices; `caps` lists the capacities that have
    # any, sorted. The tightest row for a sample of length n: the first row of the first capacity >= n.
    by_free: list[list[int]] = [[] for _ in range(max_seq_len + 1)]
    caps: list[int] = []
    opened = 0
    for first in range(0, len(order), _BLOCK):
        rows = []
        for n in lengths[order[first:first + _BLOCK]].tolist():
            pos = bisect.bisect_left(caps, n)
            if pos < len(caps):
                cap = caps[pos]
                row = heapq.heappop(by_free[cap])
                if not by_free[cap]:
                    caps.pop(pos)
            else:
                row, cap, opened = opened, max_seq_len, opened + 1
            rows.append(row)
            cap -= n
            if cap > 0:  # a full row takes nothing more
                if not by_free[cap]:
                    bisect.insort(caps, cap)
                heapq.heappush(by_free[cap], row)
        row_of[first:first + len(rows)] = rows
    return order, row_of, opened


def packed_row(samples: Sequence[dict], members: Sequence[int], max_seq_len: int) -> dict:
    """One packed row of the given samples (indices), in order, each cut to max_seq_len: positions restart at 0
    for each document (a preference pair is two: its chosen and its rejected sequence, side by side, and the row
    lists its pair samples under "pairs"; a vision-language sample's image entry goes, in order, into the row's
    "images" list)."""
    row: dict = {"input_ids": [], "labels": [], "position_ids": [], "doc_lengths": []}
    for k in members:
        sample = samples[int(k)]
        ids, labels = list(sample["input_ids"][:max_seq_len]), list(sample["labels"][:max_seq_len])
        start = 0
        for length in sample.get("docs", [len(ids)]):
            row["input_ids"].extend(ids[start:start + length])
            # First label of each document -> -100: with the loss's shift it is the target of the previous
            # document's last token, which must not learn across the boundary.
            row["labels"].append(IGNORE_INDEX)
            row["labels"].extend(labels[start + 1:start + length])
            row["position_ids"].extend(range(length))  # restart at 0: this is what marks the document boundary
            row["doc_lengths"].append(length)
            start += length
        if "docs" in sample:  # the sample itself: its reference log-probabilities may be attached later
            row.setdefault("pairs", []).append(sample)
        if sample.get("images"):  # each document's images, in row order: collate lists their pixels in that order
            row.setdefault("images", []).append(sample["images"])
        if TEACHER_KEYS[0] in sample:  # a stored teacher's entries of the trained tokens kept, in row order
            for key, value in kept_entries(sample, labels).items():
                row.setdefault(key, []).append(value)
    return row
