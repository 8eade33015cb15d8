"""The preprocessed-data cache: tokenized samples and their statistics on disk, keyed by everything they depend on.

Tokenizing (chat templates rendered, offsets mapped to labels) is the slow part of loading data, and
it is the same for every run that shares data, tokenizer and data settings. `finetune preprocess` and
`finetune train` keep the samples under `<cache root>/<key>/`. The key is a SHA-256 over:

* every local data file's content (SHA-256 of its bytes, never its mtime: a touched file keeps its entry, an
  edited one never reuses it) and suffix; for a hub dataset its name, split and config (a hub dataset that
  changes upstream under the same name is not detected: `finetune preprocess --rebuild` refreshes it);
* each dataset's format options (format, fields, train_on_inputs, max_rows, ...), in recipe order;
* the tokenizer as loaded: the files `save_pretrained` writes (tokenizer.json, tokenizer_config.json, the chat
  template) minus where it was loaded from, so one tokenizer in two places shares entries; the recipe's chat
  template override; the transformers and tokenizers versions (mistral-common's where it encodes), which encode;
* every data.* key but those that act after the samples exist (packing, shuffle, batching, num_proc): so
  max_seq_len, truncation, on_bad_row, max_image_pixels (which images are bad rows), and val_fraction with the
  seed when they pick a validation split;
* DATA_VERSION, which must be bumped whenever code that turns rows into samples changes;
* for a vision-language model, its image layout: the family, the image processor's settings as loaded (every one,
  not only those the family's count rule reads) with the recipe's model.image_processor, the model settings the
  count reads, and the layout's key that samples name; and where the images' paths start: each dataset's folder
  (relative paths; the working directory for a hub dataset) and the folder images given as bytes are written to.

The image files themselves are only known once the rows are read, so they are checked on load instead: the entry
records the SHA-256 of every image file its samples name (taken when it is written, after checking that the file
still has the size its tokens were laid out for), and an entry whose image is gone or has other bytes is rebuilt.
A file of the image store (images given as bytes) is named for its bytes' SHA-256: an entry that recorded another
digest for one (made from a damaged file) is rebuilt, which writes it again from the rows' bytes; a damaged one met
where the rows' bytes are not at hand (its digest taken for a new entry) is refused (image_files.check_stored).

Nothing else is in the key: train.*, packing, shuffling and the model change what happens after the samples
exist, so they reuse the entry. Packing is not cached on purpose: `epoch_rows` repacks every epoch (with a
different seeded grouping), and packing is cheap next to tokenizing.

An entry is a token store (store.py: flat arrays in numpy's .npy format, read without pickle, through memory
maps: a run holds the pages it reads, never the samples as Python objects):

    meta.json                 the key's inputs, DataStats per split (counts, and the bad rows and dropped
                              samples named by file:line), sizes, and a SHA-256 of every array file
    {split}.ids.npy           int32: every sample's tokens, concatenated (split: train, eval)
    {split}.labels.npy        uint8 mask (1: the token is a target) when each label is its token or -100, which
                              our tokenizer guarantees; otherwise the int32 labels themselves
    {split}.offsets.npy       int64: sample i is ids[offsets[i]:offsets[i + 1]]
    {split}.docs.npy          int64 [n, 2], pairs only: chosen and rejected lengths (margins.npy: their margins)
    {split}.images.npy        int64 [m, 9], samples with images only: one row per image (store_images.py); meta.json
                              lists the split's image files and their layout key, and every file's SHA-256
    {split}.teacher_*.npy     int32 ids and float32 log-probabilities [trained tokens, k], offline distillation only
                              (distill.teacher_logprobs: data/teacher_logprobs.py); meta.json gives k

The arrays are written while the data is tokenized, as a stream. The entry is written into a temporary directory beside it and renamed into place, which is atomic on POSIX: a reader
sees a whole entry or none, and two processes writing the same key (ranks of one torchrun) cannot mix files.
The per-file digests catch what the rename cannot: a disk that lost data under a completed rename (power loss),
a truncated copy, a hand-edited file. An entry that fails any check is reported and rebuilt, never used.
The cache root: `data.cache_dir` when the recipe has that key, else $FINETUNE_CACHE_DIR, else $XDG_CACHE_HOME/
finetune/data (~/.cache/finetune/data). Entries are never evicted; deleting any of them (or the root) is safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from finetune.chat.mistral import mistral_common_version
from finetune.data.cache_root import CACHE_ENV, cache_root_for
from finetune.data.image_files import check_stored, store_dir, stored_digest
from finetune.data.images import ImageLayout, image_size, layout_for
from finetune.data.pairs import completion_end
from finetune.data.samples import build_into, build_samples
from finetune.data.sources import BadRow
from finetune.data.stats import DataStats
from finetune.data.store import Samples, SplitWriter
from finetune.data.store_images import check_rows
from finetune.recipe import DatasetConfig, Recipe, local_data_path

# Bump whenever sources.py, formats.py, messages.py, tokenize.py or the truncation in tokenize_examples change
# what samples a row gives (or what the stats say of them): every existing entry then stops matching.
# 3: tool calls, tool messages and tools reach the template; unknown message fields are bad rows.
# 4: samples dropped as too long are named in the stats (an older entry has the count only).
# 5: the arrays are written as a stream and read as memory maps (every file is checked: ids int32, labels dtype).
# 6: preference pairs keep their rows' `margin` (margins.npy, for reward models).
DATA_VERSION = 6
SPLITS = ("train", "eval")
# tokenizer_config.json keys that say where a tokenizer was loaded from, not how it tokenizes.
_WHERE_KEYS = frozenset({"name_or_path", "is_local", "local_files_only", "_commit_hash", "cache_dir", "revision",
                         "token", "tokenizer_file", "vocab_file", "merges_file"})
# Temporary directories older than this were left by a killed writer (a live one renames within minutes).
_STALE_TEMP_S = 24 * 3600


class CacheError(Exception):
    """Why a cache entry (or the key itself) cannot be used; the data is then tokenized afresh."""


@dataclass
class Prepared:
    """Samples ready for training, and where they came from."""

    train: Sequence[dict]  # Samples (memory-mapped from the entry), or a list when the cache was not usable
    evals: Sequence[dict]
    train_stats: DataStats
    eval_stats: DataStats
    hit: bool  # loaded from the cache
    path: Path | None  # the cache entry (None when the cache could not be used)
    note: str  # what happened, for the user: reused, written, rebuilt, or why no cache
    samples_key: str | None = None
    """The content of the training samples' inputs (data files, tokenizer, options; not the eval files): what a
    resume compares instead of file paths, so a run moved to another machine or directory can continue."""
    images_key: str | None = None
    """The bytes of the training samples' image files (None: no images), which samples_key leaves out: an image
    changed under the same path gets a rebuilt entry under the same key, and a resume must see it."""


# --- the key ------------------------------------------------------------------------------------------------

def cache_root(recipe: Recipe) -> Path:
    """Where entries live: data.cache_dir (if the recipe has that key), $FINETUNE_CACHE_DIR, else the user cache."""
    return cache_root_for(getattr(recipe.data, "cache_dir", None))


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks (hashlib.file_digest needs Python 3.11)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of how the tokenizer tokenizes: what save_pretrained writes, minus where it came from, and the
    version of mistral-common where it encodes whole conversations itself. Serializing the loaded tokenizer (not
    the files of tokenizer.path) covers every way one arrives: a directory, a hub id, a GGUF file, a chat template."""
    digest = hashlib.sha256((type(tokenizer).__name__ + "".join(mistral_common_version(tokenizer).values())).encode())
    with tempfile.TemporaryDirectory(prefix="finetune-tok-") as tmp:
        try:
            tokenizer.save_pretrained(tmp)
        except Exception as e:  # a tokenizer that cannot be serialized cannot be fingerprinted: no cache
            raise CacheError(f"the tokenizer cannot be serialized to fingerprint it ({type(e).__name__}: {e})") \
                from None
        for file in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            data = file.read_bytes()
            if file.name == "tokenizer_config.json":
                config = {k: v for k, v in json.loads(data).items() if k not in _WHERE_KEYS}
                data = json.dumps(config, sort_keys=True).encode()
            name = file.relative_to(tmp).as_posix().encode()
            digest.update(len(name).to_bytes(8, "big") + name + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def _source_key(cfg: DatasetConfig, key: str) -> dict[str, Any]:
    options = cfg.model_dump(mode="json", exclude={"path"})
    local = local_data_path(cfg.path)  # the test read_rows uses to tell a local file from a hub dataset name
    if local is not None:
        if not local.is_file():
            raise CacheError(f"{key}.path: {cfg.path} is not a file")  # build_samples says so properly
        try:
            source = {"file_sha256": file_sha256(local), "suffix": local.suffix.lower()}
        except OSError as e:
            raise CacheError(f"{key}.path: cannot read {cfg.path} ({e})") from None
    else:
        source = {"hub": cfg.path}  # split and name are in options
    return {"source": source, **options}


# data.* keys that act only once the samples exist (batching, packing, order, parallelism). Every other data key
# is in the cache key, including keys added to the schema later: a new key can cost one re-tokenization, never a
# stale entry.
_AFTER_SAMPLES = frozenset({"packing", "packing_check", "padding_free", "shuffle", "drop_last", "pad_to_multiple_of",
                            "group_by_length", "num_proc", "cache_dir", "streaming", "stream_buffer"})


def cache_inputs(recipe: Recipe, tokenizer: Any) -> dict[str, Any]:
    """Everything the samples depend on, as JSON-able values: equal inputs give equal samples."""
    import tokenizers
    import transformers

    data = {k: v for k, v in recipe.data.model_dump(mode="json").items() if k not in _AFTER_SAMPLES}
    if data.get("deduplicate") == "none":
        del data["deduplicate"]  # the default: the entries made before the key existed stay valid
    split = not recipe.eval_datasets and recipe.data.val_fraction > 0  # build_samples holds out rows only then
    if not split:
        data["val_fraction"] = 0.0  # ignored by build_samples: must not cost a re-tokenization
    # Where preference completions end (data/pairs.py): in the key only when not the default, so the default's
    # entries (and the DPO reference caches keyed by them) stay valid.
    end = completion_end(recipe)
    layout = layout_for(tokenizer)
    teacher = recipe.distill.teacher_logprobs if recipe.train.objective == "distill" else None
    return {
        **({"images": _image_key(recipe, layout)} if layout is not None else {}),  # absent: text keys unchanged
        **({"teacher_logprobs": teacher} if teacher else {}),  # the rows' stored teacher is read into the samples
        **({"pair_completion_end": end} if end != "marker" else {}),
        "data_version": DATA_VERSION,
        "datasets": [_source_key(d, f"datasets.{i}") for i, d in enumerate(recipe.datasets)],
        "eval_datasets": [_source_key(d, f"eval_datasets.{i}") for i, d in enumerate(recipe.eval_datasets)],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        # The chat template override (and any later tokenizer key) besides the loaded tokenizer's fingerprint,
        # which already reflects it: belt and braces for a template set after loading.
        "tokenizer_keys": {k: v for k, v in recipe.tokenizer.model_dump(mode="json").items()
                           if k != "path" and (k, v) != ("backend", "hf")},  # the default: old entries stay valid
        "libraries": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "data": data,  # max_seq_len, truncation, on_bad_row, val_fraction, ...
        "split_seed": recipe.seed if split else None,
    }


def _image_key(recipe: Recipe, layout: ImageLayout) -> dict[str, Any]:
    """What a vision-language sample depends on besides its row and the tokenizer (the image files aside, which
    are checked on load): the layout, and the folders its images' paths are made in."""
    folders = []
    for cfg in (*recipe.datasets, *recipe.eval_datasets):  # relative image paths start at the data file's folder
        local = local_data_path(cfg.path)
        folders.append(str(local.parent.resolve()) if local is not None else os.getcwd())
    described = {"family": layout.family_name, "processor": layout.processor.to_dict(), "settings": layout.settings,
                 "recipe_image_processor": recipe.model.image_processor}
    # default=str, as the layout's own key does: a processor setting numpy or an enum holds is still described.
    return {"layout": layout.key, **json.loads(json.dumps(described, sort_keys=True, default=str)),
            "folders": folders, "store": str(store_dir(recipe.data.cache_dir))}


def cache_key(inputs: dict[str, Any]) -> str:
    """The entry's directory name: a SHA-256 of the canonical JSON of its inputs (24 hex digits: 96 bits)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


# --- writing and reading entries ---------------------------------------------------------------------------

Fill = Callable[[dict[str, SplitWriter]], dict[str, DataStats]]


def save_entry(root: Path, key: str, inputs: dict[str, Any], splits: dict[str, tuple[Sequence[dict], DataStats]],
               *, replace: bool = False) -> Path:
    """Write an entry of samples already made (lists of sample dicts) atomically; returns its path."""
    def fill(writers: dict[str, SplitWriter]) -> dict[str, DataStats]:
        for split, (samples, _) in splits.items():
            for sample in samples:
                writers[split].append(sample)
        return {split: stats for split, (_, stats) in splits.items()}

    return write_entry(root, key, inputs, fill, replace=replace)[0]


def write_entry(root: Path, key: str, inputs: dict[str, Any], fill: Fill, *,
                replace: bool = False) -> tuple[Path, dict[str, DataStats]]:
    """Write an entry atomically (temporary directory + rename): `fill` streams each split's samples into its
    writer and returns their stats. Returns the entry's path and the stats. When an entry with this key already
    exists, it is kept (another process wrote the same samples first) unless `replace` (a broken entry, or
    --rebuild): then it is moved aside and removed."""
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    entry = root / key
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    try:
        writers = {split: SplitWriter(tmp, split) for split in SPLITS}
        try:
            stats = fill(writers)
        finally:
            sizes = {split: writer.close() for split, writer in writers.items()}
        files = {file.name: file_sha256(file) for file in sorted(tmp.glob("*.npy"))}
        meta_splits = {split: {**sizes[split], "stats": asdict(stats[split])} for split in SPLITS}
        meta = {"data_version": DATA_VERSION, "key": key, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "inputs": inputs, "splits": meta_splits, "files": files,
                **({"images": images} if (images := _image_digests(writers.values())) else {})}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        if replace and entry.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{key}-", dir=root))
            with contextlib.suppress(OSError):  # gone already (another process replaced it)
                entry.rename(trash / key)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            tmp.rename(entry)
        except OSError:
            if not entry.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost the race: the winner's entry is the same samples
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry, stats


def _image_digests(writers: Any) -> dict[str, str]:
    """Every image file the splits' samples name -> its SHA-256; a CacheError when a file no longer has the size
    its samples were laid out for (it changed while the data was tokenized: its digest would vouch for the wrong
    layout); a UserError when a file of the image store does not hold the bytes it is named for."""
    digests: dict[str, str] = {}
    for writer in writers:
        for path, size in writer.images.sizes.items():
            try:
                digests[path] = file_sha256(Path(path))
                now = image_size(path, path)
            except (OSError, BadRow) as e:
                raise CacheError(f"the image {path} cannot be read ({e})") from None
            if now != size:
                raise CacheError(f"the image {path} changed while the data was tokenized")
            check_stored(path, digests[path])  # written whole by this build: damaged since, its bytes not at hand
    return digests


def _check_images(meta: dict[str, Any]) -> None:
    """Every image file the entry's samples name still has the bytes it had when they were made, and those of the
    image store the bytes they are named for."""
    for path, digest in meta.get("images", {}).items():
        if stored_digest(path) not in (None, digest):  # recorded from a damaged copy: the rebuild writes it again
            raise CacheError(f"the image {path} was recorded with other bytes than the image store names it for")
        try:
            same = file_sha256(Path(path)) == digest
        except OSError as e:
            raise CacheError(f"the image {path} cannot be read ({e.strerror or e})") from None
        if not same:
            raise CacheError(f"the image {path} changed since the samples were made")


def _remove_stale_temps(root: Path) -> None:
    now = time.time()
    for path in root.glob(".t*-*"):  # .tmp-* and .trash-*
        try:
            if now - path.stat().st_mtime > _STALE_TEMP_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def load_entry(entry: Path, key: str, *, verify: bool = True) -> dict[str, tuple[Samples, DataStats]]:
    """Open an entry's samples (memory-mapped) and stats; CacheError when anything about it is off. `verify`
    checks every file against its digest (off only for an entry this process has just written)."""
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        if meta.get("data_version") != DATA_VERSION or meta.get("key") != key:
            raise CacheError(f"meta.json is for key {meta.get('key')} at data version {meta.get('data_version')}")
        for file, digest in meta["files"].items() if verify else ():
            if file_sha256(entry / file) != digest:
                raise CacheError(f"{file} does not match its checksum")
        if verify:  # the images' bytes: not part of the key (known only once the rows are read)
            _check_images(meta)
        out = {}
        for split in SPLITS:
            info = meta["splits"][split]
            samples = Samples.open(entry, split, info["labels"], info)
            _check_fits(samples, info, split)
            if samples.images is not None and (problem := check_rows(samples.images, samples.image_paths,
                                                                      samples.lengths)
                                               or _unrecorded(samples.image_paths, meta)):
                raise CacheError(f"the {split} images: {problem}")
            samples.image_digests = {path: meta["images"][path] for path in samples.image_paths}
            known = {f.name for f in fields(DataStats)}
            stats = DataStats(**{k: v for k, v in info["stats"].items() if k in known})
            out[split] = (samples, stats)
        return out
    except CacheError:
        raise
    except FileNotFoundError as e:
        raise CacheError(f"{Path(e.filename or '?').name} is missing") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # json, numpy and shape errors
        raise CacheError(f"unreadable ({type(e).__name__}: {e})") from None


def images_key(train: Sequence[dict]) -> str | None:
    """Prepared.images_key: a digest of the image files the training samples name, as the entry recorded them
    (their SHA-256 taken when it was written, checked when it is loaded), or read now for samples not from one."""
    if isinstance(train, Samples):
        digests = train.image_digests
    else:
        paths = {item["path"] for s in train for item in s.get("images", {}).get("items", [])}
        digests = {path: file_sha256(Path(path)) for path in paths}
        for path, digest in digests.items():
            check_stored(path, digest)
    return cache_key({"images": digests}) if digests else None


def _unrecorded(paths: Sequence[str], meta: dict[str, Any]) -> str | None:
    recorded = meta.get("images", {})
    missing = next((p for p in paths if p not in recorded), None)
    return None if missing is None else f"{missing} has no recorded digest"


def _check_fits(samples: Samples, info: dict[str, Any], split: str) -> None:
    ids, labels, offsets, n = samples.ids, samples.labels, samples.offsets, info["samples"]
    label_type = np.uint8 if info["labels"] == "mask" else np.int32
    if (ids.ndim != 1 or ids.dtype != np.int32 or labels.shape != ids.shape or labels.dtype != label_type
            or offsets.shape != (n + 1,) or offsets[0] != 0 or offsets[-1] != len(ids)
            or (n and np.any(samples.lengths <= 0))):
        raise CacheError(f"the {split} arrays do not fit together")
    docs = samples.docs
    if docs is not None and (docs.shape != (n, 2) or np.any(docs.sum(axis=1) != samples.lengths)):
        raise CacheError(f"the {split} pair lengths do not fit the samples")
    if samples.teacher is not None:
        shape = (int(samples.teacher_offsets[-1]), info["teacher_k"])
        if any(column.shape != shape for column in samples.teacher):
            raise CacheError(f"the {split} stored teacher does not fit the samples' trained tokens")


# --- the entry point ------------------------------------------------------------------------------------------

def prepare(recipe: Recipe, tokenizer: Any, *, rebuild: bool = False) -> Prepared:
    """The recipe's samples: from the cache when an entry for exactly these inputs exists, else tokenized into a
    new entry (as a stream: no split is held in memory whole). Never fails because of the cache: an unusable entry
    is rebuilt, an unwritable root is skipped (the samples are then made in memory)."""
    if recipe.data.streaming:  # training rows are read as training goes (stream.py); stream_cache imports this module
        from finetune.data.stream_cache import prepare_streamed
        return prepare_streamed(recipe, tokenizer, rebuild=rebuild)
    notes: list[str] = []
    try:
        inputs = cache_inputs(recipe, tokenizer)
    except CacheError as e:
        train, evals, train_stats, eval_stats = build_samples(recipe, tokenizer)  # raises the user's error
        return Prepared(train, evals, train_stats, eval_stats, False, None, f"data cache not used: {e}")
    key = cache_key(inputs)
    samples_key = cache_key({k: v for k, v in inputs.items() if k != "eval_datasets"})
    root = cache_root(recipe)
    entry = root / key
    broken = False
    if entry.exists() and not rebuild:
        start = time.perf_counter()
        try:
            loaded = load_entry(entry, key)
            (train, train_stats), (evals, eval_stats) = loaded["train"], loaded["eval"]
            return Prepared(train, evals, train_stats, eval_stats, True, entry,
                            f"using cached preprocessed data from {entry} "
                            f"(loaded in {time.perf_counter() - start:.2f} s)", samples_key, images_key(train))
        except CacheError as e:
            broken = True
            notes.append(f"ignoring the cached data at {entry}: {e}; tokenizing again")
    start = time.perf_counter()
    try:
        written, _ = write_entry(root, key, inputs, lambda out: dict(zip(SPLITS, build_into(
            recipe, tokenizer, out["train"], out["eval"]))), replace=broken or rebuild)
        loaded = load_entry(written, key, verify=False)
    except (OSError, CacheError) as e:
        notes.append(f"warning: could not write the data cache under {root} ({getattr(e, 'strerror', None) or e}); "
                     f"continuing without it. Set {CACHE_ENV} (or data.cache_dir) to a writable directory.")
        train, evals, train_stats, eval_stats = build_samples(recipe, tokenizer)
        return Prepared(train, evals, train_stats, eval_stats, False, None, "\n".join(notes), samples_key,
                        images_key(train))
    (train, train_stats), (evals, eval_stats) = loaded["train"], loaded["eval"]
    seconds = time.perf_counter() - start
    rows, tokens = train_stats.rows_read + eval_stats.rows_read, train_stats.input_tokens + eval_stats.input_tokens
    notes.append(f"tokenized in {seconds:.1f} s ({rows / seconds:,.0f} rows/s, {tokens / seconds:,.0f} tokens/s); "
                 f"cached at {written} (runs with the same data, tokenizer and data settings reuse it)")
    return Prepared(train, evals, train_stats, eval_stats, False, written, "\n".join(notes), samples_key,
                    images_key(train))
