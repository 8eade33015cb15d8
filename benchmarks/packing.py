"""Packing vs padding: packing efficiency and real-token training throughput, ours and TRL's SFTTrainer.

    .venv/bin/python benchmarks/packing.py                               # TRL half only if `import trl` works
    .venv/bin/python benchmarks/packing.py --trl-path /tmp/trl-pkgs      # TRL installed with
                                         # .venv/bin/pip install --no-deps --target /tmp/trl-pkgs trl==1.16.0
    .venv/bin/python benchmarks/packing.py --trl-python /tmp/trl-venv/bin/python   # or TRL in its own venv

Two long-tailed length distributions:
  * quickstart: examples/data/quickstart_train.jsonl (synthetic chat tasks, 16-379 tokens), max_seq_len 512;
  * lognormal: chat rows synthesized from the quickstart tokenizer's vocabulary whose lengths follow a
    lognormal like a real instruction dataset (median ~250 tokens, long tail cut at 2048), max_seq_len 2048.

For each: packing efficiency of epoch 0 (real tokens / row capacity, our best-fit decreasing), then a fixed
number of optimizer steps of the same tiny random-init Llama with packing on and off, run by our trainer
(the real CLI, `finetune train`) and by TRL's SFTTrainer (bfd packing, i.e. padding-free rows, and padded),
same data, micro-batch, accumulation, max length, float32, one thread each (attention: our `auto` and
TRL's sdpa). Reported: the median over steps (the first, warm-up step left out) of real tokens per second
(tokens of the samples, never padding).
Ours comes from metrics.jsonl (`tokens_per_s` = seq_tokens / step time); TRL's from a callback timing each
optimizer step end to end and a trainer subclass counting the real tokens of its micro-batches.

Reading the results on a CPU: sdpa has no variable-length kernel there. Under `attn_implementation: sdpa`
a packed row attends densely over all of max_seq_len behind a block-diagonal mask (profiled: the attention
kernels were ~64% of a 4 x 2048 packed micro-batch of this model, and the masked step took 1.7x a plain causal
one), which ate the padding saving at 2048. `auto` (our default, finetune/attention/dispatch.py) runs sdpa one document
at a time, so a packed row costs attention within its documents only; the "attn sdpa" row shows the difference.
TRL's padding-free collator joins a micro-batch's packed rows into one sequence of micro x max_seq_len tokens,
so its attention there spans 4 rows at once; the extra "packed 1 x N" run (one row per micro-batch, same rows per
step) is its fairest packed figure.

The TRL half runs in a subprocess (`--trl-python`, default this interpreter, with `--trl-path` prepended to
PYTHONPATH): TRL must not change the pinned torch/transformers of our venv. Without TRL it prints
"TRL not installed: skipped". Timings depend on the machine and its load: compare columns of one run only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without an editable install
    sys.path.insert(0, str(ROOT))

TOKENIZER = ROOT / "examples" / "tokenizer"
QUICKSTART = ROOT / "examples" / "data" / "quickstart_train.jsonl"
# The same tiny model for both trainers: the quickstart's Llama shape with 2 layers (random init, seed 0).
MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def set_width(hidden: int) -> None:
    """Widen (or keep) the benchmark model: intermediate 3x hidden, 32-dim heads, 2 query heads per KV head."""
    heads = max(2, hidden // 32)
    MODEL_CONFIG.update(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 2))


# name -> (max_seq_len, micro_batch_size, gradient_accumulation_steps): the same batch for both distributions and
# every trainer/mode; accumulation does not change tokens/s, so 1 keeps the benchmark short.
SETTINGS = {"quickstart": (512, 4, 1), "lognormal": (2048, 4, 1)}
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "PYTHONUNBUFFERED": "1"}


# --- data ---------------------------------------------------------------------------------------------------

def synthesize_lognormal(path: Path, n: int, seed: int = 0, median: float = 250.0, sigma: float = 0.85,
                         cap: int = 2048) -> Path:
    """Chat rows whose token lengths follow lognormal(ln median, sigma), cut at `cap`.

    Words are whole space-prefixed tokens of the quickstart tokenizer (' the', ' word', ...), so one word is one
    token and the lengths come out as drawn (plus ~10 tokens of chat template). The prompt takes 20-60%.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    words = sorted({t for t in (tokenizer.decode([i]) for i in range(len(tokenizer)))
                    if t.startswith(" ") and t[1:].isalpha() and len(t) > 2})
    rng = random.Random(seed)
    # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n ... <|im_end|>\n is 10 tokens; a first word
    # without its leading space may take 2-3.
    overhead = 16
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(n):
            total = min(cap - overhead, max(8, round(rng.lognormvariate(math.log(median), sigma))))
            prompt = max(1, round(total * rng.uniform(0.2, 0.6)))
            user = "".join(rng.choice(words) for _ in range(prompt)).strip()
            answer = "".join(rng.choice(words) for _ in range(total - prompt)).strip()
            row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
            handle.write(json.dumps(row) + "\n")
    return path


def write_recipe(work: Path, name: str, data: Path, packing: bool, steps: int, attn: str = "auto") -> Path:
    import yaml

    max_len, micro, accumulation = SETTINGS[name]
    recipe = {
        "output_dir": str(work / f"ours-{name}-{'packed' if packing else 'padded'}-{attn}"),
        "seed": 0,
        "model": {"init": "random", "config": MODEL_CONFIG, "dtype": "float32", "attn_implementation": attn},
        "tokenizer": {"path": str(TOKENIZER)},
        "datasets": [{"path": str(data), "format": "chat"}],
        "data": {"max_seq_len": max_len, "packing": packing, "packing_check": False},
        "train": {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation, "max_steps": steps,
                  "epochs": 1, "lr": 1e-3, "lr_scheduler": "constant"},
        "eval": {"at_start": False},
        "logging": {"every_steps": 1},
    }
    path = work / f"{name}-{'packed' if packing else 'padded'}-{attn}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def efficiencies(name: str, data: Path, work: Path) -> dict[str, float]:
    """Epoch 0: packing efficiency (real / rows x max_seq_len) and padded efficiency (real / computed)."""
    from finetune.data.cache import prepare
    from finetune.data.report import pack_epoch0, padded_tokens_of_epoch
    from finetune.model.tokenizer import load_tokenizer
    from finetune.recipe import load_recipe

    recipe = load_recipe(write_recipe(work, name, data, True, 1))
    prepared = prepare(recipe, load_tokenizer(recipe.tokenizer, recipe.model))
    rows, pack = pack_epoch0(prepared.train, recipe)
    _, computed = padded_tokens_of_epoch(prepared.train, recipe)
    lengths = sorted(len(s["input_ids"]) for s in prepared.train)
    return {"samples": len(lengths), "median_len": statistics.median(lengths), "max_len": lengths[-1],
            "p99_len": lengths[int(0.99 * (len(lengths) - 1))], "packed": pack.efficiency,
            "padded": prepared.train_stats.tokens / computed, "rows": len(rows)}


# --- ours -------------------------------------------------------------------------------------------------------

def run_ours(name: str, data: Path, packing: bool, steps: int, work: Path, attn: str = "auto",
             tree: Path | None = None) -> list[tuple[int, float]]:
    """(real tokens, seconds) of every step after the first, from the run's metrics.jsonl. `tree`: run the
    `finetune` of another checkout (a `git worktree` of an older commit, for a bisect) with this venv."""
    recipe = write_recipe(work, name, data, packing, steps, attn)
    env = {**os.environ, **THREAD_ENV}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    result = subprocess.run([sys.executable, "-m", "finetune", "train", str(recipe), "--overwrite"],
                            cwd=tree or ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"finetune train failed ({name}, packing={packing}):\n{result.stdout}\n{result.stderr}")
    out = work / f"ours-{name}-{'packed' if packing else 'padded'}-{attn}"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_run = [r for r in lines if "loss" in r][1:]  # the first step warms up
    return [(r["seq_tokens"], r["seq_tokens"] / r["tokens_per_s"]) for r in steps_run]


# --- TRL ----------------------------------------------------------------------------------------------------------

def trl_env(trl_path: str | None) -> dict[str, str]:
    env = {**os.environ, **THREAD_ENV}
    if trl_path:
        env["PYTHONPATH"] = os.pathsep.join([trl_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def trl_version(python: str, trl_path: str | None) -> str | None:
    probe = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], env=trl_env(trl_path),
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def run_trl(python: str, trl_path: str | None, name: str, data: Path, packing: bool, steps: int, work: Path,
            micro: int, accumulation: int, strategy: str = "bfd") -> list[tuple[int, float]]:
    """(real tokens, seconds) of every step after the first; `strategy`: TRL's packing_strategy when packing."""
    out = work / f"trl-{name}-{strategy if packing else 'padded'}-{micro}x{accumulation}.json"
    max_len = SETTINGS[name][0]
    command = [python, str(Path(__file__).resolve()), "--trl-worker", "--hidden", str(MODEL_CONFIG["hidden_size"]), "--data", str(data), "--out", str(out),
               "--max-len", str(max_len), "--micro", str(micro), "--accumulation", str(accumulation),
               "--steps", str(steps), "--strategy", strategy] + (["--packing"] if packing else [])
    result = subprocess.run(command, cwd=ROOT, env=trl_env(trl_path), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"TRL run failed ({name}, packing={packing}):\n{result.stdout[-3000:]}\n"
                         f"{result.stderr[-3000:]}")
    return [tuple(lap) for lap in json.loads(out.read_text())["laps"][1:]]  # the first step warms up


def trl_worker(args: argparse.Namespace) -> None:
    """Runs in the TRL interpreter: SFTTrainer on the same model, data and batch settings; per-step tokens/s."""
    import torch
    from datasets import load_dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    config = AutoConfig.for_model(**{**MODEL_CONFIG, "vocab_size": len(tokenizer),
                                     "pad_token_id": tokenizer.pad_token_id,
                                     "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    dataset = load_dataset("json", data_files=args.data, split="train")
    laps: list[tuple[int, float]] = []

    class Timed(SFTTrainer):
        """Counts the real tokens of every micro-batch: attention_mask when padded; padding-free rows are all
        real (no pad_to_multiple_of)."""

        real_tokens = 0

        def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> Any:
            mask = inputs.get("attention_mask")
            Timed.real_tokens += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        last = 0.0

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            Clock.last = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            now = time.perf_counter()
            laps.append((Timed.real_tokens, now - Clock.last))
            Timed.real_tokens, Clock.last = 0, now

    with tempfile.TemporaryDirectory() as tmp:
        config_args = SFTConfig(
            output_dir=tmp, max_steps=args.steps, per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=args.accumulation, max_length=args.max_len, packing=args.packing,
            packing_strategy=args.strategy,
            assistant_only_loss=True, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=10_000,
            save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0, bf16=False,
            dataloader_num_workers=0)
        trainer = Timed(model=model, args=config_args, train_dataset=dataset, processing_class=tokenizer,
                        callbacks=[Clock()])
        trainer.train()
    Path(args.out).write_text(json.dumps({"laps": laps}))


# --- report ---------------------------------------------------------------------------------------------------

def summary(label: str, laps: list[tuple[int, float]]) -> tuple[float, float]:
    """Print one run's line and return (median of per-step tokens/s, total tokens / total seconds).

    Padded steps vary a lot (one long sample makes a slow micro-batch), so the aggregate is shown too: it is
    what an epoch's wall time follows.
    """
    per_step = [tokens / seconds for tokens, seconds in laps]
    median = statistics.median(per_step)
    aggregate = sum(t for t, _ in laps) / sum(s for _, s in laps)
    print(f"  {label}: median {median:,.0f} tok/s over {len(per_step)} steps (min {min(per_step):,.0f}, max "
          f"{max(per_step):,.0f}; aggregate {aggregate:,.0f})", flush=True)
    return median, aggregate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run (the first is a warm-up)")
    parser.add_argument("--synthetic-rows", type=int, default=1500)
    parser.add_argument("--datasets", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with TRL installed")
    parser.add_argument("--trl-path", default=None, help="directory prepended to PYTHONPATH for the TRL runs")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL half")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--hidden", type=int, default=128,
                        help="model width (intermediate 3x, heads of 32): attention's share of the step shrinks "
                             "as the model widens, and packing saves the rest")
    # The TRL worker (internal).
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="bfd", help=argparse.SUPPRESS)
    args = parser.parse_args()
    set_width(args.hidden)
    if args.trl_worker:
        trl_worker(args)
        return 0

    work = Path(args.work or tempfile.mkdtemp(prefix="packing-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["FINETUNE_CACHE_DIR"] = str(work / "cache")  # tokenized data of this benchmark stays in its work dir
    started = time.perf_counter()
    trl = None if args.no_trl else trl_version(args.trl_python, args.trl_path)
    if not args.no_trl and trl is None:
        print("TRL not installed: skipped")
    files = {"quickstart": QUICKSTART}
    if "lognormal" in args.datasets:
        files["lognormal"] = synthesize_lognormal(work / "lognormal.jsonl", args.synthetic_rows)

    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, TRL {trl or '-'}; "
          f"model {MODEL_CONFIG['num_hidden_layers']} layers x {MODEL_CONFIG['hidden_size']}, float32, "
          "attn auto (ours) / sdpa (TRL), "
          f"1 thread; {args.steps} steps per run, median of steps 2..{args.steps}", flush=True)
    table = []  # (dataset, efficiency text, trainer, padded, packed)
    for name in args.datasets:
        eff = efficiencies(name, files[name], work)
        max_len, micro, accumulation = SETTINGS[name]
        print(f"{name}: {eff['samples']} samples, length median {eff['median_len']:g}, p99 {eff['p99_len']}, max "
              f"{eff['max_len']}; max_seq_len {max_len}, micro-batch {micro} x accumulation {accumulation}; "
              f"epoch 0 packing efficiency {eff['packed']:.3f} ({eff['rows']} rows), padded {eff['padded']:.3f}",
              flush=True)
        ours = {mode: summary(f"finetune {mode}", run_ours(name, files[name], mode == "packed", args.steps, work))
                for mode in ("padded", "packed")}
        efficiency = f"{eff['packed']:.3f} (padded {eff['padded']:.3f})"
        table.append((name, efficiency, "finetune", ours["padded"], ours["packed"]))
        # The same packed rows under transformers' sdpa: isolated by a block-diagonal mask over the whole row.
        masked = summary("finetune packed, attn sdpa", run_ours(name, files[name], True, args.steps, work, "sdpa"))
        table.append((name, "", "finetune, attn sdpa (block-diagonal mask)", ours["padded"], masked))
        if not trl:
            continue
        runs = {mode: summary(f"TRL {mode}", run_trl(args.trl_python, args.trl_path, name, files[name],
                                                      mode == "packed", args.steps, work, micro, accumulation))
                for mode in ("padded", "packed")}
        table.append((name, "", f"TRL {trl} SFTTrainer", runs["padded"], runs["packed"]))
        # TRL's padding-free collator joins a micro-batch's packed rows into ONE sequence (micro x max_seq_len
        # tokens) that attends over all of it: with 1 row per micro-batch (same rows per step) it attends within
        # max_seq_len, like ours. Its fairest packed figure.
        one_row = summary(f"TRL packed, micro-batch 1 x accumulation {micro * accumulation}",
                          run_trl(args.trl_python, args.trl_path, name, files[name], True, args.steps, work, 1,
                                  micro * accumulation))
        table.append((name, "", f"TRL {trl} SFTTrainer, packed 1 x {micro * accumulation}", runs["padded"], one_row))

    print()
    print("| dataset | packing efficiency | trainer | padded tok/s | packed tok/s | packed / padded | "
          "finetune packed / this packed |")
    print("|---|---|---|---|---|---|---|")
    ours_packed = {name: packed for name, _, trainer, _, packed in table if trainer == "finetune"}
    for name, efficiency, trainer, padded, packed in table:
        cells = [f"{m:,.0f} ({a:,.0f})" for m, a in (padded, packed)]
        ratios = [f"{x / y:.2f}x ({u / v:.2f}x)" for (x, u), (y, v) in ((packed, padded), (ours_packed[name], packed))]
        print(f"| {name} | {efficiency} | {trainer} | {cells[0]} | {cells[1]} | {ratios[0]} | {ratios[1]} |")
    print("\nmedian of per-step real tokens/s (in brackets: total real tokens / total time of the measured steps)")
    print(f"(whole benchmark {time.perf_counter() - started:.0f} s; work dir {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
