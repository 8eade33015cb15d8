"""What is prepared before a streamed run (data.streaming): its eval samples, tokenized and cached as any recipe's,
and the stream's identity (the samples key a checkpoint records), without reading the training datasets.

The eval entry is an ordinary cache entry whose key has no training datasets (`"datasets": []`, which no other
recipe has) and whose train split is empty. The identity is cache.py's key with the training datasets described
instead of hashed whole: a local file by its size and the SHA-256 of its first and last MiB (hashing every byte is
the full pass streaming avoids; an edit inside a large file that keeps its size is not seen), a hub dataset by its
name, split, config and data_files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from finetune.data.cache import (
    CacheError,
    Prepared,
    cache_inputs,
    cache_key,
    cache_root,
    load_entry,
    write_entry,
)
from finetune.data.pairs import completion_end
from finetune.data.samples import iter_chunks
from finetune.data.shards import Job, tokenize_stream, workers_for
from finetune.data.stats import DataStats
from finetune.data.store import SplitWriter
from finetune.recipe import DatasetConfig, Recipe, local_data_path

SAMPLED_BYTES = 1 << 20  # of a streamed local file, the first and the last MiB are hashed into its identity


def prepare_streamed(recipe: Recipe, tokenizer: Any, *, rebuild: bool = False) -> Prepared:
    """cache.prepare for a streamed recipe: no training samples (the stream makes them as training goes), the eval
    samples from the cache (or tokenized into it), the stream's identity as the samples key."""
    evals, stats, path, hit, note = _eval_samples(recipe, tokenizer, rebuild)
    paths = ", ".join(d.path for d in recipe.datasets)
    return Prepared([], evals, DataStats(), stats, hit, path,
                    f"datasets: streamed (data.streaming): {paths} read, tokenized and packed as training goes; "
                    f"nothing of them is preprocessed, cached or counted ahead; {note}",
                    stream_key(recipe, tokenizer))


def _eval_samples(recipe: Recipe, tokenizer: Any, rebuild: bool) -> tuple[Any, DataStats, Path | None, bool, str]:
    """(eval samples, their stats, the cache entry, whether it was there already, what happened)."""
    if not recipe.eval_datasets:
        return [], DataStats(), None, False, "no eval_datasets"
    try:
        inputs = cache_inputs(recipe.model_copy(update={"datasets": []}), tokenizer)
    except CacheError as e:
        return (*_in_memory(recipe, tokenizer), None, False, f"eval data cache not used: {e}")
    key, root = cache_key(inputs), cache_root(recipe)
    entry, notes = root / key, []
    if entry.exists() and not rebuild:
        try:
            evals, stats = load_entry(entry, key)["eval"]
            return evals, stats, entry, True, f"eval_datasets: using cached preprocessed data from {entry}"
        except CacheError as e:
            notes.append(f"ignoring the cached eval data at {entry}: {e}; tokenizing again")
    try:
        written, _ = write_entry(root, key, inputs, lambda out: {
            "train": DataStats(), "eval": _tokenize_evals(recipe, tokenizer, out["eval"])}, replace=bool(notes) or rebuild)
        evals, stats = load_entry(written, key, verify=False)["eval"]
    except (OSError, CacheError) as e:
        notes.append(f"warning: could not write the data cache under {root} ({getattr(e, 'strerror', None) or e}); "
                     "continuing without it")
        return (*_in_memory(recipe, tokenizer), None, False, "; ".join(notes))
    return evals, stats, written, False, "; ".join([*notes, f"eval_datasets: tokenized and cached at {written}"])


def _in_memory(recipe: Recipe, tokenizer: Any) -> tuple[list[dict], DataStats]:
    evals: list[dict] = []
    return evals, _tokenize_evals(recipe, tokenizer, evals)


def _tokenize_evals(recipe: Recipe, tokenizer: Any, out: list[dict] | SplitWriter) -> DataStats:
    """The eval datasets' samples into `out`, as cache.prepare makes them (worker processes, data.num_proc)."""
    data = recipe.data
    stats, tokenized = DataStats(), DataStats()
    job = Job(tokenizer, data, data.on_bad_row, dict(recipe.tokenizer.chat_template_kwargs or {}),
              pair_end=completion_end(recipe))
    chunks = iter_chunks(recipe.eval_datasets, data.on_bad_row, "eval_datasets", data, workers_for(data) > 1)
    failure = tokenize_stream(chunks, job, tokenized, out, workers_for(data), read_stats=stats)
    if failure is not None:
        raise failure
    stats.add(tokenized)
    return stats


def stream_key(recipe: Recipe, tokenizer: Any) -> str | None:
    """The streamed training data's identity: cache.py's samples key, with each training dataset described by
    stream_source instead of its whole content (None when the tokenizer cannot be fingerprinted, or a file read)."""
    try:
        inputs = cache_inputs(recipe.model_copy(update={"datasets": [], "eval_datasets": []}), tokenizer)
        inputs["datasets"] = [stream_source(d) for d in recipe.datasets]
    except (CacheError, OSError):
        return None
    del inputs["eval_datasets"]
    return cache_key({**inputs, "streamed": True})


def stream_source(cfg: DatasetConfig) -> dict[str, Any]:
    """A streamed dataset's identity: its options, and a local file's size and the SHA-256 of its first and last
    SAMPLED_BYTES (a hub dataset: its name; split, config and data_files are options)."""
    options = cfg.model_dump(mode="json", exclude={"path"})
    local = local_data_path(cfg.path)
    if local is None:
        return {"source": {"hub": cfg.path}, **options}
    with local.open("rb") as handle:
        size = local.stat().st_size
        head = hashlib.sha256(handle.read(SAMPLED_BYTES)).hexdigest()
        handle.seek(max(0, size - SAMPLED_BYTES))
        tail = hashlib.sha256(handle.read(SAMPLED_BYTES)).hexdigest()
    return {"source": {"size": size, "head_sha256": head, "tail_sha256": tail, "suffix": local.suffix.lower()},
            **options}
