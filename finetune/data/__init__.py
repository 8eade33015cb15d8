"""Data: recipe datasets -> tokenized samples -> each epoch's rows -> each optimizer step's micro-batches.

A plain re-export. Where things are: sources.py reads rows, formats.py turns them into examples (messages.py
reads one chat message), tokenize.py masks one example (chat/spans.py, chat/regions.py, chat/turns.py and
chat/shapes.py locate its turns), samples.py builds all samples (stats.py counts what happened), pack.py packs them
into rows, batching.py deals rows to steps and ranks, collate.py makes tensors, store.py keeps samples as flat arrays
on disk (memory-mapped), cache.py keys and checks those stores, and report.py prints what `finetune preprocess` shows.
"""

from finetune.data.batching import StepPlan, epoch_rows, eval_rows, rank_micro_batches, steps_in
from finetune.data.collate import collate, collate_packed, collate_padded
from finetune.data.samples import PARALLEL_MIN_EXAMPLES, build_samples, load_examples, tokenize_examples
from finetune.data.stats import DataStats

__all__ = [
    "PARALLEL_MIN_EXAMPLES", "DataStats", "StepPlan", "build_samples", "collate", "collate_packed", "collate_padded",
    "epoch_rows", "eval_rows", "load_examples", "rank_micro_batches", "steps_in", "tokenize_examples",
]
