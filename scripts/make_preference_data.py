"""Make the quickstart's preference pairs from its chat data (format: preference, TRL's layout).

Writes ``examples/data/quickstart_pref_train.jsonl`` and ``quickstart_pref_eval.jsonl``: every quickstart
conversation becomes a pair whose prompt is the conversation up to its last user turn, whose chosen answer is
the dataset's (checkable, correct) answer and whose rejected answer is a plausible wrong one: a number off by a
few, or words in another order or case. Rows alternate between the explicit form (`prompt`, `chosen`,
`rejected` as messages) and the implicit one (two whole conversations sharing their prompt).

And ``quickstart_format_pref_train.jsonl`` (480 pairs) and ``quickstart_format_pref_eval.jsonl`` (100), for
examples/yaml/quickstart-dpo.yaml: the same prompts and correct answers, the rejected answer the right result in
a broken format (wrapped in chatter, said twice, or followed by a question), which the quickstart model after
SFT never produces and DPO can learn to rank below the bare answer. Deterministic (stdlib only, fixed seeds):
running it twice gives byte-identical files.

Command (from the repository root)::

    python scripts/make_preference_data.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT / "examples" / "data"
SPLITS = {"train": ("quickstart_train.jsonl", "quickstart_pref_train.jsonl", 1000),
          "eval": ("quickstart_eval.jsonl", "quickstart_pref_eval.jsonl", 100)}
FORMAT_SPLITS = {"train": ("quickstart_train.jsonl", "quickstart_format_pref_train.jsonl", 480),
                 "eval": ("quickstart_eval.jsonl", "quickstart_format_pref_eval.jsonl", 100)}
SEED = 424242
FORMAT_SEED = 271828


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A wrong answer of the same kind: another number, or the words shuffled or recased."""
    if answer.lstrip("-").isdigit():
        return str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
    words = answer.split()
    if len(set(words)) > 1:  # words in another order (at least two differ, so some order is new)
        shuffled = words[:]
        while shuffled == words:
            rng.shuffle(shuffled)
        return " ".join(shuffled)
    return answer.lower() if answer != answer.lower() else answer.upper() + "?"


def broken_format(answer: str, rng: random.Random) -> str:
    """The right result, but not as the bare answer the prompts ask for."""
    kind = rng.randrange(3)
    if kind == 0:
        return rng.choice(["Sure! The answer is: ", "Let me think. It is ", "Here you go: "]) + answer
    if kind == 1:
        return f"{answer}\n{answer}"
    return answer + rng.choice([" Anything else?", " Do you want another one?", " Is that right?"])


def to_pair(messages: list[dict], rng: random.Random, implicit: bool, rejected_of=wrong_answer) -> dict:
    prompt, answer = messages[:-1], messages[-1]["content"]
    chosen = [{"role": "assistant", "content": answer}]
    rejected = [{"role": "assistant", "content": rejected_of(answer, rng)}]
    if implicit:
        return {"chosen": prompt + chosen, "rejected": prompt + rejected}
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DATA)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for splits, seed, rejected_of in ((SPLITS, SEED, wrong_answer), (FORMAT_SPLITS, FORMAT_SEED, broken_format)):
        rng = random.Random(seed)
        for source, target, rows in splits.values():
            lines = (DATA / source).read_text(encoding="utf-8").splitlines()[:rows]
            pairs = [to_pair(json.loads(line)["messages"], rng, i % 2 == 1, rejected_of)
                     for i, line in enumerate(lines)]
            text = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
            (args.out_dir / target).write_text(text, encoding="utf-8")
            print(f"wrote {len(pairs)} pairs to {args.out_dir / target}")


if __name__ == "__main__":
    main()
