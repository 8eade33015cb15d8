"""GRPO inputs written for tests: replay files of random rollouts, prompt files, the CLI overrides that train on a
replay file, and a tiny policy model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from helpers import TINY


def write_replay(path: Path, groups: int = 4, size: int = 4, seed: int = 0) -> Path:
    """Rollouts of random ids (vocabulary 1024; end token 2): prompts of varying length, completions of 1 to 12
    tokens, some ending with the end token, rewards 0, 0.5 or 1 (some groups all equal)."""
    rng = random.Random(seed)
    lines = []
    for g in range(groups):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 10))]
        for _ in range(size):
            completion = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 12))] + [2] * rng.randrange(2)
            lines.append({"group": g, "prompt_ids": prompt, "completion_ids": completion,
                          "reward": 1.0 if g == 3 else rng.choice([0.0, 0.5, 1.0])})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def grpo_args(replay: Path, *extra: str) -> list[str]:
    return [*TINY, "datasets=[]", "eval_datasets=[]", "data.packing=false", "train.objective=grpo",
            f"grpo.replay={replay}", "grpo.num_generations=4", "train.warmup_steps=0", "train.lr=1e-2",
            "train.epochs=1", *extra]


def write_prompts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(2, 60), rng.randrange(2, 40)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_lm() -> torch.nn.Module:
    """The tests' tiny Llama (conftest.TINY_MODEL_CONFIG) with a vocabulary of 1024, seeded, in training mode."""
    from conftest import TINY_MODEL_CONFIG
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = {k: v for k, v in TINY_MODEL_CONFIG.items() if k != "model_type"}
    return LlamaForCausalLM(LlamaConfig(**config, vocab_size=1024))
