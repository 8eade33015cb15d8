"""A torchrun worker for tests/context_parallel/test_ulysses.py: Ulysses attention on N gloo ranks against the same
attention in one process, on packed rows whose documents cross the shard boundaries; every rank asserts its shard
of the output and of the query, key and value gradients within 1e-6 (float32), then rank 0 prints OK.
Not collected by pytest (no test_ prefix)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from finetune.context_parallel.ulysses import ulysses_attention

DOCS = [[5, 4, 3, 4], [7, 9], [16]]  # document lengths per row of 16 positions: shards of 8 (2 ranks) or 4 (4)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention within each packed document of DOCS, kv heads repeated for grouped queries."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in DOCS])
    same = ids[:, :, None] == ids[:, None, :]
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same & causal)[:, None])


def check(heads: int, kv_heads: int, rank: int, ranks: int, group=None) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, s, d = len(DOCS), 16, 8
    full = [torch.randn(b, h, s, d, generator=g) for h in (heads, kv_heads, kv_heads)]
    weight = torch.randn(b, heads, s, d, generator=g)
    ref = [t.clone().requires_grad_(True) for t in full]
    out = attend(*ref)
    (out * weight).sum().backward()
    shard = slice(rank * s // ranks, (rank + 1) * s // ranks)
    mine = [t[:, :, shard].clone().requires_grad_(True) for t in full]
    got = ulysses_attention(attend, *mine, group=group)
    (got * weight[:, :, shard]).sum().backward()
    torch.testing.assert_close(got, out[:, :, shard].detach(), rtol=1e-6, atol=1e-6)
    for name, a, want in zip("qkv", mine, ref):
        torch.testing.assert_close(a.grad, want.grad[:, :, shard], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    for heads, kv_heads in ((4, 4), (4, 2), (4, 1), (8, 2)):  # MHA, GQA split, GQA repeated (fewer kv heads than ranks)
        check(heads, kv_heads, rank, ranks)
    if ranks == 4:  # and in groups of 2 within the 4 (context parallel 2 x data parallel 2), each group on its own
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for heads, kv_heads in ((4, 2), (4, 1)):
            check(heads, kv_heads, rank % 2, 2, pairs[rank // 2])
    dist.barrier()
    if rank == 0:
        print("OK")
    dist.destroy_process_group()
