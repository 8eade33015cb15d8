"""Make the GRPO replay example: rollouts of the quickstart's arithmetic prompts, as a replay file.

Writes ``examples/data/grpo_replay.jsonl``: 32 prompts ("What is a + b?", as chat messages), 4 completions each
(the right answer, or one off by a few, each ended by the tokenizer's end token ``<|im_end|>`` in the text), and each
completion's ``rewards: {exact_answer: 1 or 0}``; a few groups are all right or all wrong (no advantage). The
file format is docs/rl.md's "The replay file". Deterministic (random.Random with a fixed seed).

Command (from the repository root)::

    python scripts/make_grpo_replay.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "data" / "grpo_replay.jsonl"
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


if __name__ == "__main__":
    main()
