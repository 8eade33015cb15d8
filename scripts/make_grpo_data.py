"""Make the GRPO examples' data: a replay file of rollouts, and prompt datasets to generate from.

Writes ``examples/data/grpo_prompts_train.jsonl`` (377 prompts) and ``examples/data/grpo_prompts_eval.jsonl``
(64, none of them in the train file): every "What is a + b?" with a, b in 0..20, as chat messages, each with its
``answer`` (what the exact_answer reward compares with). Small sums, so that SmolLM2-135M-Instruct
(examples/yaml/grpo-smollm2.yaml) is right sometimes (about 40 % greedy): GRPO needs groups whose rewards differ.

Writes ``examples/data/grpo_replay.jsonl``: 32 prompts ("What is a + b?", as chat messages), 4 completions each
(the right answer, or one off by a few, each ended by the tokenizer's end token ``<|im_end|>`` in the text), and each
completion's ``rewards: {exact_answer: 1 or 0}``; a few groups are all right or all wrong (no advantage). The
file format is docs/rl.md's "The replay file". Deterministic (random.Random with a fixed seed).

Command (from the repository root)::

    python scripts/make_grpo_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
OUT = DATA / "grpo_replay.jsonl"
PROMPTS, GROUP, SEED = 32, 4, 20261125


def main() -> None:
    rng = random.Random(SEED)
    lines = []
    for group in range(PROMPTS):
        a, b = rng.randrange(2, 60), rng.randrange(2, 40)
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        right = rng.choice([0, 1, 2, 3, 4])  # how many of the group are right
        for k in range(GROUP):
            answer = a + b if k < right else a + b + rng.choice([-3, -2, -1, 1, 2, 3])
            lines.append({"group": group, "prompt": prompt, "completion": f"{answer}<|im_end|>",
                          "rewards": {"exact_answer": 1.0 if answer == a + b else 0.0}})
    OUT.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {OUT} ({len(lines)} rollouts)")
    write_prompts()


def write_prompts() -> None:
    """Every sum a + b with a, b in 0..20, shuffled: 64 held out for eval, the other 377 to train on."""
    rng = random.Random(SEED + 1)
    sums = [(a, b) for a in range(21) for b in range(21)]
    rng.shuffle(sums)
    for name, chosen in (("grpo_prompts_eval.jsonl", sums[:64]), ("grpo_prompts_train.jsonl", sums[64:])):
        rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
                for a, b in chosen]
        (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {DATA / name} ({len(rows)} prompts)")


if __name__ == "__main__":
    main()
