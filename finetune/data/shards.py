"""Examples -> samples, in worker processes: chunks streamed through a process pool, each chunk's samples sent
back as flat arrays and delivered in input order, so the samples and the stats are exactly those of one serial pass.

A chunk is a list of examples, or a piece of a file that the worker reads itself (RowsToRead: samples.FileChunk,
lines of a JSONL file or a parquet batch), so that those rows are never made, converted or pickled in the main
process. `tokenize_chunk` is the serial pass
over one chunk (tokenize, then truncate or drop what is longer than max_seq_len, fit preference pairs, count
everything). `tokenize_stream` feeds chunks to the workers as they come from a reader (never more than a few per
worker in flight: memory does not grow with the input) and writes their samples to a sink, a list or the token
store's SplitWriter. A failure in a chunk (a bad row with `data.on_bad_row: error`, a template the tokenizer
refuses) is returned after the reader is drained: reading goes on, tokenizing stops, so an error found while reading
a later row is raised first, as when every row was read before any was tokenized. A worker's reading error comes
back with its chunk and is raised in input order.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from finetune.chat.spans import TemplateFacts, template_facts
from finetune.data.formats import Example
from finetune.data.images import ImageLayout, adopt, cut, layout_for
from finetune.data.pairs import PairExample, fit_pair, pair_sample, tokenize_pair, unfit_reason
from finetune.data.sources import BadRow
from finetune.data.stats import DataStats
from finetune.data.store import SplitWriter
from finetune.data.teacher_logprobs import KEYS as TEACHER_KEYS
from finetune.data.teacher_logprobs import trained_entries
from finetune.data.tokenize import render_ahead, tokenize_example
from finetune.labels import IGNORE_INDEX, trained_count
from finetune.recipe import DataConfig

# Below this many examples a process pool (starting it, sending examples out and samples back) costs more
# than tokenizing in this process.
PARALLEL_MIN_EXAMPLES = 256
CHUNK_EXAMPLES = 512  # examples (JSONL lines) per chunk sent to a worker: ~0.1-1 s of work, a few hundred kB each way
IN_FLIGHT_PER_WORKER = 3  # chunks queued per worker: enough to keep it busy, few enough to bound memory


def workers_for(data: DataConfig) -> int:
    """Processes that tokenize: data.num_proc, or every core this process may use."""
    if data.num_proc:
        return data.num_proc
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenize_chunk(examples: Sequence[Example], tokenizer: Any, data: DataConfig, stats: DataStats,
                   on_bad_row: str, template_kwargs: dict[str, Any], samples: Any, pair_end: str = "marker") -> Any:
    """Tokenize examples into `samples` (appended; returned), truncating or dropping what is longer than
    max_seq_len, and count everything in `stats`. Preference pairs' completions end at `pair_end` (data/pairs.py)."""
    notes: Counter[str] = Counter()
    facts = _template_facts(tokenizer, template_kwargs)
    for example, rendered in zip(examples, render_ahead(examples, tokenizer, template_kwargs, facts)):
        try:
            if isinstance(example, PairExample):
                sides = tokenize_pair(example, tokenizer, template_kwargs, notes, pair_end)
            else:
                sample = tokenize_example(example, tokenizer, template_kwargs, notes, rendered, facts)
                if example.teacher is not None:
                    sample.update(trained_entries(example.teacher, sample["labels"], len(tokenizer), example.origin))
        except BadRow as e:
            stats.bad_row(e, on_bad_row)
            continue
        if isinstance(example, PairExample):
            sample = _fitted_pair(example.origin, *sides, data, stats)
            if sample is not None:
                samples.append(sample if example.margin is None else {**sample, "margin": example.margin})
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
        stats.target_tokens += _targets(sample["labels"])
        samples.append(sample)
    stats.add_notes(notes)
    return samples


def _template_facts(tokenizer: Any, template_kwargs: dict[str, Any]) -> TemplateFacts | None:
    """What masking asks of the tokenizer, once for a chunk rather than once a row; None (each row finds them itself,
    and what fails there is that row's error) without a chat template, or when they cannot be found."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return template_facts(tokenizer, template_kwargs)
    except Exception:
        return None


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
    stats.target_tokens += _targets(chosen["labels"]) + _targets(rejected["labels"])
    return sample


def _targets(labels: list[int]) -> int:
    """Labels after the first that are not IGNORE_INDEX (list.count: a Python loop per token cost more)."""
    return max(0, len(labels) - 1 - labels[1:].count(IGNORE_INDEX))


@dataclass
class Part:
    """A chunk's samples as flat arrays (what a worker sends back: a few bytes per token to pickle, where lists of
    Python ints cost tens) and the chunk's stats."""

    ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    docs: np.ndarray | None
    stats: DataStats
    images: list[tuple[int, dict]] = field(default_factory=list)
    """The image entries of the samples that have images (their index in the chunk, the entry): without them a
    vision-language sample made by a worker would arrive as tokens with no image to fill them."""
    read: DataStats | None = None
    """The counts of reading the chunk's rows, when the worker read them (RowsToRead)."""
    read_error: Exception | None = None
    """Why the worker's reading stopped (a bad row under on_bad_row: error, an unreadable file): raised in input order
    by the parent, as if it had read the rows itself."""
    examples: int = 0
    """How many examples the chunk held."""
    teacher: tuple[np.ndarray, np.ndarray] | None = None
    """A stored teacher's entries (data/teacher_logprobs.py) of every sample's trained tokens, in order: ids, values."""
    margins: np.ndarray | None = None
    """Each pair's margin (its row's `margin` field; NaN without one), for preference pairs."""

    @classmethod
    def of(cls, samples: list[dict], stats: DataStats, read: DataStats | None = None,
           read_error: Exception | None = None, examples: int = 0) -> Part:
        lengths = np.fromiter((len(s["input_ids"]) for s in samples), dtype=np.int64, count=len(samples))
        total = int(lengths.sum())
        chain = itertools.chain.from_iterable
        ids = np.fromiter(chain(s["input_ids"] for s in samples), dtype=np.int32, count=total)
        labels = np.fromiter(chain(s["labels"] for s in samples), dtype=np.int32, count=total)
        docs = np.array([s["docs"] for s in samples], dtype=np.int64).reshape(-1, 2) \
            if samples and "docs" in samples[0] else None
        images = [(i, s["images"]) for i, s in enumerate(samples) if s.get("images")]
        teacher = tuple(np.concatenate([s[k] for s in samples]) for k in TEACHER_KEYS) \
            if samples and TEACHER_KEYS[0] in samples[0] else None
        margins = None if docs is None else np.array([s.get("margin", np.nan) for s in samples], dtype=np.float64)
        return cls(ids, labels, lengths, docs, stats, images, read, read_error, examples, teacher, margins)

    def deliver(self, out: Any) -> None:
        """Into a SplitWriter as arrays; into anything else (a list) as sample dicts."""
        if isinstance(out, SplitWriter):
            out.extend(self.ids, self.labels, self.lengths, self.docs, self.images, self.teacher, self.margins)
            return
        ends = np.cumsum(self.lengths).tolist()
        trained = 0
        ids, labels = self.ids.tolist(), self.labels.tolist()
        images = dict(self.images)
        for i, (start, end) in enumerate(zip([0, *ends], ends)):
            sample = {"input_ids": ids[start:end], "labels": labels[start:end]}
            if self.docs is not None:
                sample["docs"] = self.docs[i].tolist()
                if self.margins is not None and not np.isnan(self.margins[i]):
                    sample["margin"] = float(self.margins[i])
            if i in images:
                sample["images"] = images[i]
            if self.teacher is not None:
                m = trained_count(sample["labels"])
                sample.update(zip(TEACHER_KEYS, (a[trained:trained + m] for a in self.teacher)))
                trained += m
            out.append(sample)


_WORKER_TOKENIZER: Any = None  # set once per worker process by _init_worker
# How tokenizer workers start (_pool says why): fork on Linux, spawn elsewhere.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


def _init_worker(tokenizer: Any, layout: ImageLayout | None) -> None:
    # The tokenizer is handed over once per worker (initargs: inherited under fork, pickled under spawn), not
    # once per chunk. The recipe's chat template override is an attribute of it, so it travels too. A VLM's image
    # layout is attached to the parent's tokenizer object, which a spawned worker only has a copy of: attached
    # again here (under fork, to the same object).
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer
    if layout is not None:
        adopt(tokenizer, layout)
    # Each worker encodes one text at a time; the Rust thread pool would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # What the worker holds now (transformers, torch: ~200k objects) lives as long as it does: the collector need
    # not walk it on every full collection. Under fork the parent's frozen_heap came along already; this is for spawn.
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While preprocessing, the collector skips the objects that were alive before it (the imports, the
    tokenizer): each collection triggered by the rows' many small objects walked all of them, ~6% of tokenizing a
    row. They are handed back to it afterwards, so garbage among them is still collected."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@runtime_checkable
class RowsToRead(Protocol):
    """A chunk whose rows the tokenizing worker reads itself (samples.FileChunk), rows read already with their
    counts (samples.ReadRows), or one part's share of a FileChunk (samples.Kept, in a val_fraction split): `read`
    gives its examples and counts its rows in `stats` (a bad row raises or is skipped per on_bad_row; Kept counts
    nothing: its rows were counted by the split's first read); len() is its number of lines, rows or examples."""

    def __len__(self) -> int: ...

    def read(self, on_bad_row: str, stats: DataStats) -> list[Example]: ...


Chunk = Sequence[Example] | RowsToRead


def _examples_of(chunk: Chunk, on_bad_row: str, read: DataStats) -> Sequence[Example]:
    return chunk.read(on_bad_row, read) if isinstance(chunk, RowsToRead) else chunk


def _worker_chunk(chunk: Chunk, data: DataConfig, on_bad_row: str, template_kwargs: dict[str, Any], pair_end: str,
                  tokenize: bool = True) -> Part:
    """A chunk's samples (none when not `tokenize`: its rows are only read) and, for RowsToRead, its reading."""
    read = DataStats()
    try:
        examples = _examples_of(chunk, on_bad_row, read)
    except Exception as e:  # whatever stops the reading is raised in input order, as reading here would raise it
        return Part.of([], DataStats(), read, e)
    stats = DataStats()
    samples = tokenize_chunk(examples, _WORKER_TOKENIZER, data, stats, on_bad_row, template_kwargs, [], pair_end) \
        if tokenize else []
    return Part.of(samples, stats, read if isinstance(chunk, RowsToRead) else None, examples=len(examples))


def _pool(tokenizer: Any, workers: int) -> ProcessPoolExecutor:
    # fork on Linux: a spawned worker re-imports transformers, and with it torch, before it can unpickle the
    # tokenizer (measured 6-8 s per pool here: more than tokenizing 3000 examples serially takes). The usual
    # fork hazard, a lock held by another thread of the parent, does not reach these workers: they run Python
    # and the Rust tokenizer's single-text encode only (no OpenMP, no CUDA, no batch thread pool), and pyarrow's
    # to_pylist of a parquet batch, which uses no thread pool either.
    # macOS lists fork too, but its system libraries are not fork-safe: spawn there (START_METHOD).
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(START_METHOD),
                               initializer=_init_worker, initargs=(tokenizer, layout_for(tokenizer)))


def chunked(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Lists of `size` consecutive items (the last one shorter)."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


class Progress:
    """A line on stderr every `every` seconds once preprocessing has run that long: rows read, samples, and the
    rates so far."""

    def __init__(self, rows: Callable[[], int], every: float = 10.0) -> None:
        self.rows, self.every = rows, every
        self.start = self.last = time.perf_counter()
        self.samples = self.tokens = 0

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            seconds = now - self.start
            rows = self.rows()
            print(f"preprocessing: {rows:,} rows read, {self.samples:,} samples, {self.tokens:,} tokens in "
                  f"{seconds:.0f} s ({rows / seconds:,.0f} rows/s, {self.tokens / seconds:,.0f} tokens/s)",
                  file=sys.stderr, flush=True)


@dataclass
class Job:
    """How a stream's chunks are tokenized: the tokenizer, the data settings, and how bad rows are treated."""

    tokenizer: Any
    data: DataConfig
    on_bad_row: str
    template_kwargs: dict[str, Any]
    progress: Progress | None = None
    pair_end: str = "marker"  # where preference completions end (data/pairs.py completion_end)
    tokenize: bool = True
    """False: the chunks are only read, and `out` gets each chunk's number of examples (a val_fraction split's
    first pass, samples._split_in_workers)."""


def tokenize_stream(chunks: Iterable[Chunk], job: Job, stats: DataStats, out: Any, workers: int,
                    read_stats: DataStats | None = None) -> BaseException | None:
    """Tokenize every chunk into `out`, in order, adding each chunk's stats to `stats`, and the counts of reading
    the chunks that are RowsToRead to `read_stats`. With `workers` > 1 the chunks go to that many worker processes
    (started once the input proves large enough to pay for them). Returns the first failure of tokenizing (nothing
    after it is tokenized), after the chunks are drained; a failure of reading is raised, in input order. A job that
    does not tokenize only reads the chunks, and appends each one's number of examples to `out`."""
    read_stats = read_stats if read_stats is not None else DataStats()
    # Reading alone costs a tenth of tokenizing: a pool pays for itself at ten times the rows.
    enough = PARALLEL_MIN_EXAMPLES * (1 if job.tokenize else 10)
    iterator = _raising_in_place(chunks)
    head: list[Chunk | _Raised] = []
    while sum(map(len, head)) < enough and (chunk := next(iterator, None)) is not None:
        head.append(chunk)
    small = sum(map(len, head)) < enough
    rest = _after(head, iterator)
    with frozen_heap():
        if workers <= 1 or small:
            return _serial(rest, job, stats, out, read_stats)
        pool = _pool(job.tokenizer, workers)
        try:
            return _parallel(rest, job, stats, out, pool, workers, read_stats)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _after(head: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    """The head's items, each let go of once given (a parquet batch need not live as long as the stream), then the
    rest."""
    while head:
        yield head.pop(0)
    yield from rest


class _Raised:
    """What reading the input raised, in its place in the stream of chunks: the chunks before it are delivered first,
    so that a reading error of theirs (found by a worker) is the one raised, as one serial pass would raise it."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:
        return 0


def _raising_in_place(chunks: Iterable[Chunk]) -> Iterator[Chunk | _Raised]:
    iterator = iter(chunks)
    while True:
        try:
            chunk = next(iterator, None)
        except Exception as e:
            yield _Raised(e)
            return
        if chunk is None:
            return
        yield chunk


def _serial(chunks: Iterable[Chunk | _Raised], job: Job, stats: DataStats, out: Any,
            read_stats: DataStats) -> BaseException | None:
    failure = None
    for chunk in chunks:
        if isinstance(chunk, _Raised):
            raise chunk.error
        examples = _examples_of(chunk, job.on_bad_row, read_stats)
        if failure is not None:
            continue  # drained: reading goes on, so a later reading error still comes first
        if not job.tokenize:
            out.append(len(examples))
            continue
        part = DataStats()
        samples: list[dict] = []
        try:
            tokenize_chunk(examples, job.tokenizer, job.data, part, job.on_bad_row, job.template_kwargs, samples,
                           job.pair_end)
        except Exception as e:
            failure = e
            continue
        for sample in samples:
            out.append(sample)
        stats.add(part)
        if job.progress:
            job.progress.add(len(samples), sum(len(s["input_ids"]) for s in samples))
    return failure


def _parallel(chunks: Iterable[Chunk | _Raised], job: Job, stats: DataStats, out: Any, pool: ProcessPoolExecutor,
              workers: int, read_stats: DataStats) -> BaseException | None:
    pending: collections.deque[Future[Part]] = collections.deque()
    failure: BaseException | None = None

    def deliver(drain: bool) -> None:
        nonlocal failure
        while pending and (drain or len(pending) > workers * IN_FLIGHT_PER_WORKER or pending[0].done()):
            try:
                part = pending.popleft().result()
            except Exception as e:  # the first failure in input order: what a serial pass would raise
                failure = failure or e
                continue
            if part.read is not None:
                read_stats.add(part.read)
            if part.read_error is not None:
                raise part.read_error
            if failure is None and not job.tokenize:
                out.append(part.examples)
            elif failure is None:  # after a failure, chunks are only read
                part.deliver(out)
                stats.add(part.stats)
                if job.progress:
                    job.progress.add(len(part.lengths), int(part.lengths.sum()))

    for chunk in chunks:
        if isinstance(chunk, _Raised):
            deliver(drain=True)  # a chunk before it may hold an unreadable row: that one is raised first
            raise chunk.error
        if failure is not None and not isinstance(chunk, RowsToRead):
            continue  # drained: reading goes on, so a later reading error still comes first
        pending.append(pool.submit(_worker_chunk, chunk, job.data, job.on_bad_row, job.template_kwargs,
                                   job.pair_end, failure is None and job.tokenize))
        deliver(drain=False)
    deliver(drain=True)
    return failure
