"""A torchrun worker for tests/context_parallel/test_ring.py: ring attention on N gloo ranks against one process's
attention over whole rows, on packed rows whose documents cross the chunk boundaries (one of them a single token);
every rank asserts its positions (ring_layout) of the output and of the query, key and value gradients, then rank 0
prints OK. Not collected by pytest (no test_ prefix).

Each case runs twice. In float64 (the ring then computes in float64) within 1e-12: the algorithm is exact, any
masking, merging or gradient-routing mistake shows orders of magnitude above that. In float32 within torch's float32
tolerance (rtol 1.3e-6, atol 1e-5), not 1e-6: here, with gradients up to ~10, one-process sdpa in float32 is itself
up to 2.4e-6 from the float64 answer and the ring up to 2.2e-6 (measured over 60 seeds), so two correct float32
computations summing in different orders differ by a few 1e-6."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from finetune.context_parallel.ring import ring_attention, ring_layout

# document lengths per row of 32 positions: chunks of 4 (4 ranks) or 8 (2 ranks); row 1 opens with a single token
DOCS = [[5, 4, 3, 9, 11], [1, 13, 1, 17], [32]]
APART = [[5, 4, 3, 9, 11]]  # one row: some chunk pairs share no document, and are skipped


def doc_ids(docs: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in docs])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, window: int | None,
           scaling: float | None) -> torch.Tensor:
    """Causal attention within each packed document (and the window: q - k < window), kv heads repeated for
    grouped queries, in one process over whole rows."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    same = ids[:, :, None] == ids[:, None, :]
    length = q.shape[2]
    behind = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    seen = (behind >= 0) & (behind < (window or length))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same & seen)[:, None], scale=scaling)


def check(heads: int, kv_heads: int, rank: int, ranks: int, group=None, window: int | None = None,
          docs: list[list[int]] = DOCS, scaling: float | None = None) -> None:
    for dtype, tolerance in ((torch.float64, (1e-12, 1e-12)), (torch.float32, (1.3e-6, 1e-5))):
        check_in(dtype, tolerance, heads, kv_heads, rank, ranks, group, window, docs, scaling)


def check_in(dtype: torch.dtype, tolerance: tuple[float, float], heads: int, kv_heads: int, rank: int, ranks: int,
             group, window: int | None, docs: list[list[int]], scaling: float | None) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + (window or 0))
    b, s, d = len(docs), sum(docs[0]), 8
    ids = doc_ids(docs)
    full = [torch.randn(b, h, s, d, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads)]
    weight = torch.randn(b, heads, s, d, generator=g, dtype=dtype)
    ref = [t.clone().requires_grad_(True) for t in full]
    out = attend(*ref, ids, window, scaling)
    (out * weight).sum().backward()
    mine_at = ring_layout(rank, ranks, s)
    mine = [t[:, :, mine_at].clone().requires_grad_(True) for t in full]
    got = ring_attention(*mine, ids, scaling=scaling, sliding_window=window, group=group)
    (got * weight[:, :, mine_at]).sum().backward()
    case = f"{dtype}, heads {heads}/{kv_heads}, window {window}, rank {rank} of {ranks}"
    rtol, atol = tolerance
    torch.testing.assert_close(got, out[:, :, mine_at].detach(), rtol=rtol, atol=atol, msg=lambda m: f"{case}: {m}")
    for name, a, want in zip("qkv", mine, ref):
        torch.testing.assert_close(a.grad, want.grad[:, :, mine_at], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{case}, d{n}: {m}")


def run(rank: int, ranks: int, group=None) -> None:
    for heads, kv_heads in ((4, 4), (4, 2), (4, 1), (6, 3)):  # MHA, GQA, one kv head, heads not divisible by 4
        check(heads, kv_heads, rank, ranks, group)
    check(4, 2, rank, ranks, group, window=3)  # a window shorter than the documents and than a chunk
    check(6, 2, rank, ranks, group, window=6, scaling=0.3)  # longer than a chunk (4 ranks), a scale of its own
    check(4, 2, rank, ranks, group, docs=APART)
    check(4, 1, rank, ranks, group, window=5, docs=APART)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    run(rank, ranks)
    if ranks == 4:  # and in groups of 2 within the 4 (context parallel 2 x data parallel 2), each group on its own
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        run(rank % 2, 2, pairs[rank // 2])
    dist.barrier()
    if rank == 0:
        print("OK")
    dist.destroy_process_group()
