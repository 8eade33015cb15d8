"""Streamed datasets (data.streaming): the training rows read as training goes, each data-parallel rank its share,
tokenized and packed a window at a time, never preprocessed or cached; and where the stream stands, for an exact
resume. docs/design.md, "Streamed datasets".

The datasets are read one after another, as the cached path reads them (a bad row raised or skipped and counted,
max_rows honoured), by every rank: example j of a pass (counted over all the datasets) is rank j % W's. Every rank
reads and converts every row, so a bad row stops every rank at once, but tokenizes only its own examples. A rank's
examples are taken in windows of data.stream_buffer; a window's samples are tokenized as the cached path tokenizes
them (shards.tokenize_chunk: the same samples, truncation and bad rows) and made into rows by the cached path's own
epoch_plan, seeded by (seed, pass + window x WINDOW_KEY): packed best-fit decreasing with the rows shuffled, or,
unpacked, shuffled unless data.shuffle is off. So with one rank and a window that holds the whole dataset, the rows
are exactly the cached path's epochs. When the datasets end, the next pass starts again from their start.

A Cursor says where the next row comes from: the pass, the window, where that window's reading started and how many
of its rows were given out. A resume rebuilds the window from there (the rows before it read again but not converted,
then the window read and tokenized again: the same samples, so the same rows) and skips the rows given out.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from finetune.data.batching import epoch_plan
from finetune.data.formats import Example
from finetune.data.samples import message_fields, row_example
from finetune.data.shards import tokenize_chunk
from finetune.data.sources import BadRow, read_rows
from finetune.data.stats import DataStats
from finetune.data.store import Samples
from finetune.errors import UserError, first_line
from finetune.recipe import DatasetConfig, Recipe, local_data_path

# Window w of pass p is planned as the epoch p + w x WINDOW_KEY of the cached path: window 0 of pass p as its epoch p.
WINDOW_KEY = 1 << 32
# The DataStats counts a cursor carries (the named examples are not: they are for the run log).
COUNTS = tuple(f.name for f in dataclasses.fields(DataStats) if f.type in ("int", int))


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the reading of a pass stands: in dataset `dataset`, `rows` of its rows read and `taken` of its examples
    taken (max_rows counts them); `examples`: the pass's examples so far, over all datasets."""

    dataset: int = 0
    rows: int = 0
    taken: int = 0
    examples: int = 0


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where the next row comes from: window `window` of pass `epoch`, whose reading started at `start`, `emitted` of
    its rows given out already; `counts`: what had been read and tokenized before the window (DataStats' counts)."""

    epoch: int = 0
    window: int = 0
    start: Position = Position()
    emitted: int = 0
    counts: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "window": self.window, "start": dataclasses.asdict(self.start),
                "emitted": self.emitted, "counts": dict(self.counts)}

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> Cursor:
        return cls(int(state["epoch"]), int(state["window"]), Position(**state["start"]), int(state["emitted"]),
                   tuple((k, int(v)) for k, v in state.get("counts", {}).items()))


@dataclasses.dataclass
class _Window:
    rows: Any  # EpochRows: the window's rows in training order, read from its samples when indexed
    end: Position | None  # where the next window's reading starts; None: the pass ended with this window


class RowStream:
    """One data-parallel rank's rows of a streamed recipe (`share` of `shares`), in training order, from `cursor`."""

    def __init__(self, recipe: Recipe, tokenizer: Any, share: int = 0, shares: int = 1,
                 cursor: Cursor | None = None) -> None:
        self.recipe, self.tokenizer, self.share, self.shares = recipe, tokenizer, share, shares
        self.cursor = cursor or Cursor()
        self.stats = DataStats(**dict(self.cursor.counts))
        self._reader: Iterator[tuple[Example, Position]] | None = None  # kept open from window to window
        self._window: _Window | None = None
        # A pass that gives this rank no row would be read forever: refused, once a pass was read whole.
        self._whole_pass, self._pass_rows = self.cursor.window == 0, 0

    def take(self, n: int) -> tuple[int, list[dict]]:
        """(the pass of the first of them, the next `n` rows)."""
        rows: list[dict] = []
        epoch = None
        while len(rows) < n:
            window = self._window or self._open()
            got = window.rows[self.cursor.emitted:self.cursor.emitted + n - len(rows)]
            if got and epoch is None:
                epoch = self.cursor.epoch
            rows += got
            self.cursor = dataclasses.replace(self.cursor, emitted=self.cursor.emitted + len(got))
            if self.cursor.emitted >= len(window.rows):
                self._next_window(window)
        return epoch or 0, rows

    def _open(self) -> _Window:
        """The cursor's window: its examples read (from where the last one ended, or from its start after a resume),
        tokenized and made into rows."""
        c, data = self.cursor, self.recipe.data
        if self._reader is None:
            self._reader = self.examples(c.start)
        mine: list[Example] = []
        end = None
        for example, after in self._reader:
            if (after.examples - 1) % self.shares == self.share:
                mine.append(example)
                if len(mine) == data.stream_buffer:
                    end = after
                    break
        if end is None:
            self._reader = None  # the pass is over
        samples = self.tokenize(mine)
        rows = epoch_plan(samples, data, self.recipe.seed, c.epoch + c.window * WINDOW_KEY) if len(samples) else []
        self._pass_rows += len(rows)
        self._window = _Window(rows, end)
        return self._window

    def _next_window(self, window: _Window) -> None:
        c = self.cursor
        counts = tuple((k, getattr(self.stats, k)) for k in COUNTS)
        if window.end is not None:
            self.cursor = Cursor(c.epoch, c.window + 1, window.end, 0, counts)
        else:
            if self._whole_pass and not self._pass_rows:
                raise UserError(self._nothing_read())
            self.cursor = Cursor(c.epoch + 1, 0, Position(), 0, counts)
            self._whole_pass, self._pass_rows = True, 0
        self._window = None

    def _nothing_read(self) -> str:
        s, paths = self.stats, ", ".join(d.path for d in self.recipe.datasets)
        whose = f" for process {self.share} of {self.shares}" if self.shares > 1 else ""
        return (f"datasets: a whole pass over the streamed datasets ({paths}) gave no training rows{whose}: "
                f"{s.rows_read} rows read so far, {s.bad_rows_skipped} bad rows skipped, {s.dropped_too_long} "
                f"samples dropped as too long (see data.on_bad_row, data.truncation"
                + (", and give every process at least one example" if self.shares > 1 else "") + ")")

    def examples(self, start: Position) -> Iterator[tuple[Example, Position]]:
        """Every example of the pass from `start` on (every rank's), each with the position just after it; the rows
        before `start` are read again, not converted (a hub dataset's are fetched again)."""
        data, configs = self.recipe.data, self.recipe.datasets
        examples = start.examples
        for d in range(start.dataset, len(configs)):
            cfg = configs[d]
            read, taken = (start.rows, start.taken) if d == start.dataset else (0, 0)
            if cfg.max_rows is not None and taken >= cfg.max_rows:
                continue
            with _source(d, cfg):
                fields = message_fields(cfg, tuple(data.ignore_message_fields), data.cache_dir, data.max_image_pixels)
                rows = read_rows(cfg.path, split=cfg.split, name=cfg.name, max_row_bytes=data.max_row_bytes,
                                 data_files=cfg.data_files, streaming=True)
                for row in itertools.islice(rows, read, None):
                    if cfg.max_rows is not None and taken >= cfg.max_rows:
                        break
                    read += 1
                    self.stats.rows_read += 1
                    try:
                        example = row_example(row, cfg, fields=fields)
                    except BadRow as e:
                        self.stats.bad_row(e, data.on_bad_row)
                        continue
                    if example.images:  # not a bad row to skip: the recipe asks for what is not done
                        raise BadRow(f"{example.origin}: a row with images; data.streaming reads text only "
                                     "(vision-language data is preprocessed: set data.streaming: false)")
                    taken += 1
                    examples += 1
                    yield example, Position(d, read, taken, examples)

    def tokenize(self, examples: list[Example]) -> Samples:
        """The examples' samples, as the cached path makes them (counted in self.stats), held as flat arrays."""
        sink = _WindowSink()
        tokenize_chunk(examples, self.tokenizer, self.recipe.data, self.stats, self.recipe.data.on_bad_row,
                       dict(self.recipe.tokenizer.chat_template_kwargs or {}), sink)
        return sink.samples()


class _WindowSink:
    """A window's samples as flat int32 arrays (a Python int per token would take 9x the memory): a token store's
    Samples in memory."""

    def __init__(self) -> None:
        self.ids, self.labels, self.lengths = array.array("i"), array.array("i"), array.array("q")

    def append(self, sample: dict) -> None:
        self.ids.extend(sample["input_ids"])
        self.labels.extend(sample["labels"])
        self.lengths.append(len(sample["input_ids"]))

    def samples(self) -> Samples:
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(np.array(self.lengths, dtype=np.int64), out=offsets[1:])
        return Samples(np.array(self.ids, dtype=np.int32), np.array(self.labels, dtype=np.int32), offsets, None,
                       mask=False)


@contextlib.contextmanager
def _source(index: int, cfg: DatasetConfig) -> Iterator[None]:
    """A problem with a whole source names its recipe key (a bad row names its file:line already); a hub dataset's
    stream failing mid-way (the network) is the user's to retry, not a traceback."""
    try:
        yield
    except BadRow:
        raise
    except UserError as e:
        raise UserError(f"datasets.{index}.path: {e}") from None
    except Exception as e:
        if local_data_path(cfg.path) is not None:
            raise
        raise UserError(f"datasets.{index}.path: reading the streamed hub dataset {cfg.path!r} failed "
                        f"({type(e).__name__}: {first_line(e)}); resume the run (resume: auto) once it can be read"
                        ) from None


def head_samples(recipe: Recipe, tokenizer: Any, n: int) -> list[dict]:
    """The first `n` samples of the streamed datasets (`finetune preprocess --show`), as one process reads them."""
    stream = RowStream(recipe, tokenizer)
    examples = [example for example, _ in itertools.islice(stream.examples(Position()), n)]
    return list(stream.tokenize(examples))


class StreamPlan:
    """StepPlan's counterpart for a streamed recipe: step s takes the next rows of this rank's stream, in order, for
    train.max_steps steps. `share` of `shares`: the part of the stream this process reads (its data-parallel rank);
    `world_size`: the ranks a step is split over (verify simulates them in one process, which then reads it all).
    A step's rows are this process's alone when `rank_local` (the loop deals them to no other rank)."""

    prefetch = True  # the next step's rows do not depend on this step's update
    evaluator = None  # eval is the objective's loss on the eval samples, preprocessed as usual

    def __init__(self, recipe: Recipe, tokenizer: Any, share: int, shares: int, world_size: int) -> None:
        t = recipe.train
        self.recipe, self.tokenizer, self.share, self.shares = recipe, tokenizer, share, shares
        self.global_batch = t.micro_batch_size * t.gradient_accumulation_steps * world_size
        self.rows_per_step = self.global_batch // shares
        self.rank_local = shares > 1
        self.total = int(t.max_steps or 0)  # required with data.streaming (recipe/streaming.py)
        self.stream = RowStream(recipe, tokenizer, share, shares)
        self._next = 0  # the step whose rows come next
        self._before: tuple[int, Cursor] | None = None  # the stream's cursor before the last step's rows were taken
        buffer = recipe.data.stream_buffer
        each = f", each of {shares} processes its share" if shares > 1 else ""
        self.note = (f"data: streamed{each}, tokenized and {'packed' if recipe.data.packing else 'ordered'} "
                     f"{buffer} samples at a time (data.stream_buffer); {self.total} optimizer steps of "
                     f"{self.global_batch} rows, the datasets read again from their start whenever they end")
        self.record = {"data": {"streamed": True, "stream_buffer": buffer, "processes": shares}}

    def step(self, step: int) -> tuple[int, list[dict]]:
        """(pass, rows) of optimizer step `step` (0-based): this process's rows, the steps asked for in order."""
        if step != self._next:
            raise ValueError(f"a streamed plan gives its steps in order: step {step} asked for, {self._next} is next")
        self._before = (step, self.stream.cursor)
        self._next = step + 1
        return self.stream.take(self.rows_per_step)

    def resume_state(self, step: int) -> dict[str, Any]:
        """Where this process's stream stood before step `step`'s rows were taken (the loop takes the next step's
        rows ahead, while this one trains): what a checkpoint after `step` steps records."""
        if self._before is not None and self._before[0] == step:
            return self._before[1].to_json()
        if self._next != step:
            raise ValueError(f"the stream's position before step {step} is gone (step {self._next} is next)")
        return self.stream.cursor.to_json()

    def restore(self, states: list[dict[str, Any]] | None, step: int, where: str) -> None:
        """Continue from a checkpoint of `step` steps that recorded every process's stream position (`states`, in
        rank order)."""
        if not states or len(states) != self.shares:
            held = len(states) if states else "no"
            now = f"{self.shares} process{'es' if self.shares > 1 else ''}"
            raise UserError(f"resume: {where} holds {held} streamed data positions and this run has {now}: a streamed "
                            "run resumes on as many processes as it ran on (each reads its own share of the stream)")
        self.stream = RowStream(self.recipe, self.tokenizer, self.share, self.shares,
                                Cursor.from_json(states[self.share]))
        self._next, self._before = step, None

    def cadence(self, every_steps: int | None, every_epochs: float | None) -> int | None:
        """Every how many steps something recurs: every_steps (an epoch's length is unknown; every_epochs is refused
        by recipe/streaming.py)."""
        if every_epochs is not None:
            raise UserError("every_epochs: an epoch's length is unknown with data.streaming; use every_steps")
        return every_steps

    def info(self, step: int) -> dict[str, float]:
        """Figures of the step's data for its metrics line: none."""
        return {}
