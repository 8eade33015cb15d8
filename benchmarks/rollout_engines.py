"""Rollout generation, engine by engine (grpo.engine): generated tokens per second of transformers' `generate` on
left-padded batches (HFGenerator) and of its continuous batching (PagedGenerator) on the same prompts and settings,
medians of interleaved repeats, one process.

    .venv/bin/python benchmarks/rollout_engines.py [--model runs/quickstart/final] [--prompts 64] [--max-new 64]
        [--device cuda] [--dtype bfloat16]

The model: a trained directory (the quickstart's, after `make quickstart`), else the quickstart's architecture at
random init. Prompts: the GRPO example's (examples/data/grpo_prompts_train.jsonl) through the chat template, sampled
at temperature 1, the end-of-turn marker ending a completion (ragged lengths: what continuous batching is for).

Measured on the 2-core Xeon CPU of the development machine (OMP_NUM_THREADS=2, torch 2.13, transformers 5.23), 64
prompts, max 64 new tokens, batches of 16 for generate, medians of 3, the machine shared with another session:
  --model none (random init: completions of 57-60 tokens)   generate 240 tokens/s, paged 1,699: 7.07x
  the quickstart model trained by `make quickstart`        generate 152 tokens/s, paged 167: 1.10x
    (it answers in 2.5 tokens: the time is the prompts' prefill and the per-call setup)
Each paged call ran three full garbage collections (transformers' manager stopping and its batch processor
freed), which PagedGenerator now runs with the older objects frozen out of them (gc.freeze); before and after, one
after the other on the development CPU, --model none --prompts 32 --max-new 16: paged 665 -> 1,555 tokens/s
(generate 2,348 and 2,708 in the same runs: 0.28x -> 0.57x). The H100 figures below are from before it.
On an H100 80GB HBM3 (bf16, torch 2.11, transformers 5.23, 2026-11-28; scripts/gpu_session.sh), 64 prompts, max 64:
  --model none (random init: completions of 58-61 tokens)   generate 2,074 tokens/s, paged 640: 0.31x
  --model /tmp/llama1b (Llama-3.2-1B shape, random init)    generate 851 tokens/s, paged 660: 0.78x
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _model(path: str | None, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.attention.dispatch import ATTN_NAME, register

    register()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "tokenizer")
    if path and Path(path).is_dir():
        lm = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_NAME, dtype=dtype)
        return lm.to(device).eval(), tokenizer, path
    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                  max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_NAME, dtype=dtype)
    return lm.to(device).eval(), tokenizer, "random init"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    from finetune.recipe import GRPOConfig
    from finetune.rl.generation import HFGenerator, PagedGenerator
    from finetune.rl.rollout import end_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "runs" / "quickstart" / "final"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="generate's batch (continuous batching schedules itself)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 on a CPU, bfloat16 on a GPU unless given")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    lm, tokenizer, name = _model(args.model, device, dtype)
    rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "grpo_prompts_train.jsonl").open()]
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for r in rows[:args.prompts]]
    cfg = GRPOConfig(max_new_tokens=args.max_new, temperature=1.0)
    ends = end_ids(tokenizer, lm)
    engines = {"generate": HFGenerator(lm, tokenizer, cfg, ends, device, args.batch),
               "paged": PagedGenerator(lm, tokenizer, cfg, ends, device, args.batch)}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    lengths: dict[str, list[float]] = {k: [] for k in engines}
    for repeat in range(args.repeats):
        for key, engine in engines.items():  # interleaved: the machine's load falls on both alike
            torch.manual_seed(repeat)
            _sync(device)
            start = time.perf_counter()
            out = engine.generate(prompts)
            _sync(device)
            seconds = time.perf_counter() - start
            tokens = sum(map(len, out))
            rates[key].append(tokens / seconds)
            lengths[key].append(tokens / len(out))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"model: {name} ({dtype}) on {where}, torch {torch.__version__}; {len(prompts)} prompts, max {args.max_new} new tokens, generate batches of {args.batch}, "
          f"medians of {args.repeats}")
    for key in engines:
        print(f"  {key:9s} {statistics.median(rates[key]):9.1f} generated tokens/s   "
              f"(mean completion {statistics.median(lengths[key]):.1f} tokens)")
    ratio = statistics.median(rates["paged"]) / statistics.median(rates["generate"])
    print(f"  paged / generate: {ratio:.2f}x")


if __name__ == "__main__":
    main()
