"""Make the GRPO examples' data: a replay file of rollouts, and prompt datasets to generate from.

Writes ``examples/data/grpo_prompts_train.jsonl`` (800 prompts) and ``examples/data/grpo_prompts_eval.jsonl``
(100, none of them in the train file): the quickstart's arithmetic questions (a + b and a - b with a, b in 0..99,
a * b in 0..12) as chat messages, each with its ``answer`` (what the exact_answer reward compares with).

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


def question(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice("+-*")
    a, b = (rng.randint(0, 12), rng.randint(0, 12)) if kind == "*" else (rng.randint(0, 99), rng.randint(0, 99))
    return f"What is {a} {kind} {b}?", str(a + b if kind == "+" else a - b if kind == "-" else a * b)


def write_prompts() -> None:
    rng = random.Random(SEED + 1)
    held_out: set[str] = set()
    for name, count in (("grpo_prompts_eval.jsonl", 100), ("grpo_prompts_train.jsonl", 800)):
        rows = []
        while len(rows) < count:
            text, answer = question(rng)
            if name == "grpo_prompts_eval.jsonl" and text not in held_out:
                held_out.add(text)
            elif text in held_out:
                continue  # the eval prompts are never trained on
            rows.append({"prompt": [{"role": "user", "content": text}], "answer": answer})
        (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {DATA / name} ({len(rows)} prompts)")


if __name__ == "__main__":
    main()
