"""Data at corpus scale: `finetune preprocess --rebuild` against Hugging Face datasets' map, on the same chat rows.

    .venv/bin/python benchmarks/data_scale.py                  # 300,000 rows (a few minutes on 2 cores)
    .venv/bin/python benchmarks/data_scale.py --rows 30000     # a quick look
    .venv/bin/python benchmarks/data_scale.py --rows 1000000 --only ours --train-start   # and a warm start
    .venv/bin/python benchmarks/data_scale.py --rows 300000 --only ours --format parquet   # or json, json-data

The rows: examples/data/quickstart_train.jsonl repeated, each copy's first message given a distinct suffix
(" [row 12345]"), so no two rows are equal (and no cache of either pipeline can reuse one row for another).
`--format json|json-data|parquet` gives both pipelines the same rows as one .json array, a .json {"data": [...]}
object (HF reads it with field="data") or a parquet file (row groups of 10,000 rows): the peak memory then says whether those files are streamed.

Two pipelines, each in its own subprocess, one after the other, on the same rows file:

* ours: `python -m finetune preprocess RECIPE --rebuild` with the quickstart's tokenizer and data settings
  (chat format, exact assistant masking, max_seq_len 512, packing on) and a fresh data.cache_dir: reading,
  tokenizing with the chat template, masking, the statistics, the cache entry, the packing of epoch 0 and the
  report it prints;
* HF datasets: `load_dataset("json")` + `map(apply_chat_template + tokenize, batched=True, num_proc=cores)`, with a
  fresh datasets cache: the tokens only (no masks, no packing, no statistics).

Each is timed end to end as a process (interpreter start and imports included, the same for both: each imports
transformers). Reported per pipeline: wall seconds, rows/s, tokens/s (ours: the tokens of its samples, from the cache
entry's statistics; HF: the lengths of its input_ids), the CPU seconds of the process and its workers (user + system,
from wait4: on a machine shared with other work the wall time swings with its load, the CPU time much less, so rows
per CPU second compares the pipelines' work where wall times cannot), the largest single process's peak RSS (ru_maxrss of the
process and of every descendant it waited for, from wait4) and the peak of the summed PSS of the process and all its
descendants, sampled every 0.2 s from /proc (PSS shares the pages of forked workers out among them, so the sum is
the memory the pipeline really held; RSS summed would count them once per worker).

`datasets` is one of finetune's own dependencies; where it is missing (`pip install datasets`), its column is
skipped with that note. Timings depend on the machine and its load: compare columns of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tokenizer"
QUICKSTART = ROOT / "examples" / "data" / "quickstart_train.jsonl"
MODEL = {"init": "random", "config": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
                                      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "max_position_embeddings": 1024, "tie_word_embeddings": True},
         "dtype": "float32"}

HF_SCRIPT = r"""
import json, sys
from datasets import load_dataset
from transformers import AutoTokenizer

rows, tokenizer_dir, cache, cores = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
builder = "parquet" if rows.endswith(".parquet") else "json"
field = {"field": "data"} if rows.endswith("-data.json") else {}
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

def tokenize(batch):
    texts = tokenizer.apply_chat_template(batch["messages"], tokenize=False)
    out = tokenizer(texts, add_special_tokens=False)
    return {"input_ids": out["input_ids"], "length": [len(ids) for ids in out["input_ids"]]}

dataset = load_dataset(builder, data_files=rows, split="train", cache_dir=cache, **field)
mapped = dataset.map(tokenize, batched=True, num_proc=cores, remove_columns=dataset.column_names)
print(json.dumps({"rows": len(mapped), "tokens": int(sum(mapped["length"]))}))
"""


def make_rows(path: Path, n: int) -> None:
    """n chat rows: the quickstart rows over and over, each with a distinct suffix on its first message."""
    base = [json.loads(line) for line in QUICKSTART.read_text(encoding="utf-8").splitlines() if line.strip()]
    with path.open("w", encoding="utf-8") as out:
        for i in range(n):
            row = base[i % len(base)]
            messages = [dict(m) for m in row["messages"]]
            messages[0]["content"] = f"{messages[0]['content']} [row {i}]"
            out.write(json.dumps({"messages": messages}) + "\n")


def convert_rows(jsonl: Path, fmt: str) -> Path:
    """The same rows as a .json array (one item a line), a .json {"data": [...]} object (json-data) or a .parquet
    file (row groups of 10,000), written as a stream."""
    out = jsonl.with_name(jsonl.stem + "-data.json") if fmt == "json-data" else jsonl.with_suffix(f".{fmt}")
    if out.is_file():
        return out
    with jsonl.open(encoding="utf-8") as lines:
        if fmt in ("json", "json-data"):
            opening, closing = ("[\n", "\n]\n") if fmt == "json" else ('{"data": [\n', "\n]}\n")
            with out.open("w", encoding="utf-8") as handle:
                handle.write(opening)
                for i, line in enumerate(lines):
                    handle.write(("" if i == 0 else ",\n") + line.rstrip("\n"))
                handle.write(closing)
            return out
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        while batch := [json.loads(line) for _, line in zip(range(10_000), lines)]:
            table = pa.Table.from_pylist(batch)
            writer = writer or pq.ParquetWriter(out, table.schema)
            writer.write_table(table)
        if writer:
            writer.close()
    return out


def write_recipe(work: Path, rows: Path, cache: Path, num_proc: int | None, val_fraction: float = 0.0) -> Path:
    import yaml

    data: dict[str, Any] = {"max_seq_len": 512, "packing": True, "cache_dir": str(cache)}
    if num_proc is not None:
        data["num_proc"] = num_proc
    if val_fraction:
        data["val_fraction"] = val_fraction
    recipe = {"output_dir": str(work / "run"), "seed": 0, "model": MODEL, "tokenizer": {"path": str(TOKENIZER)},
              "datasets": [{"path": str(rows), "format": "chat"}], "data": data}
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # after "pid (comm) state"
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_mib(root: int) -> float:
    """The summed PSS of a process and all its descendants, now (MiB)."""
    tree, todo, total = _children(), [root], 0
    while todo:
        pid = todo.pop()
        total += _pss_kib(pid)
        todo.extend(tree.get(pid, []))
    return total / 1024


def run_measured(command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a command; its wall time, output, largest process's peak RSS and the peak summed PSS of its tree."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], tree_pss_mib(process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = process.stdout.read().decode("utf-8", "replace") if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss (KiB on Linux): the largest of the process and the descendants it waited for.
    return {"wall": wall, "output": output, "rc": process.returncode, "rss_mib": usage.ru_maxrss / 1024,
            "pss_mib": peak[0], "cpu": usage.ru_utime + usage.ru_stime}


def fresh(path: Path) -> Path:
    """An empty directory (a cache of an earlier run must not serve this one)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def run_ours(work: Path, rows: Path, num_proc: int | None, val_fraction: float = 0.0) -> dict[str, Any]:
    cache = fresh(work / "ours-cache")
    recipe = write_recipe(work, rows, cache, num_proc, val_fraction)
    result = run_measured([sys.executable, "-m", "finetune", "preprocess", str(recipe), "--rebuild"])
    if result["rc"] != 0:
        raise SystemExit(f"finetune preprocess failed:\n{result['output'][-4000:]}")
    (meta,) = cache.glob("*/meta.json")
    stats = json.loads(meta.read_text(encoding="utf-8"))["splits"]["train"]["stats"]
    return {**result, "rows": stats["rows_read"], "tokens": stats["tokens"]}


def run_train_start(work: Path) -> dict[str, Any]:
    """`finetune train` for one optimizer step from the cache `run_ours` filled (a warm start): everything a run
    does before and around its first step (imports, the model, the cache entry opened, packing planned from the
    lengths, one step of the tiny model, the final save), timed as a process, with its peak memory."""
    result = run_measured([sys.executable, "-m", "finetune", "train", str(work / "recipe.yaml"), "--overwrite",
                           "train.max_steps=1", "train.micro_batch_size=1", "data.packing_check=false",
                           "eval.at_start=false", "eval.every_steps=null", "checkpoint.every_steps=null"])
    if result["rc"] != 0:
        raise SystemExit(f"finetune train failed:\n{result['output'][-4000:]}")
    if "using cached preprocessed data" not in result["output"]:
        print(f"note: the run did not say it reused the cache:\n{result['output'][-2000:]}")
    return result


def run_hf(work: Path, rows: Path, cores: int) -> dict[str, Any] | str:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return "datasets not installed (pip install datasets): HF column skipped"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = run_measured([sys.executable, "-c", HF_SCRIPT, str(rows), str(TOKENIZER), str(fresh(work / "hf-cache")),
                           str(cores)], env)
    if result["rc"] != 0:
        raise SystemExit(f"the datasets pipeline failed:\n{result['output'][-4000:]}")
    counts = json.loads(result["output"].strip().splitlines()[-1])
    return {**result, **counts}


def table(n_rows: int, fmt: str, cores: int, load: float, results: dict[str, Any]) -> list[str]:
    lines = [f"{n_rows:,} chat rows ({fmt}), {cores} cores (os.sched_getaffinity), 1-minute load average before: {load:.2f}",
             "| pipeline | wall s | rows/s | tokens | tokens/s | CPU s | rows per CPU s | peak RSS, largest process | "
             "peak PSS, all processes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {name} | {r} | | | | | | | |")
            continue
        lines.append(f"| {name} | {r['wall']:.1f} | {r['rows'] / r['wall']:,.0f} | {r['tokens']:,} | "
                     f"{r['tokens'] / r['wall']:,.0f} | {r['cpu']:.1f} | {r['rows'] / r['cpu']:,.0f} | "
                     f"{r['rss_mib']:,.0f} MiB | {r['pss_mib']:,.0f} MiB |")
    ours, hf = results.get("ours"), results.get("hf datasets")
    if isinstance(ours, dict) and isinstance(hf, dict):
        lines.append(f"ours / HF throughput (rows/s): {hf['wall'] / ours['wall']:.2f}x; per CPU second: "
                     f"{hf['cpu'] / ours['cpu']:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                        help="HF's num_proc (default: the cores this process may use)")
    parser.add_argument("--num-proc", type=int, default=None,
                        help="our data.num_proc (default: the recipe default)")
    parser.add_argument("--val-fraction", type=float, default=0.0,
                        help="our data.val_fraction (rows, tokens: the training split's)")
    parser.add_argument("--only", choices=["ours", "hf"], default=None)
    parser.add_argument("--format", choices=["jsonl", "json", "json-data", "parquet"], default="jsonl",
                        help="the rows as JSONL (default), one .json array, a .json {\"data\": [...]} object, or "
                             "parquet: the same rows")
    parser.add_argument("--work", type=Path, default=None, help="keep the rows, caches and recipe here")
    parser.add_argument("--train-start", action="store_true",
                        help="then time `finetune train` for one step from our warm cache, with its peak memory")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="finetune-data-scale-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = work / f"rows-{args.rows}.jsonl"
        if not rows.is_file():
            make_rows(rows, args.rows)
        if args.format != "jsonl":
            rows = convert_rows(rows, args.format)
        results: dict[str, Any] = {}
        load = os.getloadavg()[0]
        if args.only in (None, "ours"):
            results["ours"] = run_ours(work, rows, args.num_proc, args.val_fraction)
        if args.only in (None, "hf"):
            results["hf datasets"] = run_hf(work, rows, args.cores)
        for line in table(args.rows, args.format, args.cores, load, results):
            print(line)
        if args.train_start and "ours" in results:
            start = results["train start"] = run_train_start(work)
            print(f"training start from the warm cache (one step, the tiny model): {start['wall']:.1f} s wall, "
                  f"{start['cpu']:.1f} CPU s, peak RSS {start['rss_mib']:,.0f} MiB, peak PSS {start['pss_mib']:,.0f} MiB")
        if args.json:
            figures = {k: ({kk: vv for kk, vv in v.items() if kk != "output"} if isinstance(v, dict) else v)
                       for k, v in results.items()}
            args.json.write_text(json.dumps({"rows": args.rows, "format": args.format, "cores": args.cores, **figures},
                                            indent=1) + "\n")


if __name__ == "__main__":
    main()
