"""Make the tool-use examples' data: a calculator tool's conversations to warm a small model up on (SFT), and the
questions GRPO then trains and evaluates it on (examples/yaml/smollm2-tools-sft.yaml, grpo-smollm2-tools.yaml).

Writes ``examples/data/tools_sft.jsonl``: 96 conversations, each a user's "What is a * b?" (two-digit numbers, which
SmolLM2-135M-Instruct gets wrong alone), the assistant's call of ``multiply`` (as tool_calls: the chat template writes
them), the tool's result, and the assistant's answer "a * b = c."; every row carries the tool's schema (``tools``).
Writes ``examples/data/tools_prompts_train.jsonl`` (256) and ``tools_prompts_eval.jsonl`` (32, none of them in the
others): the question as chat messages, with its ``answer``. Deterministic (random.Random with a fixed seed).

Command (from the repository root)::

    python scripts/make_tool_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
SEED = 20261127
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first integer"},
                                                    "b": {"type": "integer", "description": "the second integer"}},
                   "required": ["a", "b"]}}}


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} * {b}?"}]


def main() -> None:
    rng = random.Random(SEED)
    pairs = list({(rng.randrange(11, 100), rng.randrange(11, 100)) for _ in range(600)})
    rng.shuffle(pairs)
    sft, train, held = pairs[:96], pairs[96:352], pairs[352:384]
    rows = []
    for a, b in sft:
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        rows.append({"tools": [MULTIPLY], "messages": [
            *question(a, b), {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": str(a * b)},
            {"role": "assistant", "content": f"{a} * {b} = {a * b}."}]})
    write("tools_sft.jsonl", rows)
    for name, chosen in (("tools_prompts_train.jsonl", train), ("tools_prompts_eval.jsonl", held)):
        write(name, [{"prompt": question(a, b), "answer": str(a * b)} for a, b in chosen])


def write(name: str, rows: list[dict]) -> None:
    (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {DATA / name} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
