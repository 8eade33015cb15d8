"""Packed rows of random documents and tiny models to run them through: shared by the packing, attention and
packed-kernel tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from finetune.data.collate import collate_packed
from finetune.data.pack import pack_samples

VOCAB = 64


def tiny_model(config_cls: type, impl: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    # The guard must hold with the config's own default, which is the leaky one.
    assert config.use_cache is True
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=dtype).eval()


def packed_batch() -> tuple[list[dict], dict, list[tuple[int, int, list[int], list[int]]]]:
    """Two packed rows of different lengths (23 and 12 tokens) from five random documents."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in (7, 11, 5, 9, 3):
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        samples.append({"input_ids": ids, "labels": ids})
    rows, _ = pack_samples(samples, 23, seed=0)
    batch = collate_packed(rows, pad_token_id=0)
    assert batch.padded_tokens > batch.seq_tokens  # the short row really is padded
    spans = []  # (row, start, input_ids, original labels)
    for r, row in enumerate(rows):
        start = 0
        for n in row["doc_lengths"]:
            ids = row["input_ids"][start : start + n]
            spans.append((r, start, ids, next(s["labels"] for s in samples if s["input_ids"] == ids)))
            start += n
    return rows, batch, spans


def packed_vs_alone(model: torch.nn.Module, **kwargs) -> float:
    _, batch, spans = packed_batch()
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids, **kwargs).logits
        error = 0.0
        for r, start, ids, _ in spans:
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            error = max(error, (packed[r, start : start + len(ids)] - alone).abs().max().item())
    return error
