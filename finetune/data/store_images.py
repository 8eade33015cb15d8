"""A split's image entries in the token store: one int64 row per image, the files' paths listed once.

A sample with images carries `{"layout": key, "items": [{"path", "size", "start", "length", "features"[, "grid"]}]}`
(images.py `finish`). The store keeps, per split, `{split}.images.npy` (int64 [m, 9], rows in sample order):

    sample  path  height  width  start  length  features  grid_rows  grid_cols   (grid -1 -1: the item has none)

`path` indexes the split's distinct image files, listed in meta.json with the layout key, which is one per split
(one model, one processor). Read back, a sample's entry is the same dict the tokenizer made, so cached samples
equal fresh ones. No pixel is stored: the pixels are loaded in collate (pixels.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

COLUMNS = 9
NO_GRID = -1


class ImageRows:
    """The image entries of a split being written: rows buffered until the split's writer flushes them."""

    def __init__(self) -> None:
        self.paths: dict[str, int] = {}
        self.sizes: dict[str, tuple[int, int]] = {}
        """Each file's (height, width) as the samples were laid out for it: checked against the file when its
        digest is taken (cache.py), so a file replaced while the data was tokenized is never recorded as laid out."""
        self.layout: str | None = None
        self.rows: list[list[int]] = []
        self.count = 0

    def add(self, sample: int, entry: Mapping[str, Any]) -> None:
        """Sample `sample`'s image entry (images.py `finish`)."""
        if self.layout is None:
            self.layout = entry["layout"]
        elif entry["layout"] != self.layout:  # one model's samples: cannot happen, but never store a mix
            raise ValueError(f"sample {sample}: images laid out for two image processors in one split")
        for item in entry["items"]:
            path, size, grid = item["path"], tuple(item["size"]), item.get("grid")
            if grid is not None and len(grid) != 2:
                raise ValueError(f"sample {sample}: an image grid of {len(grid)} numbers (the store keeps 2)")
            index = self.paths.setdefault(path, len(self.paths))
            if self.sizes.setdefault(path, size) != size:
                raise ValueError(f"sample {sample}: {path} laid out at two sizes in one split")
            self.rows.append([sample, index, *size, item["start"], item["length"], item["features"],
                              *(grid if grid is not None else (NO_GRID, NO_GRID))])

    def take(self) -> np.ndarray:
        """The rows buffered so far (int64 [k, 9]), and the buffer emptied."""
        rows = np.array(self.rows, dtype=np.int64).reshape(-1, COLUMNS)
        self.rows = []
        self.count += len(rows)
        return rows


def entry_of(rows: np.ndarray, paths: Sequence[str], layout: str) -> dict[str, Any]:
    """A sample's image entry from its rows, as images.py `finish` made it."""
    items = []
    for _, path, height, width, start, length, features, grid_rows, grid_cols in rows.tolist():
        items.append({"path": paths[path], "size": [height, width], "start": start, "length": length,
                      "features": features, **({"grid": [grid_rows, grid_cols]} if grid_rows != NO_GRID else {})})
    return {"layout": layout, "items": items}


def check_rows(rows: np.ndarray, paths: Sequence[str], lengths: np.ndarray) -> str | None:
    """Why a split's image rows do not fit its samples (None when they do): shape, order, indices, token spans."""
    if rows.ndim != 2 or rows.shape[1] != COLUMNS or rows.dtype != np.int64:
        return "the image rows have the wrong shape"
    if not len(rows):
        return None
    sample, path, start, length = rows[:, 0], rows[:, 1], rows[:, 4], rows[:, 5]
    if np.any(np.diff(sample) < 0) or sample[0] < 0 or sample[-1] >= len(lengths):
        return "the image rows name samples out of order or out of range"
    if path.min() < 0 or path.max() >= len(paths) or start.min() < 0 or length.min() <= 0:
        return "the image rows name files or tokens out of range"
    if np.any(start + length > lengths[sample]):
        return "an image's tokens end after its sample"
    return None
