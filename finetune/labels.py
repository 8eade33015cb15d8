"""The label that means "no loss here": every masked token (prompts, padding, document starts) carries it.

-100 is the value PyTorch's cross_entropy ignores by default and transformers' models use, so our labels mean
the same thing to them as to our fused loss.
"""

from __future__ import annotations

from collections.abc import Iterable

IGNORE_INDEX = -100


def trained_count(labels: Iterable[int]) -> int:
    """How many of the labels are trained (not IGNORE_INDEX)."""
    return sum(1 for label in labels if label != IGNORE_INDEX)
