"""Recipe datasets -> tokenized samples: read rows, turn them into examples, hold out a validation split,
tokenize (in parallel when asked), truncate or drop over-long samples; everything counted in DataStats.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from finetune.data.formats import Example, MessageFields, to_example
from finetune.data.images import cut
from finetune.data.pairs import (
    PairExample,
    PairFields,
    completion_end,
    fit_pair,
    pair_sample,
    to_pair,
    tokenize_pair,
    unfit_reason,
)
from finetune.data.sources import BadRow, read_rows
from finetune.data.stats import DataStats
from finetune.data.tokenize import tokenize_example
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.recipe import DataConfig, DatasetConfig, Recipe, local_data_path


def load_examples(configs: Sequence[DatasetConfig], on_bad_row: str, stats: DataStats,
                  key: str = "datasets", data: DataConfig | None = None) -> list[Example]:
    """Read and convert every row of the given datasets; bad rows raise or are counted per `on_bad_row`.

    `key` is the recipe list the configs come from: a problem with a whole source (missing file, unreadable
    hub dataset) is reported as `datasets.N.path: ...`, a problem with one row by its `file:line`. `data` gives
    max_row_bytes and ignore_message_fields (their defaults when None).
    """
    data = data or DataConfig()
    examples = []
    for index, cfg in enumerate(configs):
        taken = 0
        try:
            for row in read_rows(cfg.path, split=cfg.split, name=cfg.name, max_row_bytes=data.max_row_bytes):
                if cfg.max_rows is not None and taken >= cfg.max_rows:
                    break
                stats.rows_read += 1
                try:
                    examples.append(row_example(row, cfg, tuple(data.ignore_message_fields)))
                    taken += 1
                except BadRow as e:
                    stats.bad_row(e, on_bad_row)
        except BadRow:
            raise  # already names its file:line
        except UserError as e:  # the source as a whole: name the recipe key too
            raise UserError(f"{key}.{index}.path: {e}") from None
    return examples


def row_example(row: Any, cfg: DatasetConfig, ignore: tuple[str, ...] = ()) -> Example | PairExample:
    """One row of a dataset as its format reads it, through the dataset's field and role mappings (message fields
    in `ignore` left out)."""
    local = local_data_path(cfg.path)  # image paths are relative to the data file
    fields = MessageFields(cfg.role_field, cfg.content_field, tuple(cfg.role_map.items()), cfg.system_field, ignore,
                           str(local.parent) if local is not None else None)
    if cfg.format == "preference":
        return to_pair(row, PairFields(cfg.prompt_field, cfg.chosen_field, cfg.rejected_field, fields))
    return to_example(row, cfg.format, messages_field=cfg.messages_field, text_field=cfg.text_field,
                      train_on_inputs=cfg.train_on_inputs, roles_to_train=tuple(cfg.roles_to_train), fields=fields,
                      prompt_template=cfg.prompt_template)


# Below this many examples a process pool (starting it, sending examples out and samples back) costs more
# than tokenizing in this process.
PARALLEL_MIN_EXAMPLES = 256


def tokenize_examples(examples: Sequence[Example], tokenizer: Any, data: DataConfig, stats: DataStats,
                      on_bad_row: str = "error", template_kwargs: Mapping[str, Any] | None = None,
                      pair_end: str = "marker") -> list[dict]:
    """Tokenize (chat templates rendered with `template_kwargs`; preference pairs' completions up to `pair_end`,
    data/pairs.py), then truncate or drop samples longer than max_seq_len (counted in stats).

    With `data.num_proc > 1` the examples are tokenized by that many worker processes, in contiguous chunks
    whose results are put back in order: the samples and the stats are exactly those of one serial pass.
    """
    kwargs = dict(template_kwargs or {})
    if data.num_proc > 1 and len(examples) >= PARALLEL_MIN_EXAMPLES:
        return _tokenize_parallel(examples, tokenizer, data, stats, on_bad_row, kwargs, pair_end)
    return _tokenize_serial(examples, tokenizer, data, stats, on_bad_row, kwargs, pair_end)


def _tokenize_serial(examples: Sequence[Example], tokenizer: Any, data: DataConfig, stats: DataStats,
                     on_bad_row: str, template_kwargs: dict[str, Any], pair_end: str = "marker") -> list[dict]:
    samples = []
    notes: Counter[str] = Counter()
    for example in examples:
        try:
            if isinstance(example, PairExample):
                sides = tokenize_pair(example, tokenizer, template_kwargs, notes, pair_end)
            else:
                sample = tokenize_example(example, tokenizer, template_kwargs, notes)
        except BadRow as e:
            stats.bad_row(e, on_bad_row)
            continue
        if isinstance(example, PairExample):
            sample = _fitted_pair(example.origin, *sides, data, stats)
            if sample is not None:
                samples.append(sample)
            continue
        n = len(sample["input_ids"])
        stats.input_tokens += n
        if data.max_seq_len is not None and n > data.max_seq_len:
            if data.truncation == "drop":
                stats.drop(example.origin, n, f"{n} tokens, over data.max_seq_len {data.max_seq_len} "
                                              "(data.truncation: drop)")
                continue
            sample, why = cut(sample, data.max_seq_len)  # None when the cut falls inside an image's tokens
            if sample is None:
                stats.drop(example.origin, n, why)
                continue
            stats.truncated += 1
            stats.truncated_tokens += n - data.max_seq_len
        if not sample["input_ids"]:
            stats.drop(example.origin, 0, "no tokens")
            continue
        stats.samples += 1
        stats.tokens += len(sample["input_ids"])
        stats.target_tokens += sum(1 for x in sample["labels"][1:] if x != IGNORE_INDEX)
        samples.append(sample)
    stats.add_notes(notes)
    return samples


def _fitted_pair(origin: str, chosen: dict, rejected: dict, data: DataConfig, stats: DataStats) -> dict | None:
    """A pair within data.max_seq_len (cut from its longer completion, or dropped per data.truncation), counted;
    a dropped pair is named by its row's origin."""
    n = len(chosen["input_ids"]) + len(rejected["input_ids"])
    stats.input_tokens += n
    fitted = fit_pair(chosen, rejected, data.max_seq_len)
    if fitted is None or (fitted[2] and data.truncation == "drop"):
        stats.drop(origin, n, unfit_reason(chosen, rejected, data.max_seq_len, data.truncation))
        return None
    chosen, rejected, cut = fitted
    if cut:
        stats.truncated += 1
        stats.truncated_tokens += cut
    sample = pair_sample(chosen, rejected)
    stats.samples += 1
    stats.tokens += len(sample["input_ids"])
    stats.target_tokens += sum(1 for side in (chosen, rejected) for x in side["labels"][1:] if x != IGNORE_INDEX)
    return sample


_WORKER_TOKENIZER: Any = None  # set once per worker process by _init_worker


def _init_worker(tokenizer: Any) -> None:
    # The tokenizer is handed over once per worker (initargs: inherited under fork, pickled under spawn), not
    # once per chunk. The recipe's chat template override is an attribute of it, so it travels too.
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer
    # Each worker encodes one text at a time; the Rust thread pool would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _tokenize_chunk(examples: Sequence[Example], data: DataConfig, on_bad_row: str,
                    template_kwargs: dict[str, Any], pair_end: str) -> tuple[list[dict], DataStats]:
    stats = DataStats()
    return _tokenize_serial(examples, _WORKER_TOKENIZER, data, stats, on_bad_row, template_kwargs, pair_end), stats


def _tokenize_parallel(examples: Sequence[Example], tokenizer: Any, data: DataConfig, stats: DataStats,
                       on_bad_row: str, template_kwargs: dict[str, Any], pair_end: str) -> list[dict]:
    # A few chunks per worker evens out chunks of unequal cost (long conversations cluster in files).
    size = -(-len(examples) // (data.num_proc * 4))
    chunks = [examples[i: i + size] for i in range(0, len(examples), size)]
    # fork on Linux: a spawned worker re-imports transformers, and with it torch, before it can unpickle the
    # tokenizer (measured 6-8 s per pool here: more than tokenizing 3000 examples serially takes). The usual
    # fork hazard, a lock held by another thread of the parent, does not reach these workers: they run Python
    # and the Rust tokenizer's single-text encode only (no OpenMP, no CUDA, no batch thread pool).
    # macOS lists fork too, but its system libraries are not fork-safe: spawn there.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    context = multiprocessing.get_context(method)
    pool = ProcessPoolExecutor(max_workers=min(data.num_proc, len(chunks)), mp_context=context,
                               initializer=_init_worker, initargs=(tokenizer,))
    samples: list[dict] = []
    try:
        # map yields in chunk order, so the first bad row raised is the one a serial pass would raise.
        for part, part_stats in pool.map(_tokenize_chunk, chunks, itertools.repeat(data),
                                         itertools.repeat(on_bad_row), itertools.repeat(template_kwargs),
                                         itertools.repeat(pair_end)):
            samples.extend(part)
            stats.add(part_stats)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return samples


def build_samples(recipe: Recipe, tokenizer: Any) -> tuple[list[dict], list[dict], DataStats, DataStats]:
    """Train and eval samples for a recipe: eval from eval_datasets, else a seeded val_fraction split."""
    train_stats, eval_stats = DataStats(), DataStats()
    on_bad = recipe.data.on_bad_row
    train_examples = load_examples(recipe.datasets, on_bad, train_stats, "datasets", recipe.data)
    eval_examples = load_examples(recipe.eval_datasets, on_bad, eval_stats, "eval_datasets", recipe.data)
    if not recipe.eval_datasets and recipe.data.val_fraction > 0:
        order = list(range(len(train_examples)))
        random.Random(recipe.seed).shuffle(order)
        n_val = max(1, round(len(order) * recipe.data.val_fraction))
        if order and n_val >= len(order):
            raise UserError(f"data.val_fraction: {recipe.data.val_fraction} of {len(order)} training rows leaves "
                            "none to train on; lower it, or give eval_datasets")
        held = set(order[:n_val])
        eval_examples = [e for i, e in enumerate(train_examples) if i in held]
        train_examples = [e for i, e in enumerate(train_examples) if i not in held]
    kwargs, end = recipe.tokenizer.chat_template_kwargs, completion_end(recipe)
    train = tokenize_examples(train_examples, tokenizer, recipe.data, train_stats, on_bad, kwargs, end)
    evals = tokenize_examples(eval_examples, tokenizer, recipe.data, eval_stats, on_bad, kwargs, end)
    paths = ", ".join(d.path for d in recipe.datasets)
    if not train:
        raise UserError(f"datasets: no training samples in {paths}: {train_stats.rows_read} rows read, "
                        f"{train_stats.bad_rows_skipped} bad rows skipped, {train_stats.dropped_too_long} "
                        "dropped as too long (see data.on_bad_row, data.truncation)"
                        + "".join(f"\n  dropped: {e}" for e in train_stats.dropped_examples[:1]))
    if train_stats.target_tokens == 0:
        raise UserError(f"datasets: the training data ({paths}) has no target tokens (every label is masked): "
                        "nothing would be learned. Check the format and data.max_seq_len (truncation may cut "
                        "every answer off), or set train_on_inputs: true.")
    return train, evals, train_stats, eval_stats

