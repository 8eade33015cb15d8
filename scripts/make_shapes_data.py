"""Make the vision-language example's data: small images of colored shapes and chat rows asking about them.

Writes under ``examples/data/shapes/`` (from the repository root): ``images/NNNN.png`` (Pillow: 1 to 4 shapes,
circles, squares or triangles, all of one color, on a light background with a little noise; 32x32, 48x32,
32x48 or 48x48 pixels, so rows take different numbers of image tokens) and two chat files, ``train.jsonl`` and
``eval.jsonl``. Each image gets one row, a conversation of three questions: the image and "What color are the
shapes?" (answer: the color), then "How many shapes are there?" (the number, as a word) and "What shape are
they?" (the shape's name, plural for more than one); every answer is trained. The eval images come from another
seed.

Deterministic (``random.Random`` with fixed seeds, Pillow's PNG writer): running it twice gives the same files.

Command (from the repository root)::

    python scripts/make_shapes_data.py

``--out-dir DIR`` writes somewhere else.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "examples" / "data" / "shapes"
TRAIN_ROWS, EVAL_ROWS = 600, 80
TRAIN_SEED, EVAL_SEED = 26, 2026
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((32, 32), (48, 32), (32, 48), (48, 48))
NUMBERS = ("one", "two", "three", "four")
QUESTIONS = {"color": "What color are the shapes?", "count": "How many shapes are there?",
             "shape": "What shape are they?"}


def draw(rng: random.Random, path: Path) -> dict[str, str]:
    """One image of 1-4 shapes of one color and kind, saved at `path`; what it shows."""
    from PIL import Image, ImageDraw

    width, height = rng.choice(SIZES)
    color, shape, count = rng.choice(sorted(COLORS)), rng.choice(SHAPES), rng.randint(1, 4)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    pen = ImageDraw.Draw(image)
    cells = [(x, y) for x in range(0, width - 11, 16) for y in range(0, height - 11, 16)]
    for x, y in rng.sample(cells, count):  # one shape per 16x16 cell: they never overlap
        size = rng.randint(9, 13)
        x0, y0 = x + rng.randint(0, 15 - size), y + rng.randint(0, 15 - size)
        box = (x0, y0, x0 + size, y0 + size)
        if shape == "circle":
            pen.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            pen.rectangle(box, fill=COLORS[color])
        else:
            pen.polygon([(x0 + size // 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=COLORS[color])
    pixels = image.load()
    for _ in range(width * height // 8):  # a little noise, so no two patches of the background are the same
        px, py = rng.randrange(width), rng.randrange(height)
        pixels[px, py] = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in pixels[px, py])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
    return {"color": color, "count": NUMBERS[count - 1], "shape": shape + ("s" if count > 1 else "")}


def rows(n: int, seed: int, out_dir: Path, prefix: str) -> list[dict]:
    rng = random.Random(seed)
    made = []
    for i in range(n):
        name = f"images/{prefix}{i:04d}.png"
        facts = draw(rng, out_dir / name)
        messages = []
        for kind, question in QUESTIONS.items():
            user = [{"type": "image", "path": name}, {"type": "text", "text": question}] if not messages else question
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": facts[kind]}]
        made.append({"messages": messages})
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args()
    for name, n, seed, prefix in (("train.jsonl", TRAIN_ROWS, TRAIN_SEED, "t"), ("eval.jsonl", EVAL_ROWS, EVAL_SEED, "e")):
        made = rows(n, seed, args.out_dir, prefix)
        (args.out_dir / name).write_text("".join(json.dumps(r) + "\n" for r in made))
        print(f"wrote {args.out_dir / name}: {len(made)} rows")


if __name__ == "__main__":
    main()
