"""Reward model step one, ours (train.objective: reward) against TRL 1.16.0's RewardTrainer.

    .venv/bin/python benchmarks/reward_vs_trl.py --trl-path /tmp/trl_pkgs   # TRL installed with
        .venv/bin/pip install --no-deps --target /tmp/trl_pkgs trl==1.16.0   (its other needs are in our venv)
    .venv/bin/python benchmarks/reward_vs_trl.py --trl-path /tmp/trl_pkgs --pins   # as the test pins them

One optimizer step of a seeded tiny LlamaForSequenceClassification (benchmarks/grpo_vs_trl.py's tiny Llama, 2
layers, hidden 32, the example tokenizer's 1024 tokens, with a seeded one-output `score` head; float32, CPU) on the
16 pairs of benchmarks/preference_vs_trl.py (the first 16 rows of examples/data/quickstart_pref_train.jsonl:
explicit and implicit prompts), each with a `margin` field (0, 0.25, 0.5, 0.75 in turn) in the margin cases. Both
sides load the same model directory and the same tokenizer (pad <|endoftext|>, eos <|im_end|>: each sequence ends
with the newline ChatML writes after <|im_end|>, so TRL's "rightmost token that is not the pad" is each sequence's
last token, which ours reads from the batch's documents).

Cases: micro 16 x accumulation 1 and 4 x 4, reward centering off and at 0.01 (reward.center_coefficient, TRL's
center_rewards_coefficient), margins from the rows or none, and ours packed (every pair of the step in rows of up to
512 tokens, one packed row a micro-batch) against TRL's padded 16 x 1. Printed: both step-one losses and pre-clip
gradient norms, their relative differences, and the whole gradient's (||ours - TRL|| / ||TRL||); `finetune train`'s
metrics.jsonl for the cases named by --cli.

Ours: the trainer's own step functions (grpo_vs_trl.ours_step). TRL: RewardTrainer with a callback that copies the
gradient before the optimizer step; loss and norm from its log (max_grad_norm 1e9 on both sides, bf16 off).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): its siblings beside it
    sys.path.append(str(Path(__file__).resolve().parent))
import preference_vs_trl as pref_bench  # noqa: E402
import trl_compare  # noqa: E402
from grpo_vs_trl import MODEL_CONFIG, weights_digest, write_model  # noqa: E402
from preference_vs_trl import TOKENIZER, trl_rows  # noqa: E402

ours_step, rel = trl_compare.ours_step, trl_compare.rel  # the tests' bench.ours_step and bench.rel

MAX_LEN = 512
CENTER = 0.01


@dataclass(frozen=True)
class Case:
    """One step-one comparison."""

    micro: int = 16
    accum: int = 1
    center: float = 0.0
    margin: bool = False
    packed: bool = False  # ours in packed rows (one a micro-batch, all of the step's): TRL's is padded 16 x 1

    @property
    def name(self) -> str:
        split = "packed" if self.packed else f"{self.micro}x{self.accum}"
        return f"reward-{split}" + (f"-center{self.center:g}" if self.center else "") + ("-margin" if self.margin else "")


CASES = [Case(), Case(4, 4), Case(center=CENTER), Case(4, 4, center=CENTER), Case(margin=True),
         Case(4, 4, CENTER, margin=True), Case(1, 16, CENTER, margin=True, packed=True)]


# --- the fixed inputs --------------------------------------------------------------------------------------------

def write_reward_model(work: Path, seed: int = 0) -> Path:
    """grpo_vs_trl's seeded tiny Llama as a LlamaForSequenceClassification: its backbone, and a score head drawn
    from torch.Generator(seed + 100) as N / sqrt(hidden) x 3 (scores of a few units: the losses are far from
    log 2)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForSequenceClassification

    lm = AutoModelForCausalLM.from_pretrained(write_model(work / "lm", seed=seed), dtype=torch.float32)
    config = LlamaConfig(**{**MODEL_CONFIG, "num_labels": 1})
    model = LlamaForSequenceClassification(config)
    backbone = {k.removeprefix("model."): v for k, v in lm.state_dict().items() if k.startswith("model.")}
    model.model.load_state_dict(backbone, strict=True)
    generator = torch.Generator().manual_seed(seed + 100)
    hidden = config.hidden_size
    with torch.no_grad():
        model.score.weight.copy_(3 * torch.randn((1, hidden), generator=generator) / math.sqrt(hidden))
    path = work / "reward-model"
    model.save_pretrained(path)
    return path


def write_pairs(work: Path) -> tuple[Path, Path]:
    """(the 16 pairs, the same with a margin field each: 0, 0.25, 0.5, 0.75 in turn)."""
    plain = pref_bench.write_pairs(work / "pairs.jsonl")
    rows = [json.loads(line) for line in plain.read_text(encoding="utf-8").splitlines()]
    margins = work / "pairs-margin.jsonl"
    margins.write_text("".join(json.dumps({**row, "margin": 0.25 * (i % 4)}) + "\n" for i, row in enumerate(rows)),
                       encoding="utf-8")
    return plain, margins


# --- ours ----------------------------------------------------------------------------------------------------

def write_recipe(case: Case, work: Path, model: Path, pairs: Path, margins: Path) -> Path:
    import yaml

    recipe = {
        "output_dir": str(work / f"ours-{case.name}"), "seed": 0,
        "model": {"path": str(model), "dtype": "float32"},
        "tokenizer": {"path": str(TOKENIZER)},
        "datasets": [{"path": str(margins if case.margin else pairs), "format": "preference"}],
        "data": {"packing": case.packed, "max_seq_len": MAX_LEN, "cache_dir": str(work / "cache")},
        "train": {"objective": "reward", "micro_batch_size": case.micro, "gradient_accumulation_steps": case.accum,
                  "max_steps": 1, "lr": 1e-3, "lr_scheduler": "constant", "warmup_steps": 0, "max_grad_norm": 1e9},
        "reward": {"center_coefficient": case.center},
        "eval": {"at_start": False, "every_steps": None},
        "logging": {"every_steps": 1},
    }
    path = work / f"ours-{case.name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# --- TRL -----------------------------------------------------------------------------------------------------

def trl_step(case: Case, work: Path, model: Path, pairs: Path, margins: Path) -> tuple[float, float, dict[str, Any]]:
    """(loss, pre-clip grad norm, gradients by name) of TRL's RewardTrainer's first step (padded, 16 x 1 for a
    packed case of ours)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    micro, accum = (16, 1) if case.packed else (case.micro, case.accum)
    args = RewardConfig(**trl_compare.trl_args(work / f"trl-{case.name}", micro, accum), max_length=MAX_LEN,
                        center_rewards_coefficient=case.center or None)
    rows = trl_rows(margins if case.margin else pairs)
    if case.margin:  # extract_prompt keeps prompt, chosen and rejected: the margin goes back on
        source = [json.loads(line) for line in margins.read_text(encoding="utf-8").splitlines()]
        rows = [{**row, "margin": given["margin"]} for row, given in zip(rows, source)]
    return trl_compare.trl_first_step(lambda callbacks: RewardTrainer(
        model=AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32), args=args,
        train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(TOKENIZER),
        callbacks=callbacks))


# --- the comparison ------------------------------------------------------------------------------------------

def compare(cases: list[Case], cli: set[str], work: Path, inputs: tuple[Path, Path, Path]) -> list[dict]:
    table = trl_compare.Table(38, marked=False)  # no known differences: no marks, the loss rel right-aligned
    return trl_compare.side_by_side(cases, cli, table, lambda case: write_recipe(case, work, *inputs),
                                    lambda case: trl_step(case, work, *inputs))


def main() -> None:
    parser = trl_compare.make_parser(__doc__, ["reward-4x4-center0.01-margin"])
    parser.add_argument("--cases", nargs="*", help="only these case names (default: every case)")
    trl_compare.add_outputs(parser, "tests/objectives/test_reward_trl.py")
    args = parser.parse_args()
    trl = trl_compare.start_trl(args.trl_path)
    import datasets

    datasets.disable_progress_bars()
    print(trl_compare.versions(trl))
    work = trl_compare.work_dir(args.work, "reward-vs-trl-")
    model = write_reward_model(work)
    pairs, margins = write_pairs(work)
    print(f"reward model {weights_digest(model)[:16]}, pairs {hashlib.sha256(pairs.read_bytes()).hexdigest()[:16]}, "
          f"with margins {hashlib.sha256(margins.read_bytes()).hexdigest()[:16]} (sha256)")
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    rows = compare(cases, set(args.cli), work, (model, pairs, margins))
    print(f"\nworst relative difference, ours vs TRL (loss, grad norm, whole gradient, CLI): "
          f"{trl_compare.worst(rows):.2e}")
    if args.pins:
        print(trl_compare.pins(rows), end="")
    trl_compare.write_json(args.json, rows)


if __name__ == "__main__":
    main()
