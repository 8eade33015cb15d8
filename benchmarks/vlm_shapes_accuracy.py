"""How well a run of examples/yaml/vlm-shapes.yaml answers about held-out images, and whether it looks at them.

    .venv/bin/python benchmarks/vlm_shapes_accuracy.py runs/vlm-shapes

For each eval row (examples/data/shapes/eval.jsonl) and each of its three questions, every possible answer of that
question (4 colors, 4 numbers, 6 shape names) is scored by the run's model, the earlier turns as in the data; the
likeliest answer is its answer. The same again with the images shuffled among the rows: a model that answers from
the image drops to chance there, one that answers from the question alone does not. Chance: color 1/4, count
about 1/4, shape 1/6 (prior of the data aside).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from finetune.data.collate import collate  # noqa: E402
from finetune.data.formats import MessageFields, to_example  # noqa: E402
from finetune.data.sources import RawRow  # noqa: E402
from finetune.data.tokenize import tokenize_example  # noqa: E402
from finetune.model.with_loss import CausalLMWithLoss  # noqa: E402
from finetune.recipe import DataConfig, load_recipe  # noqa: E402
from finetune.run.trained import load_trained  # noqa: E402

DATA = ROOT / "examples" / "data" / "shapes"
QUESTIONS = ("color", "count", "shape")
ANSWERS = (("red", "green", "blue", "yellow"), ("one", "two", "three", "four"),
           ("circle", "square", "triangle", "circles", "squares", "triangles"))


def correct(net: CausalLMWithLoss, tok, row: dict, image: str, k: int) -> bool:
    """Whether the likeliest answer to question k of `row`, asked about `image`, is the row's."""
    messages = copy.deepcopy(row["messages"][: 2 * k + 2])
    messages[0]["content"][0]["path"] = image
    samples = []
    for answer in ANSWERS[k]:
        messages[-1]["content"] = answer
        example = to_example(RawRow({"messages": messages}, "eval"), "chat", fields=MessageFields(image_root=str(DATA)))
        samples.append(tokenize_example(example, tok))
    batch = collate(samples, DataConfig(packing=False), tok.pad_token_id).to("cpu")
    with torch.no_grad():
        logps, where = net(**batch.model_inputs(), per_token=True)  # the earlier turns' tokens score alike
    totals = torch.zeros(len(samples), dtype=torch.float64).index_add_(0, where // batch.input_ids.shape[1],
                                                                       logps.double())
    return ANSWERS[k][int(totals.argmax())] == row["messages"][2 * k + 1]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run directory of examples/yaml/vlm-shapes.yaml")
    args = parser.parse_args()
    recipe = load_recipe(str(args.run / "recipe.yaml"))
    lm, tok = load_trained(args.run, recipe)
    net = CausalLMWithLoss(lm.eval(), "torch", 1024, 0.0, None)
    rows = [json.loads(line) for line in (DATA / "eval.jsonl").read_text().splitlines()]
    own = [row["messages"][0]["content"][0]["path"] for row in rows]
    shuffled = own[:]
    random.Random(0).shuffle(shuffled)
    for name, images in (("own images", own), ("shuffled images", shuffled)):
        hits = [sum(correct(net, tok, row, image, k) for row, image in zip(rows, images)) for k in range(3)]
        print(f"{name:16s}" + "  ".join(f"{q} {h}/{len(rows)} ({h / len(rows):.2f})" for q, h in zip(QUESTIONS, hits)))


if __name__ == "__main__":
    main()
