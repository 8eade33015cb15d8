"""Make the GRPO examples' data: a replay file of rollouts, and prompt datasets to generate from.

Writes ``examples/data/grpo_prompts_train.jsonl`` (377 prompts) and ``examples/data/grpo_prompts_eval.jsonl``
(64, none of them in the train file): every "What is a + b?" with a, b in 0..20, as chat messages, each with its
``answer`` (what the exact_answer reward compares with). Small sums, so that SmolLM2-135M-Instruct
(examples/yaml/grpo-smollm2.yaml) is right sometimes (about 40 % greedy): GRPO needs groups whose rewards differ.

Writes ``examples/data/grpo_replay.jsonl``: 32 prompts ("What is a + b?", as chat messages), 4 completions each
(the right answer, or one off by a few, each ended by the tokenizer's end token ``<|im_end|>`` in the text), and each
completion's ``rewards: {exact_answer: 1 or 0}``; a few groups are all right or all wrong (no advantage). The
file format is docs/rl.md's "The replay file". Deterministic (random.Random with a fixed seed).

Writes ``examples/data/grpo_replay_multiturn.jsonl``: 16 prompts ("What is a * b?"), 4 rollouts each, as token
ids with an ``env_mask``. Most rollouts call a calculator tool first: the policy's turn
``<tool_call>{"name": "multiply", ...}</tool_call><|im_end|>``, the environment's turn (the tool's result as a tool
message and the next assistant header, as the quickstart's chat template renders them after that turn: env_mask 0),
then the policy's answer; the others answer at once (single-turn lines, no env_mask). The answer is right when the
tool was asked with the right numbers, else off. Each policy turn is tokenized alone, as generation samples it; the
environment's text is the template's rendering of the conversation with the tool message and the generation
prompt, less the text so far (docs/rl.md, "Multi-turn rollouts").

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
    write_multiturn()


def write_multiturn() -> None:
    """Multi-turn rollouts as ids with env_mask (the module docstring says what they hold)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DATA.parent / "tokenizer")
    rng = random.Random(SEED + 2)
    lines = []
    for group in range(16):
        a, b = rng.randrange(2, 13), rng.randrange(2, 13)
        prompt = [{"role": "user", "content": f"What is {a} * {b}?"}]
        for _ in range(GROUP):
            asked = (a, b) if rng.random() < 0.6 else (a, b + rng.choice([-1, 1]))
            called = rng.random() < 0.75
            answer = asked[0] * asked[1] if called else a * b + rng.choice([-2, 0, 2])
            ids, env_mask = _rollout(tokenizer, prompt, asked if called else None, answer)
            lines.append({"group": group, "prompt_ids": ids[0], "completion_ids": ids[1],
                          **({"env_mask": env_mask} if called else {}),
                          "rewards": {"exact_answer": 1.0 if answer == a * b else 0.0}})
    out = DATA / "grpo_replay_multiturn.jsonl"
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {out} ({len(lines)} rollouts, {sum('env_mask' in x for x in lines)} multi-turn)")


def _rollout(tokenizer, prompt: list[dict], asked: tuple[int, int] | None, answer: int):
    """(prompt ids, completion ids) and the env_mask of one rollout: a tool call, its result, the answer."""
    def text(messages: list[dict], generation: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt_ids = ids(text(prompt, True))
    completion, env_mask = [], []
    so_far, messages = text(prompt, True), list(prompt)
    if asked is not None:
        call = json.dumps({"name": "multiply", "arguments": {"a": asked[0], "b": asked[1]}})
        turn = f"<tool_call>{call}</tool_call><|im_end|>"
        completion += ids(turn)
        messages += [{"role": "assistant", "content": turn.removesuffix("<|im_end|>")},
                     {"role": "tool", "content": str(asked[0] * asked[1])}]
        after = text(messages, True)
        assert after.startswith(so_far + turn), "the quickstart's template preserves the prefix"
        env = ids(after[len(so_far + turn):])
        env_mask += [1] * len(completion) + [0] * len(env)
        completion += env
        so_far = after
    answer_ids = ids(f"{answer}<|im_end|>")
    return (prompt_ids, completion + answer_ids), env_mask + [1] * len(answer_ids)


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
