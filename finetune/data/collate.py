"""Micro-batches as tensors: dynamic padding for unpacked samples (packed rows: see pack.collate_packed)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from finetune.data.tokenize import IGNORE_INDEX


def collate_padded(samples: Sequence[dict], pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict:
    """Right-pad samples to the longest in the micro-batch (rounded up to `pad_to_multiple_of`).

    Padding carries label -100 and attention_mask 0, so it changes neither the loss nor the gradient.
    """
    longest = max(len(s["input_ids"]) for s in samples)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for i, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[i, :n] = torch.tensor(sample["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.tensor(sample["labels"], dtype=torch.long)
        mask[i, :n] = 1
    seq_tokens = int(mask.sum())
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "seq_tokens": seq_tokens, "padded_tokens": ids.numel()}
