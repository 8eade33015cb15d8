"""Make the quickstart's synthetic chat dataset.

Writes ``examples/data/quickstart_train.jsonl`` (3000 rows) and ``examples/data/quickstart_eval.jsonl``
(200 rows) under the repository root. Each line is ``{"messages": [...]}`` in chat format; every row ends
with an assistant turn whose answer can be checked (small-integer arithmetic, reversing, sorting and
counting words, uppercasing, repeating a word, first/last letters). About 15% of the rows start with a
system message and about 10% are two-turn conversations. Lengths are long-tailed on purpose: most rows are
a few dozen tokens, a tail of single-turn list tasks (35-90 words) runs to 150-400 tokens, so padding and
packing differ.

The output is deterministic (``random.Random`` with fixed seeds, stdlib only): running it twice gives
byte-identical files. The eval rows come from a different seed and any row that also occurs in the train
file is dropped, so the two files share no row.

Command (from the repository root)::

    python scripts/make_quickstart_data.py

``--out-dir DIR`` writes the two files somewhere else (the tests regenerate into a temp dir).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "examples" / "data"
TRAIN_NAME = "quickstart_train.jsonl"
EVAL_NAME = "quickstart_eval.jsonl"
TRAIN_ROWS = 3000
EVAL_ROWS = 200
TRAIN_SEED = 20240611
EVAL_SEED = 97531

SYSTEM_FRACTION = 0.15
MULTI_TURN_FRACTION = 0.10
LONG_LIST_FRACTION = 0.4  # share of reverse/sort tasks (single-turn rows only) that get a long list
LONG_LIST_WORDS = (35, 90)
SHORT_LIST_WORDS = (3, 8)

# A small fixed vocabulary of common lowercase English words, so a tiny model sees each one many times.
WORDS: tuple[str, ...] = (
    "apple", "arm", "baby", "ball", "bank", "bed", "bell", "bird", "black", "blue",
    "boat", "book", "box", "boy", "bread", "brown", "cake", "car", "cat", "chair",
    "cold", "cow", "cup", "day", "desk", "dog", "door", "duck", "ear", "egg",
    "eye", "face", "farm", "fast", "fire", "fish", "flag", "floor", "flower", "foot",
    "fox", "frog", "game", "garden", "girl", "glass", "gold", "good", "grass", "green",
    "hand", "happy", "hat", "head", "hill", "home", "horse", "hot", "house", "ice",
    "jam", "key", "king", "kite", "lake", "lamp", "leaf", "leg", "light", "lion",
    "long", "man", "map", "milk", "moon", "mouse", "nest", "new", "night", "nose",
    "old", "orange", "owl", "page", "park", "pen", "pig", "pink", "plant", "rain",
    "red", "ring", "river", "road", "rock", "room", "rose", "salt", "sea", "seed",
    "sheep", "ship", "shoe", "sky", "slow", "small", "snow", "song", "star", "stone",
    "street", "sun", "table", "tall", "tea", "tiger", "town", "toy", "train", "tree",
    "wall", "warm", "water", "white", "wind", "window", "wing", "wolf", "wood", "yellow",
)

# Sentences for the word-counting task are built from these slots.
SUBJECTS: tuple[str, ...] = ("the dog", "a cat", "the old man", "my sister", "the small bird", "a red fox",
                             "the king", "our teacher", "the happy girl", "a brown horse")
VERBS: tuple[str, ...] = ("sees", "likes", "finds", "has", "wants", "draws", "reads about", "walks to")
OBJECTS: tuple[str, ...] = ("the moon", "a green apple", "the river", "a big house", "the blue boat",
                            "a long road", "the tall tree", "some warm milk", "the white snow", "a kite")
TAILS: tuple[str, ...] = ("", "", "", " today", " at night", " in the park", " every day", " near the lake")

SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a precise assistant. Answer briefly.",
    "Answer with only the result.",
    "You solve small word and number puzzles.",
)

Turn = tuple[str, str]
Message = dict[str, str]
Row = dict[str, list[Message]]


def _word_list(rng: random.Random, lo: int, hi: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]


def _list_length(rng: random.Random, allow_long: bool) -> tuple[int, int]:
    return LONG_LIST_WORDS if allow_long and rng.random() < LONG_LIST_FRACTION else SHORT_LIST_WORDS


def task_add(rng: random.Random, allow_long: bool = True) -> Turn:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", str(a + b)


def task_sub(rng: random.Random, allow_long: bool = True) -> Turn:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", str(a - b)


def task_mul(rng: random.Random, allow_long: bool = True) -> Turn:
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    return f"What is {a} * {b}?", str(a * b)


def task_reverse(rng: random.Random, allow_long: bool = True) -> Turn:
    words = _word_list(rng, *_list_length(rng, allow_long))
    return "Reverse the words: " + ", ".join(words), ", ".join(reversed(words))


def task_sort(rng: random.Random, allow_long: bool = True) -> Turn:
    words = _word_list(rng, *_list_length(rng, allow_long))
    return "Sort the words alphabetically: " + ", ".join(words), ", ".join(sorted(words))


def task_count(rng: random.Random, allow_long: bool = True) -> Turn:
    sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(TAILS)}"
    return f"How many words are in this sentence: {sentence}?", str(len(sentence.split()))


def task_upper(rng: random.Random, allow_long: bool = True) -> Turn:
    words = _word_list(rng, 1, 4)
    phrase = " ".join(words)
    return f"Write in uppercase: {phrase}", phrase.upper()


def task_repeat(rng: random.Random, allow_long: bool = True) -> Turn:
    word, n = rng.choice(WORDS), rng.randint(1, 9)
    return f"Repeat the word {word} {n} times.", " ".join([word] * n)


def task_first_letter(rng: random.Random, allow_long: bool = True) -> Turn:
    word = rng.choice(WORDS)
    return f"What is the first letter of {word}?", word[0]


def task_last_letter(rng: random.Random, allow_long: bool = True) -> Turn:
    word = rng.choice(WORDS)
    return f"What is the last letter of {word}?", word[-1]


def task_first_letters(rng: random.Random, allow_long: bool = True) -> Turn:
    words = _word_list(rng, 2, 6)
    return "Give the first letter of each word: " + " ".join(words), " ".join(w[0] for w in words)


def task_last_word(rng: random.Random, allow_long: bool = True) -> Turn:
    words = _word_list(rng, 2, 7)
    if rng.random() < 0.5:
        return "What is the first word in: " + " ".join(words), words[0]
    return "What is the last word in: " + " ".join(words), words[-1]


# (task, weight): arithmetic and short word tasks dominate; reverse/sort carry the long tail.
# Every task takes (rng, allow_long); only reverse/sort use allow_long.
TASKS: tuple[tuple[Callable[[random.Random, bool], Turn], int], ...] = (
    (task_add, 14),
    (task_sub, 10),
    (task_mul, 10),
    (task_reverse, 8),
    (task_sort, 8),
    (task_count, 8),
    (task_upper, 8),
    (task_repeat, 8),
    (task_first_letter, 6),
    (task_last_letter, 6),
    (task_first_letters, 7),
    (task_last_word, 7),
)
_TASK_FUNCS = [t for t, _ in TASKS]
_TASK_WEIGHTS = [w for _, w in TASKS]


def make_turn(rng: random.Random, allow_long: bool = True) -> Turn:
    """One (user prompt, assistant answer) pair from a randomly chosen task."""
    task = rng.choices(_TASK_FUNCS, weights=_TASK_WEIGHTS)[0]
    return task(rng, allow_long)


def make_row(rng: random.Random) -> Row:
    """One chat row: optional system message, then one or two user/assistant exchanges.

    Only single-turn rows get long lists, which keeps the longest row near 400 tokens.
    """
    messages: list[Message] = []
    if rng.random() < SYSTEM_FRACTION:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    n_turns = 2 if rng.random() < MULTI_TURN_FRACTION else 1
    for _ in range(n_turns):
        prompt, answer = make_turn(rng, allow_long=n_turns == 1)
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def row_to_line(row: Row) -> str:
    """The JSONL line (without newline) for a row."""
    return json.dumps(row, ensure_ascii=False)


def generate_lines(n_rows: int, seed: int, exclude: set[str] | None = None) -> list[str]:
    """``n_rows`` serialized rows from ``random.Random(seed)``, skipping any line in ``exclude``."""
    rng = random.Random(seed)
    exclude = exclude or set()
    lines: list[str] = []
    while len(lines) < n_rows:
        line = row_to_line(make_row(rng))
        if line not in exclude:
            lines.append(line)
    return lines


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")


def _content_chars(line: str) -> int:
    return sum(len(m["content"]) for m in json.loads(line)["messages"])


def length_summary(lines: list[str]) -> str:
    """Characters of message content per row: min/median/p90/max."""
    sizes = sorted(_content_chars(line) for line in lines)
    p90 = sizes[min(len(sizes) - 1, int(0.9 * len(sizes)))]
    return (f"rows={len(sizes)} chars min={sizes[0]} median={statistics.median(sizes):g} "
            f"p90={p90} max={sizes[-1]}")


def write_datasets(out_dir: Path, n_train: int = TRAIN_ROWS, n_eval: int = EVAL_ROWS) -> tuple[Path, Path]:
    """Write the train and eval JSONL files into ``out_dir`` and return their paths."""
    train_lines = generate_lines(n_train, TRAIN_SEED)
    eval_lines = generate_lines(n_eval, EVAL_SEED, exclude=set(train_lines))
    train_path, eval_path = out_dir / TRAIN_NAME, out_dir / EVAL_NAME
    _write(train_path, train_lines)
    _write(eval_path, eval_lines)
    for name, lines, path in (("train", train_lines, train_path), ("eval", eval_lines, eval_path)):
        print(f"{name}: {path} ({path.stat().st_size / 1024:.0f} KiB) {length_summary(lines)}")
    return train_path, eval_path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python scripts/make_quickstart_data.py [--out-dir DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                        help=f"where to write the two files (default: {DEFAULT_OUT_DIR})")
    args = parser.parse_args(argv)
    write_datasets(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
