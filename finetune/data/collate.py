"""Micro-batches as tensors: packed rows (position ids per document, no attention mask), padded samples, or a
micro-batch's samples end to end in one row (padding-free)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from finetune.batch import MicroBatch, PairFields, RolloutFields, StoredTeacherFields
from finetune.data.pack import packed_row
from finetune.data.pixels import vision_fields
from finetune.data.teacher_logprobs import KEYS as TEACHER_KEYS
from finetune.labels import IGNORE_INDEX, trained_count
from finetune.recipe import DataConfig


def collate_padded(samples: Sequence[dict], pad_token_id: int, pad_to_multiple_of: int | None = None) -> MicroBatch:
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
    return MicroBatch(ids, labels, targets=_targets(labels), seq_tokens=int(mask.sum()), padded_tokens=ids.numel(),
                      attention_mask=mask)


def collate_packed(rows: Sequence[dict], pad_token_id: int) -> MicroBatch:
    """Stack packed rows into [b, L] tensors, L = the longest row of this micro-batch.

    Shorter rows are padded at the end with ``pad_token_id``, labels -100 and position_ids 0..p-1, so
    the padding is one more isolated "document" (its restart at 0 ends the last real document). No
    attention_mask is returned on purpose: passing one would turn off transformers' packed-sequence
    detection. The model must be called with ``use_cache=False``.
    Its counts: ``seq_tokens`` (real tokens) and ``padded_tokens`` (b * L).
    """
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    width = max(len(r["input_ids"]) for r in rows)
    input_ids: list[list[int]] = []
    labels: list[list[int]] = []
    position_ids: list[list[int]] = []
    seq_tokens = 0
    for r in rows:
        n = len(r["input_ids"])
        p = width - n
        seq_tokens += n
        input_ids.append(list(r["input_ids"]) + [pad_token_id] * p)
        labels.append(list(r["labels"]) + [IGNORE_INDEX] * p)
        position_ids.append(list(r["position_ids"]) + list(range(p)))
    label_tensor = torch.tensor(labels, dtype=torch.long)
    return MicroBatch(torch.tensor(input_ids, dtype=torch.long), label_tensor, targets=_targets(label_tensor),
                      seq_tokens=seq_tokens, padded_tokens=len(rows) * width,
                      position_ids=torch.tensor(position_ids, dtype=torch.long))


def _targets(labels: torch.Tensor) -> int:
    """Tokens that carry a loss after the shift (position t scores label t + 1)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def collate_flat(samples: Sequence[dict], pad_token_id: int) -> MicroBatch:
    """A padding-free micro-batch (data.padding_free): its samples end to end in one row, each a document, as
    `packed_row` lays them (positions restart at 0; each document's first label, which no position scores in a padded
    row, is ignored, so that the previous document's last token learns nothing across the boundary). The same tokens
    and targets as collate_padded of the same samples, none of the padding."""
    row = packed_row(samples, range(len(samples)), max(len(s["input_ids"]) for s in samples))
    return collate_packed([row], pad_token_id)


def collate(rows: Sequence[dict], data: DataConfig, pad_token_id: int, flat: bool = False) -> MicroBatch:
    """One micro-batch: packed rows (no attention mask, position ids per document), padded, or with `flat` (the
    run's padding-free choice, train/padding_free.py; packing off) the samples end to end in one row.

    `targets` counts the tokens that carry a loss after the shift (what N_step sums). A filler micro-batch (see
    rank_micro_batches) is computed, so its tokens count as padded tokens, but it is no data: its seq_tokens are 0.
    Preference pairs also get their documents numbered (`pairs.doc_index`, chosen 2i, rejected 2i+1; pair_fields);
    rows with images get their pixels (`vision`, finetune/data/pixels.py).
    """
    filler = bool(rows and rows[0].get("filler"))
    pairs = bool(rows) and ("pairs" in rows[0] or "docs" in rows[0])
    if pairs and not data.packing:
        rows = [doc for sample in rows for doc in split_pair(sample)]  # a pair is two padded rows
    if data.packing:
        batch = collate_packed(rows, pad_token_id)
    elif flat and not pairs:
        batch = collate_flat(rows, pad_token_id)
    else:
        batch = collate_padded(rows, pad_token_id, data.pad_to_multiple_of)
    batch.filler = filler
    if filler:
        batch.seq_tokens = 0
    if pairs:
        batch.pairs = pair_fields(rows, batch.labels, data.packing, filler)
    if rows and "rollout" in rows[0]:
        batch.rollouts = rollout_fields(rows, batch.labels, filler)
    if rows and TEACHER_KEYS[0] in rows[0]:
        batch.teacher = stored_teacher(rows, batch.targets)
    batch.vision = vision_fields(rows, batch.input_ids)  # images loaded and processed here, never cached
    return batch


def stored_teacher(rows: Sequence[dict], targets: int) -> StoredTeacherFields:
    """A stored teacher's entries at the micro-batch's targets, in their order (row by row, each row's trained
    tokens in order; a filler's labels are all ignored, so it has none)."""
    columns: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for r in rows:
        m = trained_count(r["labels"])
        for column, key in zip(columns, TEACHER_KEYS):
            value = r[key]  # a packed row: a list, its documents' arrays
            column.append((np.concatenate(value) if isinstance(value, list) else value)[:m])
    ids, values = (np.concatenate(column) for column in columns)
    if len(ids) != targets:
        raise ValueError(f"a stored teacher's {len(ids)} entries for {targets} target tokens")
    return StoredTeacherFields(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(values.astype(np.float32)))


def split_pair(sample: dict) -> list[dict]:
    """A preference sample's chosen and rejected sequences as two samples (the first keeps the pair, whose
    reference log-probabilities are read when it is collated)."""
    (n_chosen, _), ids, labels = sample["docs"], sample["input_ids"], sample["labels"]
    chosen = {"input_ids": ids[:n_chosen], "labels": labels[:n_chosen], "pair": sample}
    rejected = {"input_ids": ids[n_chosen:], "labels": labels[n_chosen:]}
    return [{**chosen, "filler": sample.get("filler")}, {**rejected, "filler": sample.get("filler")}]


def pair_fields(rows: Sequence[dict], labels: torch.Tensor, packed: bool, filler: bool) -> PairFields:
    """The pairs of a preference micro-batch: each position's document, how many pairs, the chosen documents'
    target tokens, the reference's log-probabilities (zeros until they are computed) and the pairs' margins."""
    doc_index = torch.full(labels.shape, -1, dtype=torch.long)
    lengths = [r["doc_lengths"] for r in rows] if packed else [[len(r["input_ids"])] for r in rows]
    doc = 0
    for i, row_docs in enumerate([] if filler else lengths):
        start = 0
        for length in row_docs:
            doc_index[i, start:start + length] = doc
            doc, start = doc + 1, start + length
    pairs = [pair for r in rows for pair in r.get("pairs", [])] if packed else [r["pair"] for r in rows if "pair" in r]
    refs = [] if filler else [pair.get("ref_logps") for pair in pairs]
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # position t scores label t + 1
    chosen = scored & (doc_index >= 0) & (doc_index % 2 == 0)
    ref_logps = torch.tensor([ref if ref is not None else (0.0, 0.0) for ref in refs], dtype=torch.float64)
    given = not filler and any("margin" in pair for pair in pairs)  # a reward model's margins (the data's field)
    margins = torch.tensor([pair.get("margin", 0.0) for pair in pairs], dtype=torch.float64) if given else None
    return PairFields(doc_index, doc // 2, int(chosen.sum()), ref_logps.reshape(-1, 2), margins)


def rollout_fields(rows: Sequence[dict], labels: torch.Tensor, filler: bool) -> RolloutFields:
    """The completions of an RL micro-batch (padded rows, one completion each; see finetune/rl/rollout.py)."""
    seq_index = torch.full(labels.shape, -1, dtype=torch.long)
    old = torch.full(labels.shape, float("nan"), dtype=torch.float64)
    sampling = torch.full(labels.shape, float("nan"), dtype=torch.float64)
    scored_at = torch.zeros_like(labels, dtype=torch.bool)
    scored_at[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # position t scores label t + 1
    advantages, scored = [], []
    for i, row in enumerate([] if filler else rows):
        info = row["rollout"]
        seq_index[i, :len(row["input_ids"])] = i
        advantages.append(info["advantage"])
        scored.append(int(scored_at[i].sum()))
        start = info["prompt_length"] - 1  # completion token j is scored at prompt_length - 1 + j
        for values, into in ((info["logprobs"], old), (info.get("sampling"), sampling)):
            if values is not None and scored[-1]:
                into[i, start:start + len(values)] = torch.tensor(values, dtype=torch.float64)
    return RolloutFields(seq_index, torch.tensor(advantages, dtype=torch.float64), old, scored, sampling)
