"""A chat row's cost in one process: microseconds a row to convert and tokenize N quickstart-like rows (the rows of
benchmarks/data_scale.py) in chunks of 512, as a preprocessing worker does (to_example + data.shards.tokenize_chunk:
layout or rendering, encode, masking, labels, notes, statistics), with the optional cProfile of it.

    .venv/bin/python benchmarks/chat_rows.py                       # 20,000 rows, the quickstart tokenizer
    .venv/bin/python benchmarks/chat_rows.py --rows 50000 --profile 15

The median of --repeats timed passes over the same examples (after one untimed pass: shapes and plans kept, as in
a worker past its first chunk). Timings depend on the machine and its load: compare before and after a change on
the same machine, alternately.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from data_scale import TOKENIZER, make_rows  # noqa: E402

from finetune.data.formats import to_example  # noqa: E402
from finetune.data.shards import tokenize_chunk  # noqa: E402
from finetune.data.sources import RawRow  # noqa: E402
from finetune.data.stats import DataStats  # noqa: E402
from finetune.recipe import DataConfig  # noqa: E402

CHUNK = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, help="also print cProfile's top N functions by own time")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        make_rows(path, args.rows)
        lines = path.read_text(encoding="utf-8").splitlines()
    data = DataConfig(max_seq_len=512)

    def run() -> None:
        examples = [to_example(RawRow(json.loads(line), f"row {i}"), "chat") for i, line in enumerate(lines)]
        for start in range(0, len(examples), CHUNK):
            tokenize_chunk(examples[start:start + CHUNK], tokenizer, data, DataStats(), "error", {}, [])

    run()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    print(f"{args.rows} rows: {statistics.median(times) / args.rows * 1e6:.1f} us a row (median of {args.repeats})")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(run)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
