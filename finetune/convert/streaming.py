"""Rules for streamed data: `pretraining_dataset` (Axolotl's streamed pre-training corpora) and `streaming`, which
become datasets read as a stream (data.streaming, finetune/data/stream.py), and the stream's buffer size."""

from __future__ import annotations

from finetune.convert.context import Conversion

# A pretraining_dataset entry's keys that carry over (the rest are refused, named).
_ENTRY = {"path": "path", "name": "name", "split": "split", "text_column": "text_field", "field": "text_field",
          "data_files": "data_files"}


def streaming_rules(c: Conversion) -> None:
    """pretraining_dataset -> completion datasets streamed; streaming -> data.streaming; the buffer sizes ->
    data.stream_buffer (Axolotl's is per process too)."""
    corpus = c.get("pretraining_dataset")
    if corpus:
        _corpus(c, corpus if isinstance(corpus, list) else [corpus])
    if c.boolean("streaming") or corpus:
        c.put("data.streaming", True)
    for key in ("streaming_multipack_buffer_size", "pretrain_multipack_buffer_size"):
        if c.get(key) and (c.boolean("streaming") or corpus):
            c.put("data.stream_buffer", c.integer(key, minimum=1))


def _corpus(c: Conversion, entries: list) -> None:
    if c.get("datasets"):
        c.refuse("pretraining_dataset", "with datasets: Axolotl trains on the pretraining corpus alone; give one")
        return
    out = []
    for i, entry in enumerate(entries):
        where = f"pretraining_dataset.{i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            c.refuse(where, "a mapping with a path (a hub dataset or a local file) expected")
            continue
        if entry.get("type") not in (None, "pretrain", "completion"):
            c.refuse(f"{where}.type", f"{entry['type']!r}: pretraining corpora are read as plain text (pretrain)")
        for key in sorted(set(entry) - set(_ENTRY) - {"type"}):
            if entry[key] is not None:
                c.refuse(f"{where}.{key}", "not carried over: a corpus entry takes path, name, split, text_column "
                                           "(or field) and data_files")
        row: dict = {"path": entry["path"], "format": "completion"}
        for key, ours in _ENTRY.items():
            value = entry.get(key)
            if value is not None and key != "path" and not (ours == "text_field" and value == "text"):
                row[ours] = [str(v) for v in value] if isinstance(value, list) else str(value)
        out.append(row)
    c.put("datasets", out)
    c.put("data.truncation", "truncate")  # a corpus's long documents: their first sequence_len tokens, not none
    c.approximate("pretraining_dataset", "a text longer than sequence_len is truncated to its first sequence_len "
                                         "tokens; Axolotl cuts it into sequence_len pieces, each a sample")
