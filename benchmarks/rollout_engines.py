"""Rollout generation, engine by engine (grpo.engine): generated tokens per second of transformers' `generate` on
left-padded batches (HFGenerator) and of its continuous batching (PagedGenerator) on the same prompts and settings,
medians of interleaved repeats, one process.

    .venv/bin/python benchmarks/rollout_engines.py [--model runs/quickstart/final] [--prompts 64] [--max-new 64]

The model: a trained directory (the quickstart's, after `make quickstart`), else the quickstart's architecture at
random init. Prompts: the GRPO example's (examples/data/grpo_prompts_train.jsonl) through the chat template, sampled
at temperature 1, the end-of-turn marker ending a completion (ragged lengths: what continuous batching is for).

Measured on the 2-core Xeon CPU of the development machine (OMP_NUM_THREADS=2, torch 2.13, transformers 5.23), 64
prompts, max 64 new tokens, batches of 16 for generate, medians of 3, the machine shared with another session:
  --model none (random init: completions of 57-60 tokens)   generate 240 tokens/s, paged 1,699: 7.07x
  the quickstart model trained by `make quickstart`        generate 152 tokens/s, paged 167: 1.10x
    (it answers in 2.5 tokens: the time is the prompts' prefill and the per-call setup)
On a GPU: not measured yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _model(path: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.attention.dispatch import ATTN_NAME, register

    register()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "tokenizer")
    if path and Path(path).is_dir():
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_NAME).eval(), tokenizer, path
    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                  max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_NAME).eval(), tokenizer, "random init"


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
    args = ap.parse_args()
    lm, tokenizer, name = _model(args.model)
    rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "grpo_prompts_train.jsonl").open()]
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for r in rows[:args.prompts]]
    cfg = GRPOConfig(max_new_tokens=args.max_new, temperature=1.0)
    ends = end_ids(tokenizer, lm)
    engines = {"generate": HFGenerator(lm, tokenizer, cfg, ends, torch.device("cpu"), args.batch),
               "paged": PagedGenerator(lm, tokenizer, cfg, ends, torch.device("cpu"), args.batch)}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    lengths: dict[str, list[float]] = {k: [] for k in engines}
    for repeat in range(args.repeats):
        for key, engine in engines.items():  # interleaved: the machine's load falls on both alike
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = engine.generate(prompts)
            seconds = time.perf_counter() - start
            tokens = sum(map(len, out))
            rates[key].append(tokens / seconds)
            lengths[key].append(tokens / len(out))
    print(f"model: {name}; {len(prompts)} prompts, max {args.max_new} new tokens, generate batches of {args.batch}, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}")
    for key in engines:
        print(f"  {key:9s} {statistics.median(rates[key]):9.1f} generated tokens/s   "
              f"(mean completion {statistics.median(lengths[key]):.1f} tokens)")
    ratio = statistics.median(rates["paged"]) / statistics.median(rates["generate"])
    print(f"  paged / generate: {ratio:.2f}x")


if __name__ == "__main__":
    main()
