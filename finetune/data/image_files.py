"""One image entry of a row -> a local image file: a path as given, or bytes written once into the image store.

A row names an image by a path (relative to the data file), by `{"bytes": ..., "path": ...}` (how parquet files and
datasets' Image feature keep an image), or by a PIL image (a hub dataset read with decoding on). Bytes are written
once, content-addressed, as `<data cache root>/images/<sha256 of the bytes>.<extension from the image's header>`;
from then on the image is a path like any other: preprocessing reads its size from the file's header, collate loads
its pixels, and no pixel data goes into the token store (docs/vision.md).

A file is written to a temporary name beside it and renamed into place (atomic on POSIX): a reader sees the whole
file or none, and two ranks or processes writing the same image both leave one whole file, the same bytes. A file
already there is reused only when it holds exactly these bytes: one damaged since (same size, other bytes) is
written again. Where a stored file is read back without its source bytes (collate, the data cache's digests), a
file whose bytes do not hash to its name is refused (check_stored), never used.

An image's width x height is read from its header before any pixel is decoded, and one over data.max_image_pixels
is a bad row (check_pixels): a PNG of a few KB can claim 20000 x 20000 pixels and take gigabytes to decode (a
decompression bomb). PIL's own guard (a DecompressionBombWarning over Image.MAX_IMAGE_PIXELS, an error over twice
that) never reaches the user as a warning or a traceback: open_image identifies images without it (the cap is
checked on the size instead), leaving PIL's settings and the warning filters as they are.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any

from finetune.data.cache_root import cache_root_for
from finetune.data.sources import BadRow
from finetune.errors import UserError

STORE_FOLDER = "images"
# data.max_image_pixels' default (the schema's too; its docstring says why this number).
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
MAX_PIXELS_HINT = "resize it, or raise data.max_image_pixels (null: no limit)"
# PIL's format names whose usual extension is not the name itself.
_EXTENSIONS = {"JPEG": "jpg", "TIFF": "tif", "MPO": "jpg"}
_BYTES_KEYS = {"bytes", "path"}
_STORED_NAME = re.compile(r"[0-9a-f]{64}")


def store_dir(cache_dir: str | None) -> Path:
    """Where images given as bytes are written: `images/` under the data cache root."""
    return cache_root_for(cache_dir) / STORE_FOLDER


def image_file(where: str, value: Any, root: str | None, store: Path,
               max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> str:
    """The absolute path of the local file that holds the image `value` names: a path string (relative to `root`),
    a `{"bytes", "path"}` dict (its bytes stored in `store`; without bytes, its path read as a path) or a PIL image;
    a BadRow naming `where` for anything else, and for an image of more than `max_pixels` pixels."""
    if isinstance(value, str):
        return _within(where, local_path(where, value, root), max_pixels)
    if isinstance(value, dict):
        extra = sorted(set(value) - _BYTES_KEYS, key=str)
        if extra:
            raise BadRow(f"{where} has {', '.join(map(repr, extra))}; an image given as an object is "
                         "{\"bytes\": ..., \"path\": ...}")
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray, memoryview)) and len(data):
            return stored(where, bytes(data), store, max_pixels)
        if data is None and isinstance(path, str) and path:
            return _within(where, local_path(where, path, root), max_pixels)
        raise BadRow(f"{where} has neither image bytes nor a path (bytes: {type(data).__name__}, path: {path!r})")
    from PIL import Image

    if isinstance(value, Image.Image):
        name = getattr(value, "filename", "")  # decoded from a file: that file, as it is
        if name and Path(name).is_file():
            return _within(where, str(Path(name).resolve()), max_pixels)
        check_pixels(where, "the image", value.size, max_pixels)  # decoded already; kept from collate's decoding
        return stored(where, _png(value), store, max_pixels)
    raise BadRow(f"{where} is a {type(value).__name__}, not an image: give a path, {{\"bytes\": ..., \"path\": ...}} "
                 "or an image")


def local_path(where: str, value: str, root: str | None) -> str:
    """A local image file's absolute path (relative paths start at `root`, the data file's folder); a BadRow when
    it is a URL or not a file."""
    if not value:
        raise BadRow(f"{where} needs a path: a local image file, relative to the data file")
    if "://" in value:
        raise BadRow(f"{where} is {value!r}: remote images are not supported; download them and give their paths "
                     "(or their bytes)")
    path = Path(value).expanduser()
    if not path.is_absolute() and root is not None:
        path = Path(root) / path
    if not path.is_file():
        raise BadRow(f"{where}: {value!r} is not a file ({path})")
    return str(path.resolve())


def stored(where: str, data: bytes, store: Path, max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> str:
    """The path of the image `data` in the store, written there unless a copy with exactly these bytes already
    is; a BadRow when the bytes are not an image PIL can identify, or one of more than `max_pixels` pixels."""
    target = store / f"{hashlib.sha256(data).hexdigest()}.{_extension(where, data, max_pixels)}"
    if _holds(target, data):  # a copy damaged since it was written (same size, other bytes) is written again
        return str(target)
    try:
        store.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=store, prefix=f".{target.stem[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(temporary, target)  # another writer's rename of the same bytes is as good as ours
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise UserError(f"cannot write images into {store} ({e.strerror or e}); the images a dataset gives as bytes "
                        "are kept there: set data.cache_dir (or $FINETUNE_CACHE_DIR) to a writable folder") from None
    return str(target)


def _holds(target: Path, data: bytes) -> bool:
    """Whether the file `target` holds exactly `data` (read only when its size matches: one read per reuse)."""
    try:
        return target.stat().st_size == len(data) and target.read_bytes() == data
    except OSError:  # absent (or unreadable: writing it again says why)
        return False


def stored_digest(path: str | Path) -> str | None:
    """The SHA-256 a file of the image store is named for (None for any other file: an image given by path)."""
    path = Path(path)
    stem, folder = path.name.split(".", 1)[0], path.parent.name
    return stem if folder == STORE_FOLDER and _STORED_NAME.fullmatch(stem) else None


def check_stored(path: str | Path, digest: str) -> None:
    """A UserError naming the file when `path` is in the image store and `digest` (the SHA-256 of its bytes now) is
    not the one it is named for: the file was damaged after it was written, and its source bytes are not at hand
    here to write it again."""
    named = stored_digest(path)
    if named is not None and named != digest:
        raise UserError(f"the image {path} in the image store does not hold the bytes it is named for (their "
                        f"SHA-256 is {digest[:16]}...): it was damaged after it was written; rerun `finetune "
                        "preprocess --rebuild`, which writes it again from the dataset's bytes")


def open_image(where: str, what: str, source: str | bytes) -> Any:
    """The image `source` (a path, or bytes) opened: its format identified and its header read, no pixel decoded.

    Image.open would first check the size against PIL's own guard, which warns (DecompressionBombWarning, printed
    by the warnings module: silencing it there would reset every module's once-only warnings, each time) or raises
    on it. So the registered formats' own openers are tried here as Image.open tries them (each format's test of the
    first 16 bytes, the common formats first), without that check: the caller checks the size against
    data.max_image_pixels (check_pixels). An opener's own guard (a GIF frame past its screen, ...) is a BadRow naming
    `where` and `what`; other errors (OSError, UnidentifiedImageError, ValueError) are the caller's to word."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, bytes):
        prefix = source[:16]
    else:
        with open(source, "rb") as handle:
            prefix = handle.read(16)
    tried: set[str] = set()
    try:
        for register in (Image.preinit, Image.init):
            register()
            for name in [n for n in Image.ID if n not in tried]:
                tried.add(name)
                factory, accept = Image.OPEN[name]
                accepted = accept is None or accept(prefix)
                if not accepted or isinstance(accepted, str):  # a str: why this format declines it
                    continue
                try:  # a path is opened by the image itself, and closed with it
                    return factory(io.BytesIO(source) if isinstance(source, bytes) else source, None)
                except (SyntaxError, IndexError, TypeError, struct.error):  # not this format after all
                    continue
    except Image.DecompressionBombError as e:
        raise BadRow(f"{where}: {what}: PIL refuses it as a possible decompression bomb ({e}); resize it") from None
    raise UnidentifiedImageError(f"cannot identify image file {what}")


def check_pixels(where: str, what: str, size: tuple[int, int], max_pixels: int | None, hint: str = MAX_PIXELS_HINT,
                 cap: str = "data.max_image_pixels") -> None:
    """A BadRow naming `where` and `what` when an image of `size` (width, height) has more than `max_pixels` pixels
    (None: no cap), saying which `cap` and how to fix it (`hint`)."""
    width, height = size
    if max_pixels is not None and width * height > max_pixels:
        raise BadRow(f"{where}: {what} is {width}x{height} ({width * height:,} pixels), over {cap} "
                     f"({max_pixels:,}); {hint}")


def _within(where: str, path: str, max_pixels: int | None) -> str:
    """`path`, once its header says it is within `max_pixels`. A file that is no image passes: the size read when the
    sample is laid out (images.image_size) says so, naming the row."""
    if max_pixels is None:
        return path
    from PIL import UnidentifiedImageError

    try:
        with open_image(where, f"the image {path}", path) as image:
            check_pixels(where, f"the image {path}", image.size, max_pixels)
    except (OSError, UnidentifiedImageError, ValueError):
        pass
    return path


def _extension(where: str, data: bytes, max_pixels: int | None) -> str:
    """The file extension of the image format the bytes' header names, once the header says the image is within
    `max_pixels`."""
    from PIL import UnidentifiedImageError

    try:
        with open_image(where, "the image", data) as image:
            name, size = image.format, image.size
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise BadRow(f"{where}: {len(data):,} bytes that are not an image PIL can read ({type(e).__name__})") from None
    if not name:
        raise BadRow(f"{where}: {len(data):,} bytes whose image format PIL cannot name")
    check_pixels(where, "the image", size, max_pixels)
    return _EXTENSIONS.get(name, name.lower())


def _png(image: Any) -> bytes:
    """A decoded image without a file, encoded losslessly."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
