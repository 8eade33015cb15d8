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

Why best-fit rather than first-fit decreasing, and how the (seed, epoch) determinism works: docs/design.md,
"Packing".
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "PackStats", "pack_samples"]


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
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
    kept, counts = _fit_samples(samples, max_seq_len, truncation)
    rng = _rng(seed, epoch)
    bins = _best_fit(kept, max_seq_len, rng)
    rng.shuffle(bins)  # row order changes per epoch; contents are fixed for this (seed, epoch)
    rows = [_row(kept, members) for members in bins]
    tokens = sum(len(r["input_ids"]) for r in rows)
    stats = PackStats(samples=len(samples), rows=len(rows), tokens=tokens,
                      target_tokens=sum(sum(1 for x in r["labels"] if x != IGNORE_INDEX) for r in rows),
                      truncated=counts["truncated"], dropped=counts["dropped"], capacity=len(rows) * max_seq_len,
                      input_tokens=counts["input_tokens"], truncated_tokens=counts["truncated_tokens"],
                      dropped_tokens=counts["dropped_tokens"])
    # Never lose a token silently: whatever is not in a row was counted as truncated or dropped.
    assert stats.input_tokens == tokens + stats.truncated_tokens + stats.dropped_tokens, stats
    return rows, stats


# A sample as it goes into rows: (input_ids, labels, the sample itself for its other fields).
Kept = tuple[list[int], list[int], dict]


def _fit_samples(samples: Sequence[dict], max_seq_len: int, truncation: str) -> tuple[list[Kept], dict[str, int]]:
    """The samples that go into rows, over-long ones truncated; and the counts of what was truncated or dropped
    (empty samples, over-long ones in "drop" mode). A preference pair (a sample with "docs") is fitted to
    max_seq_len when it is tokenized: it is never cut here, which would split it."""
    kept: list[Kept] = []
    counts = dict.fromkeys(("input_tokens", "truncated", "dropped", "truncated_tokens", "dropped_tokens"), 0)
    for i, sample in enumerate(samples):
        ids, labels = list(sample["input_ids"]), list(sample["labels"])
        if len(ids) != len(labels):
            # Data problem the user can fix (their tokenization/template step), not a bug here.
            raise UserError(
                f"sample {i}: input_ids has {len(ids)} tokens but labels has {len(labels)}; "
                "every tokenized sample needs one label per token (-100 where no loss)"
            )
        n = len(ids)
        counts["input_tokens"] += n
        if n == 0:
            counts["dropped"] += 1
            continue
        if n > max_seq_len and "docs" in sample:
            raise ValueError(f"sample {i}: a pair of {n} tokens does not fit max_seq_len {max_seq_len}")
        if n > max_seq_len:
            if truncation == "drop":
                counts["dropped"] += 1
                counts["dropped_tokens"] += n
                continue
            counts["truncated"] += 1
            counts["truncated_tokens"] += n - max_seq_len
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        kept.append((ids, labels, sample))
    return kept, counts


def _best_fit(kept: list[Kept], max_seq_len: int, rng: random.Random) -> list[list[int]]:
    """Rows as lists of sample indices: longest first, each into the row where it fits tightest."""
    # Ties broken by a seeded permutation so equal-length samples regroup per epoch.
    tie = list(range(len(kept)))
    rng.shuffle(tie)
    order = sorted(range(len(kept)), key=lambda k: (-len(kept[k][0]), tie[k]))
    # `free` is sorted by (free capacity, row index); the tightest row that still fits a sample of length n is
    # the first entry >= (n, -1). Full rows are removed (nothing fits in 0).
    bins: list[list[int]] = []  # sample indices per row, in placement order
    free: list[tuple[int, int]] = []
    for k in order:
        n = len(kept[k][0])
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            cap, row = free.pop(pos)
            bins[row].append(k)
        else:
            row = len(bins)
            bins.append([k])
            cap = max_seq_len
        cap -= n
        if cap > 0:
            bisect.insort(free, (cap, row))
    return bins


def _row(kept: list[Kept], members: list[int]) -> dict:
    """One packed row of the given samples, in order: positions restart at 0 for each document (a preference
    pair is two: its chosen and its rejected sequence, side by side, and the row lists its pair samples under
    "pairs")."""
    row: dict = {"input_ids": [], "labels": [], "position_ids": [], "doc_lengths": []}
    for k in members:
        ids, labels, sample = kept[k]
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
    return row
