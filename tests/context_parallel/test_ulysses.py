"""Ulysses attention (finetune/context_parallel/ulysses.py) on groups of 2 and 4 gloo ranks equals one process's attention, in
the output and in the query, key and value gradients, within 1e-6 (float32), on packed rows whose documents cross
the shard boundaries: MHA, GQA with kv heads split, and kv heads repeated where fewer than the ranks
(tests/ulysses_worker.py)."""

from __future__ import annotations

import pytest
from helpers import ROOT, run_ranks

pytestmark = pytest.mark.dist


def test_ulysses_equals_one_process():
    """4 ranks: one group of 4, then two groups of 2 side by side."""
    r = run_ranks(4, script=ROOT / "tests" / "ulysses_worker.py", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK")


def test_heads_that_do_not_divide_are_refused():
    from finetune.context_parallel.ulysses import check_heads

    check_heads(8, 4)
    with pytest.raises(ValueError, match="6 query heads do not divide by 4"):
        check_heads(6, 4)
