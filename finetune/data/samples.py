"""Recipe datasets -> tokenized samples: read rows as a stream, turn them into examples, hold out a validation
split, tokenize (in worker processes: shards.py, which read a JSONL or parquet dataset's rows themselves:
FileChunk), truncate or drop over-long samples; everything counted in DataStats.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import itertools
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from finetune.data.dedup import Seen, seen_for
from finetune.data.formats import Example, MessageFields, to_example
from finetune.data.image_files import DEFAULT_MAX_IMAGE_PIXELS
from finetune.data.pairs import PairExample, PairFields, completion_end, to_pair
from finetune.data.shards import (
    CHUNK_EXAMPLES,
    PARALLEL_MIN_EXAMPLES,
    Chunk,
    Job,
    Progress,
    RowsToRead,
    chunked,
    tokenize_chunk,
    tokenize_stream,
    workers_for,
)
from finetune.data.sources import BadRow, LineSpan, ParquetBatch, file_spans, read_rows
from finetune.data.stats import DataStats
from finetune.errors import UserError
from finetune.recipe import DataConfig, DatasetConfig, Recipe, local_data_path

# A parquet batch larger than this (decoded) is made into rows here rather than sent to a worker: up to
# workers x IN_FLIGHT_PER_WORKER chunks wait for one, and rows of images can make a batch hundreds of MB.
PARQUET_WORKER_BYTES = 8 << 20

__all__ = ["PARALLEL_MIN_EXAMPLES", "Sink", "build_into", "build_samples", "iter_examples", "load_examples",
           "message_fields", "row_example", "tokenize_examples"]


def load_examples(configs: Sequence[DatasetConfig], on_bad_row: str, stats: DataStats,
                  key: str = "datasets", data: DataConfig | None = None, teacher: str | None = None) -> list[Example]:
    """Read and convert every row of the given datasets; bad rows raise or are counted per `on_bad_row`.

    `key` is the recipe list the configs come from: a problem with a whole source (missing file, unreadable
    hub dataset) is reported as `datasets.N.path: ...`, a problem with one row by its `file:line`. `data` gives
    max_row_bytes and ignore_message_fields (their defaults when None). `teacher`: distill.teacher_logprobs, the
    field of a stored teacher each row must then have.
    """
    return list(iter_examples(configs, on_bad_row, stats, key, data, teacher))


def iter_examples(configs: Sequence[DatasetConfig], on_bad_row: str, stats: DataStats,
                  key: str = "datasets", data: DataConfig | None = None,
                  teacher: str | None = None) -> Iterator[Example]:
    """load_examples as a stream: each example as its row is read (a JSONL file is never read whole)."""
    data = data or DataConfig()
    seen = seen_for(data.deduplicate)  # one for the whole split: a row equal to one of another dataset is dropped too
    for index, cfg in enumerate(configs):
        yield from _dataset_examples(cfg, index, key, data, on_bad_row, stats, teacher, seen)


def _dataset_examples(cfg: DatasetConfig, index: int, key: str, data: DataConfig, on_bad_row: str,
                      stats: DataStats, teacher: str | None = None, seen: Seen | None = None) -> Iterator[Example]:
    with _named_source(key, index):
        fields = message_fields(cfg, tuple(data.ignore_message_fields), data.cache_dir, data.max_image_pixels,
                                teacher)
        rows = read_rows(cfg.path, split=cfg.split, name=cfg.name, max_row_bytes=data.max_row_bytes,
                         data_files=cfg.data_files)
        yield from _examples(rows, cfg, fields, on_bad_row, stats, seen)


def _examples(rows: Iterable[Any], cfg: DatasetConfig, fields: MessageFields, on_bad_row: str,
              stats: DataStats, seen: Seen | None = None) -> Iterator[Example]:
    """The examples of a dataset's rows (up to its max_rows), every row read counted, bad ones per on_bad_row; with
    `seen` (data.deduplicate: exact), an example seen before is dropped and counted (max_rows counts it)."""
    taken = 0
    for row in rows:
        if cfg.max_rows is not None and taken >= cfg.max_rows:
            break
        stats.rows_read += 1
        try:
            example = row_example(row, cfg, fields=fields)
        except BadRow as e:
            stats.bad_row(e, on_bad_row)
            continue
        taken += 1
        if seen is not None and not seen.first(example):
            stats.duplicate(example.origin)
            continue
        yield example


@contextlib.contextmanager
def _named_source(key: str, index: int) -> Iterator[None]:
    """A problem with a whole source (missing file, unreadable hub dataset) names the recipe key too; a bad row
    names its file:line already."""
    try:
        yield
    except BadRow:
        raise
    except UserError as e:
        raise UserError(f"{key}.{index}.path: {e}") from None


def iter_chunks(configs: Sequence[DatasetConfig], on_bad_row: str, key: str, data: DataConfig,
                in_workers: bool, teacher: str | None = None) -> Iterator[FileChunk | ReadRows]:
    """The datasets' rows in chunks for tokenize_stream, each with the counts of reading it, which are merged in input
    order. With `in_workers`, a JSONL or parquet dataset (_read_by_workers) comes as FileChunks that the tokenizing
    workers read themselves: spans of CHUNK_EXAMPLES lines of a JSONL file, never parsed here, or a parquet file's
    batches as pyarrow decodes them, made into rows there (a batch over PARQUET_WORKER_BYTES, images say, is read
    here, so that the batches in flight stay small). Any other dataset is read here, as ReadRows of CHUNK_EXAMPLES
    examples. `teacher`: as load_examples. With data.deduplicate: exact every row is read here, whatever
    `in_workers` (the workers still tokenize), so that the duplicates of the whole split are found in input order."""
    in_workers = in_workers and data.deduplicate == "none"
    seen = seen_for(data.deduplicate)
    for index, cfg in enumerate(configs):
        if in_workers and _read_by_workers(cfg):
            with _named_source(key, index):
                fields = message_fields(cfg, tuple(data.ignore_message_fields), data.cache_dir,
                                        data.max_image_pixels, teacher)
                for span in file_spans(cfg.path, CHUNK_EXAMPLES):
                    chunk = FileChunk(cfg, fields, key, index, span, data.max_row_bytes)
                    if isinstance(span, ParquetBatch) and span.batch.nbytes > PARQUET_WORKER_BYTES:
                        counts = DataStats()
                        yield ReadRows(chunk.read(on_bad_row, counts), counts)
                    else:
                        yield chunk
            continue
        counts = DataStats()
        examples = _dataset_examples(cfg, index, key, data, on_bad_row, counts, teacher, seen)
        while True:
            chunk = list(itertools.islice(examples, CHUNK_EXAMPLES))
            if chunk or counts.rows_read:  # bad rows after the last example are counted too
                yield ReadRows(chunk, counts.take())
            if len(chunk) < CHUNK_EXAMPLES:
                break


@dataclasses.dataclass
class ReadRows:
    """Examples read in this process and the counts of reading them (shards.RowsToRead)."""

    examples: list[Example]
    counts: DataStats

    def __len__(self) -> int:
        return len(self.examples)

    def read(self, on_bad_row: str, stats: DataStats) -> list[Example]:
        stats.add(self.counts)
        return self.examples


@dataclasses.dataclass(frozen=True)
class FileChunk:
    """A piece of a dataset's file (lines of a JSONL file, a batch of a parquet file) that a tokenizing worker reads
    itself (shards.RowsToRead)."""

    cfg: DatasetConfig
    fields: MessageFields
    key: str
    index: int
    span: LineSpan | ParquetBatch
    max_row_bytes: int

    def __len__(self) -> int:
        return len(self.span)

    def origin(self) -> str:
        """Where the chunk starts: `file:line`, or `file[row N]` for a parquet batch."""
        if isinstance(self.span, ParquetBatch):
            return f"{local_data_path(self.cfg.path)}[row {self.span.first}]"
        return f"{local_data_path(self.cfg.path)}:{self.span.first}"

    def read(self, on_bad_row: str, stats: DataStats) -> list[Example]:
        """The span's examples, as iter_examples gives them, its rows counted in `stats`."""
        with _named_source(self.key, self.index):
            rows = read_rows(self.cfg.path, max_row_bytes=self.max_row_bytes, span=self.span)
            return list(_examples(rows, self.cfg, self.fields, on_bad_row, stats))


def message_fields(cfg: DatasetConfig, ignore: tuple[str, ...] = (), cache_dir: str | None = None,
                   max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS, teacher: str | None = None) -> MessageFields:
    """Where a dataset's rows keep their messages' parts (message fields in `ignore` left out; images given as bytes
    written under `cache_dir`, data.cache_dir; an image of more than `max_image_pixels` pixels a bad row), and
    `teacher`, the field of a stored teacher's log-probabilities (distill.teacher_logprobs)."""
    local = local_data_path(cfg.path)  # image paths are relative to the data file
    return MessageFields(cfg.role_field, cfg.content_field, tuple(cfg.role_map.items()), cfg.system_field, ignore,
                         str(local.parent) if local is not None else None, cfg.images_field, cache_dir,
                         max_image_pixels, teacher, drop_system=cfg.drop_system_message)


def row_example(row: Any, cfg: DatasetConfig, ignore: tuple[str, ...] = (), cache_dir: str | None = None,
                fields: MessageFields | None = None) -> Example | PairExample:
    """One row of a dataset as its format reads it, through the dataset's field and role mappings: `fields`, or
    message_fields(cfg, ignore, cache_dir) (a reader of many rows makes them once: the data file's Path for each row
    was nearly half of reading a quickstart row, 18 -> 10 us)."""
    fields = fields or message_fields(cfg, ignore, cache_dir)
    if cfg.format == "preference":
        return to_pair(row, PairFields(cfg.prompt_field, cfg.chosen_field, cfg.rejected_field, fields))
    return to_example(row, cfg.format, messages_field=cfg.messages_field, text_field=cfg.text_field,
                      train_on_inputs=cfg.train_on_inputs, roles_to_train=tuple(cfg.roles_to_train), fields=fields,
                      prompt_template=cfg.prompt_template)


class Sink(Protocol):
    """Where samples go as they are made: a list, or the token store's SplitWriter."""

    def append(self, sample: dict, /) -> None: ...


def tokenize_examples(examples: Sequence[Example], tokenizer: Any, data: DataConfig, stats: DataStats,
                      on_bad_row: str = "error", template_kwargs: Mapping[str, Any] | None = None,
                      out: Sink | None = None, pair_end: str = "marker") -> Any:
    """Tokenize (chat templates rendered with `template_kwargs`; preference pairs' completions up to `pair_end`,
    data/pairs.py), then truncate or drop samples longer than
    max_seq_len (counted in stats). The samples are appended to `out` (a new list when None), which is returned.

    With more than one worker (data.num_proc; default: every core) the examples are tokenized by worker
    processes, in contiguous chunks whose results are put back in order: the samples and the stats are exactly
    those of one serial pass.
    """
    kwargs = dict(template_kwargs or {})
    out = [] if out is None else out
    if workers_for(data) > 1 and len(examples) >= PARALLEL_MIN_EXAMPLES:
        return _tokenize_parallel(examples, tokenizer, data, stats, on_bad_row, kwargs, out, pair_end)
    return tokenize_chunk(examples, tokenizer, data, stats, on_bad_row, kwargs, out, pair_end)


def _tokenize_parallel(examples: Sequence[Example], tokenizer: Any, data: DataConfig, stats: DataStats,
                       on_bad_row: str, template_kwargs: dict[str, Any], out: Any, pair_end: str) -> Any:
    workers = workers_for(data)
    # A few chunks per worker evens out chunks of unequal cost (long conversations cluster in files).
    size = max(1, min(CHUNK_EXAMPLES, -(-len(examples) // (workers * 4))))
    failure = tokenize_stream(chunked(examples, size), Job(tokenizer, data, on_bad_row, template_kwargs, pair_end=pair_end), stats,
                              out, workers)
    if failure is not None:
        raise failure
    return out


def build_samples(recipe: Recipe, tokenizer: Any) -> tuple[list[dict], list[dict], DataStats, DataStats]:
    """Train and eval samples for a recipe, in memory: eval from eval_datasets, else a seeded val_fraction split."""
    train: list[dict] = []
    evals: list[dict] = []
    train_stats, eval_stats = build_into(recipe, tokenizer, train, evals)
    return train, evals, train_stats, eval_stats


def build_into(recipe: Recipe, tokenizer: Any, train: Sink, evals: Sink) -> tuple[DataStats, DataStats]:
    """Tokenize a recipe's train and eval samples into `train` and `evals` (lists, or the token store's
    writers); returns their stats. Eval comes from eval_datasets, else a seeded val_fraction split.

    Rows are read as a stream and tokenized in chunks as they come (by worker processes: data.num_proc, which read
    a JSONL or parquet dataset's rows themselves), so neither the rows nor the examples are ever all in memory (a val_fraction
    split reads the rows three times: to count them, for the training examples, for the held-out ones). A row that
    cannot be read or converted is raised in input order; a failure while tokenizing after the whole input has been
    read, so that the first of the first kind is the error raised, as when every row was read before any was
    tokenized.
    """
    train_stats, eval_stats = DataStats(), DataStats()
    data, on_bad = recipe.data, recipe.data.on_bad_row
    rows = lambda: train_stats.rows_read + eval_stats.rows_read  # noqa: E731
    job = Job(tokenizer, data, on_bad, dict(recipe.tokenizer.chat_template_kwargs or {}), Progress(rows),
              completion_end(recipe))
    sources: tuple[Iterable[Chunk], Iterable[Chunk]]
    if not recipe.eval_datasets and data.val_fraction > 0 and workers_for(data) > 1 and \
            data.deduplicate == "none" and all(map(_read_by_workers, recipe.datasets)):
        sources = _split_in_workers(recipe, train_stats, job, workers_for(data))
    elif not recipe.eval_datasets and data.val_fraction > 0:
        train_part, eval_part = _split(recipe, train_stats)
        sources = (chunked(train_part, CHUNK_EXAMPLES), chunked(eval_part, CHUNK_EXAMPLES))
    else:
        in_workers = workers_for(data) > 1
        sources = (iter_chunks(recipe.datasets, on_bad, "datasets", data, in_workers, _teacher(recipe)),
                   iter_chunks(recipe.eval_datasets, on_bad, "eval_datasets", data, in_workers, _teacher(recipe)))
    failure: BaseException | None = None
    for source, stats, out in zip(sources, (train_stats, eval_stats), (train, evals)):
        tokenized = DataStats()  # after the rows' own counts, as when all rows were read first
        if failure is None:
            failure = tokenize_stream(source, job, tokenized, out, workers_for(data), read_stats=stats)
        else:
            for chunk in source:  # read on: an unreadable row later in the input is the error to report
                if isinstance(chunk, RowsToRead):
                    chunk.read(on_bad, stats)
        stats.add(tokenized)
    if failure is not None:
        raise failure
    check_train_stats(recipe, train_stats)
    return train_stats, eval_stats


def _split(recipe: Recipe, stats: DataStats) -> tuple[Iterator[Example], Iterator[Example]]:
    """The training examples and the seeded val_fraction of them held out for eval, as two streams.

    A first pass reads every row to count the examples (the rows and bad rows are counted in `stats` there, and a
    bad row under on_bad_row: error stops it before anything is tokenized); the held-out ones are drawn from those
    indices; each stream then reads the rows again and keeps its own. Memory is 9 bytes per example, never the
    examples.
    """
    data = recipe.data
    n = sum(1 for _ in iter_examples(recipe.datasets, data.on_bad_row, stats, "datasets", data, _teacher(recipe)))
    held = held_out(n, data.val_fraction, recipe.seed)

    def part(kept: int) -> Iterator[Example]:
        again = DataStats()  # the rows were counted by the first pass
        seen = 0
        for example in iter_examples(recipe.datasets, data.on_bad_row, again, "datasets", data, _teacher(recipe)):
            if seen < n and held[seen] == kept:
                yield example
            seen += 1
        if seen != n:  # the indices would pick other rows than the ones counted
            raise UserError(f"datasets: {n} training examples were read, then {seen}: a data file changed while it "
                            "was read; run again once it no longer changes")

    return part(0), part(1)


def _split_in_workers(recipe: Recipe, stats: DataStats, job: Job,
                      workers: int) -> tuple[Iterator[Kept], Iterator[Kept]]:
    """_split with the rows read by the tokenizing workers, for datasets they read themselves (_read_by_workers): a
    first pass only reads the chunks and counts each one's examples (the rows counted in `stats`, a bad row under
    on_bad_row: error raised in input order, before anything is tokenized); each part then reads the same chunks
    again and keeps its own examples, told by the held-out flags of each chunk's examples."""
    data = recipe.data

    def chunks() -> Iterator[FileChunk]:
        return iter_chunks(recipe.datasets, data.on_bad_row, "datasets", data, True,  # type: ignore[return-value]
                           _teacher(recipe))

    counts: list[int] = []
    failure = tokenize_stream(chunks(), dataclasses.replace(job, tokenize=False, progress=None), DataStats(), counts,
                              workers, read_stats=stats)
    if failure is not None:
        raise failure
    held = held_out(sum(counts), data.val_fraction, recipe.seed)

    def part(kept: int) -> Iterator[Kept]:
        offset, k = 0, 0
        for k, chunk in enumerate(chunks(), start=1):
            size = counts[k - 1] if k <= len(counts) else 0
            yield Kept(chunk, held[offset:offset + size], kept)
            offset += size
        if k != len(counts):
            raise UserError(f"datasets: the training files read as {k} chunks, where the first read found "
                            f"{len(counts)}: {_CHANGED}")

    return part(0), part(1)


def _teacher(recipe: Recipe) -> str | None:
    """The field of the stored teacher the rows carry (distill.teacher_logprobs), when the objective distills."""
    return recipe.distill.teacher_logprobs if recipe.train.objective == "distill" else None


def _read_by_workers(cfg: DatasetConfig) -> bool:
    """Whether iter_chunks hands this dataset to the workers, with workers: JSONL and parquet without max_rows (which
    counts examples, not lines)."""
    local = local_data_path(cfg.path)
    return cfg.max_rows is None and local is not None and local.suffix.lower() in (".jsonl", ".parquet")


_CHANGED = "a data file changed while it was read; run again once it no longer changes"


@dataclasses.dataclass
class Kept:
    """One part's share of a FileChunk in a val_fraction split (shards.RowsToRead): the chunk's examples whose
    `held` flag (per example, from the first read) is `kept`. Its rows were counted by the first read."""

    chunk: FileChunk
    held: bytearray
    kept: int

    def __len__(self) -> int:  # the examples it keeps: what the choice between one process and workers weighs
        return self.held.count(self.kept)

    def read(self, on_bad_row: str, stats: DataStats) -> list[Example]:
        examples = self.chunk.read(on_bad_row, DataStats())
        if len(examples) != len(self.held):  # other rows than the ones counted
            raise UserError(f"{self.chunk.origin()}: {len(examples)} examples where the first read found "
                            f"{len(self.held)}: {_CHANGED}")
        return [e for e, h in zip(examples, self.held) if h == self.kept]


def held_out(n: int, fraction: float, seed: int) -> bytearray:
    """Per example index, 1 when it is held out: the first round(n x fraction) (at least one) of the indices in a
    random.Random(seed) shuffle, the same ones a shuffled list of the examples gave."""
    order = array.array("q", range(n))  # 8 bytes an index where a list holds a Python int per index
    random.Random(seed).shuffle(order)  # shuffle only swaps items: the same draws as on a list
    n_val = max(1, round(n * fraction))
    if order and n_val >= n:
        raise UserError(f"data.val_fraction: {fraction} of {n} training rows leaves none to train on; lower it, or "
                        "give eval_datasets")
    held = bytearray(n)
    for index in order[:n_val]:
        held[index] = 1
    return held


def check_train_stats(recipe: Recipe, train_stats: DataStats) -> None:
    """No training samples, or none with a target token, is the user's error: nothing would be learned."""
    paths = ", ".join(d.path for d in recipe.datasets)
    if not train_stats.samples:
        raise UserError(f"datasets: no training samples in {paths}: {train_stats.rows_read} rows read, "
                        f"{train_stats.bad_rows_skipped} bad rows skipped, "
                        + (f"{train_stats.duplicates_dropped} duplicates dropped, " if train_stats.duplicates_dropped
                           else "")
                        + f"{train_stats.dropped_too_long} dropped as too long (see data.on_bad_row, data.truncation)"
                        + "".join(f"\n  dropped: {e}" for e in train_stats.dropped_examples[:1]))
    if train_stats.target_tokens == 0:
        raise UserError(f"datasets: the training data ({paths}) has no target tokens (every label is masked): "
                        "nothing would be learned. Check the format and data.max_seq_len (truncation may cut "
                        "every answer off), or set train_on_inputs: true.")
