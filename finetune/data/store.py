"""The token store: a split's samples as flat arrays in .npy files, written as a stream, read through memory maps.

A split is four arrays (cache.py names the files `{split}.{name}.npy`):

    ids       int32   every sample's tokens, concatenated
    labels    uint8   mask (1: the token is a target) when every label is its token or -100, which our
                      tokenizer guarantees; otherwise int32, the labels themselves
    offsets   int64   n + 1 entries: sample i is ids[offsets[i]:offsets[i + 1]]
    docs      int64   [n, 2], preference pairs only: each pair's chosen and rejected lengths
    margins   float64 [n], preference pairs only: each pair's `margin` field (a reward model's), NaN without one
    images    int64   [m, 9], vision-language samples only: one row per image (store_images.py); the files'
                      paths and the layout key are in meta.json
    teacher_ids       int32   [t, k], offline distillation only: a stored teacher's top-k (data/teacher_logprobs.py)
    teacher_logprobs  float32 [t, k]  at each trained token (label kept), in order; t = the split's trained tokens

`SplitWriter` appends samples (or whole arrays from a worker) and never holds more than a buffer of them: each
file gets a 128-byte placeholder header, the values go after it as they come, and the real header (of the final
shape) is written over the placeholder when the split is closed, so no array is ever built whole in memory.
`Samples` reads them back as a sequence of sample dicts made on access from the memory maps: nothing is copied
into Python objects but the samples that are read, and the lengths that packing needs are one array.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from finetune.data.store_images import COLUMNS, ImageRows, entry_of
from finetune.data.teacher_logprobs import KEYS as TEACHER_KEYS
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX

HEADER_BYTES = 128  # an .npy v1 header of any 1-D or [n, 2] shape we write fits (and numpy pads to 64)
FLUSH_TOKENS = 1 << 20  # buffered tokens per split before they go to disk (a few MB of Python ints)
# A split whose token ids take more than this is memory-mapped; a smaller one is read into memory (a few MB of
# arrays: no page faults, and its samples stay as they were read whatever later happens to the files).
MMAP_MIN_BYTES = 64 << 20
ARRAYS = ("ids", "labels", "offsets", "docs", "margins")


def _header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                 "fortran_order": False, "shape": shape})
    header = buffer.getvalue()
    if len(header) > HEADER_BYTES:  # over 10^40 entries: cannot happen, but never write a corrupt file
        raise ValueError(f"an .npy header of {len(header)} bytes for shape {shape}")
    # Pad inside the header dict's trailing spaces, so numpy still reads it: the length field says 118.
    body = header[10:].rstrip(b"\n").ljust(HEADER_BYTES - 11) + b"\n"
    return header[:8] + len(body).to_bytes(2, "little") + body


class ArrayFile:
    """One .npy file written as a stream of values (its rows of `width` when 2-D)."""

    def __init__(self, path: Path, dtype: Any, width: int | None = None) -> None:
        self.path, self.dtype, self.width, self.count = path, np.dtype(dtype), width, 0
        self.handle = path.open("wb")
        self.handle.write(b"\0" * HEADER_BYTES)

    def write(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self.handle.write(values.tobytes())
        self.count += len(values)

    def close(self) -> None:
        shape = (self.count,) if self.width is None else (self.count, self.width)
        self.handle.seek(0)
        self.handle.write(_header(self.dtype, shape))
        self.handle.close()


class SplitWriter:
    """A split's samples written to `{directory}/{split}.*.npy` as they come; `close` says what was written."""

    def __init__(self, directory: Path, split: str) -> None:
        self.directory, self.split = directory, split
        self.ids = ArrayFile(directory / f"{split}.ids.npy", np.int32)
        self.mask = ArrayFile(directory / f"{split}.labels.npy", np.uint8)
        self.full: ArrayFile | None = None  # int32 labels, once a sample's labels are not a mask of its ids
        self.offsets = ArrayFile(directory / f"{split}.offsets.npy", np.int64)
        self.offsets.write(np.zeros(1, dtype=np.int64))
        self.docs: ArrayFile | None = None
        self.margins: ArrayFile | None = None  # opened with docs
        self.images = ImageRows()
        self.image_file: ArrayFile | None = None  # opened by the first image: text splits have no such file
        self.samples = self.tokens = 0
        self._ids: list[int] = []
        self._labels: list[int] = []
        self._lengths: list[int] = []
        self._docs: list[list[int]] = []
        self._margins: list[float] = []
        self.teacher = TeacherColumns(directory, split)

    def __len__(self) -> int:
        return self.samples + len(self._lengths)

    def append(self, sample: dict) -> None:
        """Add one sample ({"input_ids", "labels"} and, for a pair, "docs"; with images, "images")."""
        ids, labels = sample["input_ids"], sample["labels"]
        if len(ids) != len(labels):
            raise ValueError(f"sample {len(self)}: {len(ids)} input_ids but {len(labels)} labels")
        self._pair("docs" in sample)
        if sample.get("images"):
            self.images.add(len(self), sample["images"])
        self._ids.extend(ids)
        self._labels.extend(labels)
        self._lengths.append(len(ids))
        if "docs" in sample:
            self._docs.append(list(sample["docs"]))
            self._margins.append(sample.get("margin", np.nan))
        if TEACHER_KEYS[0] in sample:
            self.teacher.add(len(self), sample[TEACHER_KEYS[0]], sample[TEACHER_KEYS[1]])
        if len(self._ids) >= FLUSH_TOKENS:
            self.flush()

    def extend(self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, docs: np.ndarray | None,
               images: Sequence[tuple[int, dict]] = (), teacher: tuple[np.ndarray, np.ndarray] | None = None,
               margins: np.ndarray | None = None) -> None:
        """Add many samples at once, as arrays (a worker's share): tokens, labels, lengths, pair lengths, the
        image entries of those that have images (their index among these samples, the entry), a stored
        teacher's entries at their trained tokens, and the pairs' margins (NaN: none)."""
        self.flush()
        if teacher is not None:
            self.teacher.add(len(self), *teacher)
        for i, entry in images:
            self.images.add(len(self) + i, entry)
        if len(lengths):
            self._pair(docs is not None)
            pairs = None if docs is None else np.asarray(docs, np.int64).reshape(-1, 2)
            self._write(np.asarray(ids, np.int32), np.asarray(labels, np.int32), np.asarray(lengths, np.int64), pairs,
                        None if pairs is None else np.full(len(pairs), np.nan) if margins is None else margins)

    def _pair(self, is_pair: bool) -> None:
        if len(self) == 0 and is_pair and self.docs is None:
            self.docs = ArrayFile(self.directory / f"{self.split}.docs.npy", np.int64, width=2)
            self.margins = ArrayFile(self.directory / f"{self.split}.margins.npy", np.float64)
        elif (self.docs is not None) != is_pair:
            raise ValueError(f"sample {len(self)}: preference pairs and single samples in one split")

    def flush(self) -> None:
        if self._lengths:
            docs = np.array(self._docs, dtype=np.int64).reshape(-1, 2) if self.docs is not None else None
            self._write(np.array(self._ids, dtype=np.int32), np.array(self._labels, dtype=np.int32),
                        np.array(self._lengths, dtype=np.int64), docs, np.array(self._margins, dtype=np.float64))
            self._ids, self._labels, self._lengths, self._docs, self._margins = [], [], [], [], []

    def _write(self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, docs: np.ndarray | None,
               margins: np.ndarray | None = None) -> None:
        trained = labels != IGNORE_INDEX
        if self.full is None and not np.array_equal(labels[trained], ids[trained]):
            self._switch_to_full_labels()
        if self.full is not None:
            self.full.write(labels)
        else:
            self.mask.write(trained.astype(np.uint8))
        self.ids.write(ids)
        self.offsets.write(self.tokens + np.cumsum(lengths))
        if self.docs is not None and docs is not None:
            self.docs.write(docs)
            self.margins.write(margins if margins is not None else np.full(len(docs), np.nan))
        if self.images.rows:
            if self.image_file is None:
                self.image_file = ArrayFile(self.directory / f"{self.split}.images.npy", np.int64, width=COLUMNS)
            self.image_file.write(self.images.take())
        self.teacher.flush()
        self.samples += len(lengths)
        self.tokens += int(lengths.sum())

    def _switch_to_full_labels(self) -> None:
        """A label that is neither its token nor -100: from here on the labels are stored whole, the mask written
        so far turned into labels first."""
        self.full = ArrayFile(self.directory / f"{self.split}.labels-full.npy", np.int32)
        self.ids.handle.flush()
        self.mask.handle.flush()
        step = FLUSH_TOKENS
        for start in range(0, self.tokens, step):
            n = min(step, self.tokens - start)
            ids = np.fromfile(self.ids.path, dtype=np.int32, count=n, offset=HEADER_BYTES + 4 * start)
            mask = np.fromfile(self.mask.path, dtype=np.uint8, count=n, offset=HEADER_BYTES + start)
            self.full.write(np.where(mask.astype(bool), ids, IGNORE_INDEX))

    def close(self) -> dict[str, Any]:
        """Finish the files; the split's sizes and label kind (for meta.json)."""
        self.flush()
        files = [self.ids, self.offsets, *([self.docs, self.margins] if self.docs else []),
                 *filter(None, [self.image_file])]
        for file in [*files, self.mask, *([self.full] if self.full else [])]:
            file.close()
        width = self.teacher.close()
        if self.full is not None:
            self.full.path.replace(self.mask.path)
        images = {"images": self.images.count, "image_layout": self.images.layout,
                  "image_paths": list(self.images.paths)} if self.image_file is not None else {}
        return {"samples": self.samples, "tokens": self.tokens, "labels": "mask" if self.full is None else "ids",
                **images, **({"teacher_k": width} if width is not None else {})}


class TeacherColumns:
    """A split's stored-teacher arrays (teacher_ids, teacher_logprobs), opened by the first sample that has them: every
    sample then gives as many entries per token."""

    def __init__(self, directory: Path, split: str) -> None:
        self.directory, self.split = directory, split
        self.files: tuple[ArrayFile, ArrayFile] | None = None
        self._parts: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, sample: int, ids: np.ndarray, values: np.ndarray) -> None:
        width = ids.shape[1]
        if not len(ids):  # no trained token: nothing to store (and its width says nothing)
            return
        if self.files is None:
            self.files = (ArrayFile(self.directory / f"{self.split}.{TEACHER_KEYS[0]}.npy", np.int32, width),
                          ArrayFile(self.directory / f"{self.split}.{TEACHER_KEYS[1]}.npy", np.float32, width))
        elif width != self.files[0].width:
            raise UserError(f"sample {sample}: its stored teacher has {width} log-probabilities per token, earlier "
                            f"samples {self.files[0].width}: every token of the datasets needs the same number")
        self._parts.append((ids, values))

    def flush(self) -> None:
        if self.files is not None:
            for ids, values in self._parts:
                self.files[0].write(ids)
                self.files[1].write(values)
        self._parts = []

    def close(self) -> int | None:
        """The entries per token (None: no stored teacher), the files finished."""
        self.flush()
        if self.files is None:
            return None
        for file in self.files:
            file.close()
        return self.files[0].width


class SampleRow(dict):
    """A sample read from the store. Keys set on it besides its tokens (a pair's reference log-probabilities)
    are kept by its store, so that the next read of the same sample has them too."""

    __slots__ = ("_extras", "_index")

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key not in ("input_ids", "labels", "docs", "margin", "images"):
            self._extras.setdefault(self._index, {})[key] = value


class Samples(Sequence):
    """A split's samples from its memory-mapped arrays; sample i is made when read (SampleRow of lists)."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray, docs: np.ndarray | None,
                 mask: bool, images: np.ndarray | None = None, image_paths: Sequence[str] = (),
                 image_layout: str = "", teacher: tuple[np.ndarray, np.ndarray] | None = None,
                 margins: np.ndarray | None = None) -> None:
        self.ids, self.labels, self.offsets, self.docs, self.mask = ids, labels, offsets, docs, mask
        self.margins = margins  # a pair's margin (NaN: none), read as its sample's "margin"
        self.teacher = teacher
        self.teacher_offsets = _trained_offsets(labels, offsets, mask) if teacher is not None else None
        self.lengths = np.diff(offsets)
        self.images, self.image_paths, self.image_layout = images, list(image_paths), image_layout
        self.image_digests: dict[str, str] = {}
        """Each image file's SHA-256 as the cache entry recorded it (set by cache.load_entry)."""
        self._extras: dict[int, dict[str, Any]] = {}

    @classmethod
    def open(cls, directory: Path, split: str, labels_kind: str, info: dict[str, Any] | None = None) -> Samples:
        """The split's arrays as memory maps (np.load mmap_mode "r": pages are read when touched), or read into
        memory when they are small (MMAP_MIN_BYTES). `info` (the split's meta.json record) names the image files
        and the layout of a split with images."""
        mode = "r" if (directory / f"{split}.ids.npy").stat().st_size > MMAP_MIN_BYTES else None

        def load(name: str) -> np.ndarray:
            return np.load(directory / f"{split}.{name}.npy", mmap_mode=mode, allow_pickle=False)

        docs_file = directory / f"{split}.docs.npy"
        docs = np.asarray(load("docs")) if docs_file.is_file() else None
        info = info or {}
        images = np.asarray(load("images")) if info.get("images") is not None else None  # a few ints per image
        teacher = tuple(load(k) for k in TEACHER_KEYS) if info.get("teacher_k") is not None else None
        margins = np.asarray(load("margins")) if (directory / f"{split}.margins.npy").is_file() else None
        return cls(load("ids"), load("labels"), np.asarray(load("offsets")), docs, labels_kind == "mask", images,
                   info.get("image_paths", ()), info.get("image_layout") or "", teacher, margins)

    def __len__(self) -> int:
        return len(self.lengths)

    def token_arrays(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's token ids and labels as arrays (int32, int64 labels with -100)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = np.asarray(self.ids[a:b])
        labels = np.where(self.labels[a:b].astype(bool), ids, IGNORE_INDEX) if self.mask else np.asarray(self.labels[a:b])
        return ids, labels

    def _sample(self, i: int) -> SampleRow:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        ids, labels = self.token_arrays(i)
        row = SampleRow(input_ids=ids.tolist(), labels=labels.tolist())
        if self.docs is not None:
            row["docs"] = self.docs[i].tolist()
            if self.margins is not None and not np.isnan(self.margins[i]):
                row["margin"] = float(self.margins[i])
        if self.images is not None:
            first, end = np.searchsorted(self.images[:, 0], [i, i + 1])
            if end > first:
                row["images"] = entry_of(self.images[first:end], self.image_paths, self.image_layout)
        if self.teacher is not None:
            a, b = int(self.teacher_offsets[i]), int(self.teacher_offsets[i + 1])
            row.update(zip(TEACHER_KEYS, (np.asarray(column[a:b]) for column in self.teacher)))
        row.update(self._extras.get(i, {}))
        row._extras, row._index = self._extras, i
        return row

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._sample(i) for i in range(*index.indices(len(self)))]
        return self._sample(int(index))

    def __iter__(self) -> Iterator[SampleRow]:
        return (self._sample(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Samples({len(self)} samples, {len(self.ids)} tokens)"


def _trained_offsets(labels: np.ndarray, offsets: np.ndarray, mask: bool) -> np.ndarray:
    """n + 1 offsets into a stored teacher's arrays: sample i's trained tokens' entries are rows [o[i], o[i + 1])."""
    trained = labels != 0 if mask else labels != IGNORE_INDEX
    counts = np.add.reduceat(trained.astype(np.int64), offsets[:-1]) if len(offsets) > 1 else np.zeros(0, np.int64)
    return np.concatenate([[0], np.cumsum(counts)])


def sample_lengths(samples: Sequence[dict]) -> np.ndarray:
    """Every sample's token count (int64): the store's lengths array, or counted from the dicts."""
    if isinstance(samples, Samples):
        return samples.lengths
    return np.fromiter((len(s["input_ids"]) for s in samples), dtype=np.int64, count=len(samples))


def pair_flags(samples: Sequence[dict]) -> np.ndarray:
    """Which samples are preference pairs (two documents, never cut by packing)."""
    if isinstance(samples, Samples):
        return np.full(len(samples), samples.docs is not None)
    return np.fromiter(("docs" in s for s in samples), dtype=bool, count=len(samples))


def read_range(array: np.ndarray, start: int, end: int) -> np.ndarray:
    """array[start:end] as an array in memory. From a memory map, read from its file rather than through the map:
    a pass over a whole split (the statistics) would otherwise leave every page it touched mapped in the process,
    its resident memory growing to the file's size (~500 MiB of labels at 10M rows)."""
    if not isinstance(array, np.memmap) or array.filename is None:
        return np.asarray(array[start:end])
    itemsize = array.dtype.itemsize
    return np.fromfile(array.filename, dtype=array.dtype, count=max(0, end - start),
                       offset=array.offset + start * itemsize)


def target_counts(samples: Sequence[dict], limit: int) -> np.ndarray:
    """Per sample: the labels that are targets within its first `limit` tokens, each document's first label left
    out (packing masks it): what the sample's documents add to a packed row's targets."""
    if not isinstance(samples, Samples):
        out = np.zeros(len(samples), dtype=np.int64)
        for i, sample in enumerate(samples):
            labels, start = sample["labels"][:limit], 0
            for length in sample.get("docs", [len(labels)]):
                out[i] += sum(1 for x in labels[start + 1:start + length] if x != IGNORE_INDEX)
                start += length
        return out
    out = np.zeros(len(samples), dtype=np.int64)
    block = 1 << 16  # samples per block: their tokens' flags and running sums stay a few MB
    for first in range(0, len(samples), block):
        last = min(first + block, len(samples))
        base, end = int(samples.offsets[first]), int(samples.offsets[last])
        flags = read_range(samples.labels, base, end) != (0 if samples.mask else IGNORE_INDEX)
        running = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
        starts = samples.offsets[first:last] - base
        if samples.docs is not None:  # pairs: two documents each, never cut
            chosen = samples.docs[first:last, 0]
            ends = starts + samples.lengths[first:last]
            out[first:last] = (running[starts + chosen] - running[np.minimum(starts + 1, starts + chosen)]
                               + running[ends] - running[np.minimum(starts + chosen + 1, ends)])
        else:
            ends = starts + np.minimum(samples.lengths[first:last], limit)
            out[first:last] = running[ends] - running[np.minimum(starts + 1, ends)]
    return out
