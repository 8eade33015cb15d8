"""One image entry of a row -> a local image file: a path as given, or bytes written once into the image store.

A row names an image by a path (relative to the data file), by `{"bytes": ..., "path": ...}` (how parquet files and
datasets' Image feature keep an image), or by a PIL image (a hub dataset read with decoding on). Bytes are written
once, content-addressed, as `<data cache root>/images/<sha256 of the bytes>.<extension from the image's header>`;
from then on the image is a path like any other: preprocessing reads its size from the file's header, collate loads
its pixels, and no pixel data goes into the token store (docs/vision.md).

A file is written to a temporary name beside it and renamed into place (atomic on POSIX): a reader sees the whole
file or none, and two ranks or processes writing the same image both leave one whole file, the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

from finetune.data.cache_root import cache_root_for
from finetune.data.sources import BadRow
from finetune.errors import UserError

STORE_FOLDER = "images"
# PIL's format names whose usual extension is not the name itself.
_EXTENSIONS = {"JPEG": "jpg", "TIFF": "tif", "MPO": "jpg"}
_BYTES_KEYS = {"bytes", "path"}


def store_dir(cache_dir: str | None) -> Path:
    """Where images given as bytes are written: `images/` under the data cache root."""
    return cache_root_for(cache_dir) / STORE_FOLDER


def image_file(where: str, value: Any, root: str | None, store: Path) -> str:
    """The absolute path of the local file that holds the image `value` names: a path string (relative to `root`),
    a `{"bytes", "path"}` dict (its bytes stored in `store`; without bytes, its path read as a path) or a PIL image;
    a BadRow naming `where` for anything else."""
    if isinstance(value, str):
        return local_path(where, value, root)
    if isinstance(value, dict):
        extra = sorted(set(value) - _BYTES_KEYS, key=str)
        if extra:
            raise BadRow(f"{where} has {', '.join(map(repr, extra))}; an image given as an object is "
                         "{\"bytes\": ..., \"path\": ...}")
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray, memoryview)) and len(data):
            return stored(where, bytes(data), store)
        if data is None and isinstance(path, str) and path:
            return local_path(where, path, root)
        raise BadRow(f"{where} has neither image bytes nor a path (bytes: {type(data).__name__}, path: {path!r})")
    from PIL import Image

    if isinstance(value, Image.Image):
        name = getattr(value, "filename", "")  # decoded from a file: that file, as it is
        return str(Path(name).resolve()) if name and Path(name).is_file() else stored(where, _png(value), store)
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


def stored(where: str, data: bytes, store: Path) -> str:
    """The path of the image `data` in the store, written there unless a whole copy already is; a BadRow when the
    bytes are not an image PIL can identify."""
    target = store / f"{hashlib.sha256(data).hexdigest()}.{_extension(where, data)}"
    if target.is_file() and target.stat().st_size == len(data):
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


def _extension(where: str, data: bytes) -> str:
    """The file extension of the image format the bytes' header names."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            name = image.format
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise BadRow(f"{where}: {len(data):,} bytes that are not an image PIL can read ({type(e).__name__})") from None
    if not name:
        raise BadRow(f"{where}: {len(data):,} bytes whose image format PIL cannot name")
    return _EXTENSIONS.get(name, name.lower())


def _png(image: Any) -> bytes:
    """A decoded image without a file, encoded losslessly."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
