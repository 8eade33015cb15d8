"""Images in chat rows: a message's parts, and where each image's tokens go in a sample (docs/vision.md).

A message's content may be a list of parts, transformers' chat-template convention: `{"type": "text", "text": ...}`
and `{"type": "image", "path": ...}` (a local image file; a relative path is relative to the data file), or
`{"type": "image"}`, which takes the next image of the row's images column (RowImages; image_files.py turns an image
given as bytes into a file). The chat template gets `{"type": "text", "text"}` and `{"type": "image"}` and writes
each image as its placeholder (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`); the example keeps the
images' paths, in the order they appear.

The layout (preprocessing): each placeholder becomes the text the model's processor would make of it (Qwen2-VL: one
`<|image_pad|>` per feature the vision encoder gives the language model), their number computed from the image's
height and width, read from the file's header (its pixels are never loaded here), through the image processor's
own resize rule (image_families.py: each family's rule). The expansion is made in the rendered text, before it is tokenized, as the processor does, and the
trained character spans move with it. Then every image token and every vision special token has no label: only
the trained messages' text is trained, whatever train_on_inputs says. A sample records, per image, where its tokens
are (`start`, `length`: the placeholder's tokens and the vision markers around them) and how many features it has.

A sample cut inside an image's tokens is dropped, never cut (`cut`); images wholly after the cut leave with it.
The pixels are loaded in the collate step (finetune/data/pixels.py), never cached.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.data.image_families import FAMILIES, Family
from finetune.data.image_files import DEFAULT_MAX_IMAGE_PIXELS, image_file, open_image, store_dir
from finetune.data.sources import BadRow
from finetune.data.teacher_logprobs import KEYS as TEACHER_KEYS
from finetune.data.teacher_logprobs import kept_entries
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX

PART_TYPES = ("text", "image")
# A part's keys besides its type. `index`: an image part's place in the row's images column, which hub datasets write
# (llava-instruct-mix-vsft); images are taken in order, and an index that says otherwise is a bad row.
_PART_KEYS = {"text": ("type", "text"), "image": ("type", "path", "image", "index")}
# EXIF orientations that turn the picture by 90 degrees: transformers' load_image applies them (exif_transpose),
# so the image the processor sees has height and width swapped.
_TRANSPOSED = {5, 6, 7, 8}


# --- the parts of a message ------------------------------------------------------------------------------------

class RowImages:
    """A row's images as its messages' image parts take them, in order: a part's own `path` or `image`, else the
    next entry of the row's images column (TRL's convention). Relative paths start at `root` (the data file's
    folder); images given as bytes are written into the image store under `cache_dir` (image_files.py); an image of
    more than `max_pixels` pixels (data.max_image_pixels) is a bad row. `paths` are the images' files."""

    def __init__(self, origin: str, column: str, entries: list[Any], root: str | None, cache_dir: str | None,
                 max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.origin, self.column, self.entries, self.root, self.cache_dir = origin, column, entries, root, cache_dir
        self.max_pixels = max_pixels
        self.taken = 0
        self.paths: list[str] = []

    @property
    def store(self) -> Path:
        """Where images given as bytes are written: found when an image is taken (made for every row, images or
        not, it was half of reading a quickstart row: 35 -> 18 us)."""
        return store_dir(self.cache_dir)

    def take(self, where: str, part: dict[str, Any]) -> None:
        """The image of one image part (its keys checked, None values left out), appended to `paths`."""
        own = part.get("path", part.get("image"))
        if own is not None:
            self.paths.append(image_file(f"{where} (image)", own, self.root, self.store, self.max_pixels))
            return
        index = part.get("index")
        if index is not None and index != self.taken:
            raise BadRow(f"{where} (image) has index {index!r}, but it is the row's image {self.taken} in order; "
                         f"finetune gives image parts the {self.column!r} entries in the order they appear")
        if not self.entries:
            raise BadRow(f"{where} (image) needs a 'path' (a local image file, relative to the data file), or an "
                         f"image in the row's {self.column!r}, which has none")
        if self.taken >= len(self.entries):
            raise BadRow(f"{where} (image) has no path and the row's {self.column!r} holds {len(self.entries)} "
                         "images: more image parts than images")
        entry = self.entries[self.taken]
        self.paths.append(image_file(f"{self.origin}: {self.column}[{self.taken}]", entry, self.root, self.store,
                                     self.max_pixels))
        self.taken += 1

    def check_used(self) -> None:
        """A BadRow when the images column holds images no image part took: they would never be trained on."""
        if self.taken < len(self.entries):
            parts = self.taken or "no"
            raise BadRow(f"{self.origin}: the row's {self.column!r} holds {len(self.entries)} images and its "
                         f"messages have {parts} image parts without a path to take them: the images left over "
                         "would never be trained on; give each its {\"type\": \"image\"} part, or remove it")


def message_parts(origin: str, i: int, content: list[Any], images: RowImages) -> list[dict[str, Any]]:
    """Message i's content list as the chat template gets it, each image part's image taken by `images`; a BadRow
    naming `origin` and the part when one does not fit. Keys whose value is None are absent: a parquet or hub
    dataset gives every part every key of all of them."""
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        where = f"{origin}: message {i}, part {k}"
        if isinstance(part, dict):
            part = {key: value for key, value in part.items() if value is not None}
        if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRow(f"{where} is {kind!r}; a part is {{\"type\": \"text\", \"text\": ...}} or {{\"type\": "
                         "\"image\"[, \"path\": ...]}} (video, audio and image URLs are not supported)")
        extra = sorted(set(part) - set(_PART_KEYS[part["type"]]))
        if extra:
            raise BadRow(f"{where} ({part['type']}) has {', '.join(map(repr, extra))}, which finetune does not read"
                         + ("; remote images are not supported: download them" if "url" in extra else ""))
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise BadRow(f"{where} (text) needs a string 'text'")
            parts.append({"type": "text", "text": part["text"]})
            continue
        images.take(where, part)
        parts.append({"type": "image"})
    return parts


def part_texts(content: Any) -> list[str]:
    """The texts of a message's content: itself when a string, its text parts when a list."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def image_size(origin: str, path: str) -> tuple[int, int]:
    """(height, width) of the image as the processor will see it (EXIF rotation applied), from the file's header:
    no pixel is decoded (data.max_image_pixels was checked when the row's images were taken: RowImages)."""
    from PIL import UnidentifiedImageError

    try:
        with open_image(origin, f"the image {path}", path) as image:
            width, height = image.size
            orientation = image.getexif().get(0x0112)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise BadRow(f"{origin}: the image {path} cannot be read ({type(e).__name__}: {e})") from None
    return (width, height) if orientation in _TRANSPOSED else (height, width)


# --- the layout: a family, its processor and its token ids ------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ImageLayout:
    """One model's image layout: its family, its image processor, the ids of its image and vision tokens, and a
    key (a digest of all of it) that samples name so that collate finds the same layout."""

    family_name: str
    family: Family
    processor: Any
    settings: dict[str, Any]
    """What the count needs from the model besides the processor (LLaVA: patch size, CLS tokens, strategy)."""
    image_id: int
    never_trained: frozenset[int]
    before_id: int | None
    after_id: int | None
    key: str

    def tokens(self, height: int, width: int) -> int:
        return self.family.count(self.processor, self.settings, height, width)

    def grid(self, height: int, width: int) -> list[int] | None:
        grid = self.family.grid
        return grid(self.processor, self.settings, height, width) if grid is not None else None


_LAYOUTS: dict[str, ImageLayout] = {}
_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, ImageLayout] = weakref.WeakKeyDictionary()


def make_layout(family_name: str, processor: Any, tokenizer: Any,
                settings: Mapping[str, Any] | None = None) -> ImageLayout:
    """The layout of `family_name` with this image processor, tokenizer and model settings; UserError when the
    tokenizer lacks one of the family's vision tokens as a single token."""
    family = FAMILIES[family_name]
    ids = {}
    for token in {family.placeholder, family.image_token, *family.specials, *filter(None, (family.before,
                                                                                          family.after))}:
        found = tokenizer.convert_tokens_to_ids(token)
        if found is None or found == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(found) != token:
            if token == family.image_token or token in (family.before, family.after):
                raise UserError(f"the tokenizer has no token {token!r}, which {family_name} writes for each image; "
                                "use the model's own tokenizer, or add it with tokenizer.added_special_tokens")
            continue
        ids[token] = found
    settings = dict(settings or {})
    described = json.dumps({"family": family_name, "processor": processor.to_dict(), "ids": ids,
                            "settings": settings}, sort_keys=True, default=str)
    key = hashlib.sha256(described.encode()).hexdigest()[:16]
    layout = ImageLayout(family_name, family, processor, settings, ids[family.image_token],
                         frozenset(ids[t] for t in family.specials if t in ids), ids.get(family.before),
                         ids.get(family.after), key)
    _LAYOUTS.setdefault(key, layout)
    return _LAYOUTS[key]


def attach(tokenizer: Any, layout: ImageLayout) -> None:
    """Make `layout` the one samples tokenized with `tokenizer` use (model/vision.py, when the model is a VLM)."""
    _BY_TOKENIZER[tokenizer] = layout


def adopt(tokenizer: Any, layout: ImageLayout) -> None:
    """A layout made in another process (a spawned tokenizer worker's parent): known by its key here too, and
    attached to this process's tokenizer."""
    attach(tokenizer, _LAYOUTS.setdefault(layout.key, layout))


def layout_for(tokenizer: Any) -> ImageLayout | None:
    """The image layout attached to this tokenizer; None for a text-only model."""
    return _BY_TOKENIZER.get(tokenizer)


def layout_named(key: str) -> ImageLayout:
    """The layout a sample names; a UserError when this process has not loaded it (a sample made for another
    model's processor)."""
    if key not in _LAYOUTS:
        raise UserError("these samples were made for an image processor this run did not load (its settings "
                        "changed since they were tokenized?); rerun `finetune preprocess --rebuild`")
    return _LAYOUTS[key]


# --- placing the images in a rendering -------------------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    """A rendering with every image's placeholder expanded: its text, each image's (start, end) in it (from its first
    vision token to the end of its last: what the processor wrote around them is text), its size, its number of
    features and its tile grid (None but for SmolVLM)."""

    text: str
    spans: tuple[tuple[int, int], ...]
    sizes: tuple[tuple[int, int], ...]
    features: tuple[int, ...]
    grids: tuple[list[int] | None, ...]
    moved: Callable[[int], int]
    """A character position of the rendering -> the same place in the expanded text."""


def place(origin: str, text: str, paths: Sequence[str], layout: ImageLayout) -> Placed:
    """Expand the image placeholders of a rendering, one per image in order; a BadRow when their number is not the
    number of images (a template that does not render image parts, or text that spells the placeholder)."""
    placeholder = layout.family.placeholder
    found, at = [], text.find(placeholder)
    while at >= 0:
        found.append(at)
        at = text.find(placeholder, at + len(placeholder))
    if len(found) != len(paths):
        raise BadRow(f"{origin}: the chat template rendered {len(found)} image placeholders ({placeholder}) for "
                     f"{len(paths)} images: a template that does not render image parts (use the model's own, or "
                     f"tokenizer.chat_template: qwen2_vl), or message text that spells {placeholder}")
    sizes = tuple(image_size(origin, p) for p in paths)
    features = tuple(layout.tokens(h, w) for h, w in sizes)
    grids = tuple(layout.grid(h, w) for h, w in sizes)
    marks = (*layout.family.specials, layout.family.image_token)
    pieces, spans, starts, shifts, last, shift = [], [], [], [], 0, 0
    for at, n, grid in zip(found, features, grids):
        expanded = layout.family.expansion(n, layout.settings, grid)
        pieces += [text[last:at], expanded]
        lo = min(i for i in (expanded.find(m) for m in marks) if i >= 0)
        hi = max(expanded.rfind(m) + len(m) for m in marks if m in expanded)
        spans.append((at + shift + lo, at + shift + hi))
        shift += len(expanded) - len(placeholder)
        starts.append(at)
        shifts.append(shift)
        last = at + len(placeholder)
    pieces.append(text[last:])

    def moved(p: int) -> int:  # shifted by every placeholder that starts before p
        k = bisect.bisect_left(starts, p)
        return p + (shifts[k - 1] if k else 0)

    return Placed("".join(pieces), tuple(spans), sizes, features, grids, moved)


def moved_turns(turns: Sequence[Any], placed: Placed) -> tuple[Any, ...]:
    """The trained spans (chat.spans.TurnSpan) at their places in the expanded text."""
    m = placed.moved
    return tuple(dataclasses.replace(t, start=m(t.start), content_start=m(t.content_start),
                                     content_end=m(t.content_end), end=m(t.end)) for t in turns)


def finish(origin: str, ids: list[int], labels: list[int], offsets: Sequence[tuple[int, int]], paths: Sequence[str],
           placed: Placed | None, layout: ImageLayout) -> dict[str, Any] | None:
    """Take the labels off every image and vision token and everything between an image's first and last (in place),
    and say where each image's tokens are: the sample's `images` entry (None without images). A BadRow when an image
    did not become its number of image tokens."""
    for t, token in enumerate(ids):
        if token in layout.never_trained:
            labels[t] = IGNORE_INDEX
    if placed is None or not paths:
        return None
    starts = [a for a, _ in offsets]
    items = []
    for path, (a, b), size, n, grid in zip(paths, placed.spans, placed.sizes, placed.features, placed.grids):
        first, end = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
        made = sum(ids[t] == layout.image_id for t in range(first, end))
        if made != n:
            raise BadRow(f"{origin}: image {path} should be {n} tokens {layout.family.image_token}, and the tokenizer "
                         f"made {made} tokens of them: its tokenizer does not keep {layout.family.image_token} whole")
        labels[first:end] = [IGNORE_INDEX] * (end - first)  # SmolVLM's tile markers and newlines too
        if layout.before_id is not None and first and ids[first - 1] == layout.before_id:
            first -= 1
        if layout.after_id is not None and end < len(ids) and ids[end] == layout.after_id:
            end += 1
        items.append({"path": path, "size": list(size), "start": first, "length": end - first, "features": n,
                      **({"grid": grid} if grid is not None else {})})
    return {"layout": layout.key, "items": items}


# --- truncation ------------------------------------------------------------------------------------------------

def cut(sample: Mapping[str, Any], length: int) -> tuple[dict[str, Any] | None, str]:
    """The sample cut to its first `length` tokens, without the images that lie wholly after the cut; (None, why)
    when the cut falls inside an image's tokens: such a sample is dropped, never cut."""
    images = sample.get("images")
    kept = {k: v[:length] for k, v in sample.items() if k not in ("images", *TEACHER_KEYS)}
    kept.update(kept_entries(sample, kept["labels"]))  # a stored teacher's entries are per trained token
    if not images:
        return kept, ""
    items = []
    for k, item in enumerate(images["items"]):
        start, end = item["start"], item["start"] + item["length"]
        if start < length < end:
            return None, (f"data.max_seq_len {length} falls inside the tokens of image {k} ({item['path']}, tokens "
                          f"{start} to {end}); a sample is never cut inside an image")
        if end <= length:
            items.append(item)
    if items:
        kept["images"] = {**images, "items": items}
    return kept, ""
