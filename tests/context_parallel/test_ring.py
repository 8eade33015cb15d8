"""Ring attention (finetune/context_parallel/ring.py) on groups of 2 and 4 gloo ranks equals one process's attention
over whole rows, in the output and in the query, key and value gradients (1e-12 in float64, float32 within its
tolerance: tests/ring_worker.py says why not 1e-6), on packed rows
whose documents cross the chunk boundaries: MHA, GQA, one kv head, query heads that do not divide by the ranks,
sliding windows (tests/ring_worker.py). And the zigzag layout: every position once, the causal work balanced."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, run_ranks

from finetune.context_parallel.ring import check_length, ring_layout

pytestmark = pytest.mark.dist


def _ring(ranks: int) -> None:
    r = run_ranks(ranks, script=ROOT / "tests" / "ring_worker.py", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK")


def test_ring_equals_one_process_on_4_ranks():
    """4 ranks: one group of 4, then two groups of 2 side by side."""
    _ring(4)


def test_ring_equals_one_process_on_2_ranks():
    _ring(2)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_layout_covers_every_position_once_and_balances_causal_work(ranks):
    length = 2 * ranks * 5
    layouts = [ring_layout(r, ranks, length) for r in range(ranks)]
    assert all(t.dtype == torch.int64 and t.shape == (length // ranks,) for t in layouts)
    assert torch.equal(torch.cat(layouts).sort().values, torch.arange(length))
    # causal pairs (q, k <= q) of each rank's queries: q + 1 keys each
    assert len({int((t + 1).sum()) for t in layouts}) == 1
    assert ring_layout(1, 4, 16).tolist() == [2, 3, 12, 13]


def test_bad_length_is_refused():
    check_length(16, 4)
    with pytest.raises(ValueError, match="a row of 12 positions does not divide by 8"):
        check_length(12, 4)
    with pytest.raises(ValueError, match="does not divide by 8"):
        ring_layout(0, 4, 20)


def test_document_ids_from_the_documents_spans():
    from finetune.batch import Documents
    from finetune.context_parallel.ring import document_ids

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    ids = document_ids(Documents.of(positions).spans, 12)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4], [0] * 6 + [1] * 6]


@pytest.mark.parametrize("window", [None, 5])
def test_tiles_of_queries_give_the_whole_blocks_attention(monkeypatch, window):
    """One process (a ring of one): a block's scores built a few queries at a time (TILE_ELEMENTS small, as a long
    row's blocks are) give one process's document-masked attention and its gradients, to 1e-12 in float64."""
    import torch.nn.functional as F

    from finetune.context_parallel import ring

    g = torch.Generator().manual_seed(0)
    spans = [[(0, 7), (7, 8), (8, 16)], [(0, 16)]]
    doc = torch.tensor([[d for d, (s, e) in enumerate(row) for _ in range(s, e)] for row in spans])
    q, k, v = (torch.randn(2, h, 16, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (6, 3, 3))
    weight = torch.randn(2, 6, 16, 4, generator=g, dtype=torch.float64)
    pos = torch.arange(16)
    seen = (doc[:, :, None] == doc[:, None, :]) & (pos[:, None] >= pos[None, :])
    if window:
        seen &= pos[:, None] - pos[None, :] < window
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=seen[:, None])
    want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v))
    monkeypatch.setattr(ring, "TILE_ELEMENTS", 2 * 3 * 2 * 8 * 3)  # 3 queries a tile of the 8-position chunks
    assert ring._query_tiles(q.reshape(2, 3, 2, 16, 4)[:, :, :, :8], 8) == 3
    got = ring.ring_attention(q, k, v, doc, sliding_window=window)
    grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
