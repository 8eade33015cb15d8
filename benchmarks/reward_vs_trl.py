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

import argparse
import hashlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without an editable install
    sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("preference_vs_trl", ROOT / "benchmarks" / "preference_vs_trl.py")
pref_bench = sys.modules.setdefault("preference_vs_trl", importlib.util.module_from_spec(_spec))
if not hasattr(pref_bench, "write_pairs"):
    _spec.loader.exec_module(pref_bench)
grpo_bench = sys.modules["grpo_vs_trl"]
write_model, weights_digest, ours_step, ours_cli = (grpo_bench.write_model, grpo_bench.weights_digest,
                                                    grpo_bench.ours_step, grpo_bench.ours_cli)
rel, grad_rel, trl_rows = grpo_bench.rel, grpo_bench.grad_rel, pref_bench.trl_rows
TOKENIZER = pref_bench.TOKENIZER
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
    config = LlamaConfig(**{**grpo_bench.MODEL_CONFIG, "num_labels": 1})
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
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
    )
    from trl import RewardConfig, RewardTrainer

    captured: dict[str, Any] = {}

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            captured.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    micro, accum = (16, 1) if case.packed else (case.micro, case.accum)
    args = RewardConfig(output_dir=str(work / f"trl-{case.name}"), per_device_train_batch_size=micro,
                        gradient_accumulation_steps=accum, bf16=False, learning_rate=1e-3,
                        lr_scheduler_type="constant", max_steps=1, logging_steps=1, save_strategy="no",
                        report_to="none", use_cpu=True, seed=0, max_grad_norm=1e9, disable_tqdm=True,
                        max_length=MAX_LEN, center_rewards_coefficient=case.center or None)
    rows = trl_rows(margins if case.margin else pairs)
    if case.margin:  # extract_prompt keeps prompt, chosen and rejected: the margin goes back on
        source = [json.loads(line) for line in margins.read_text(encoding="utf-8").splitlines()]
        rows = [{**row, "margin": given["margin"]} for row, given in zip(rows, source)]
    trainer = RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32),
                            args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=AutoTokenizer.from_pretrained(TOKENIZER), callbacks=[Gradients()])
    trainer.remove_callback(PrinterCallback)  # its log lines would interleave with the table
    trainer.train()
    log = next(x for x in trainer.state.log_history if "loss" in x)
    return log["loss"], log["grad_norm"], captured


# --- the comparison ------------------------------------------------------------------------------------------

def compare(cases: list[Case], cli: set[str], work: Path, inputs: tuple[Path, Path, Path]) -> list[dict]:
    rows = []
    print(f"{'case':<38} {'ours loss':>13} {'TRL loss':>13} {'rel':>8} {'ours |g|':>11} {'TRL |g|':>11} "
          f"{'rel':>8} {'grad rel':>8} {'CLI rel':>8}", flush=True)
    for case in cases:
        recipe = write_recipe(case, work, *inputs)
        loss, norm, grads = ours_step(recipe)
        t_loss, t_norm, t_grads = trl_step(case, work, *inputs)
        row = {"case": case.name, "ours_loss": loss, "trl_loss": t_loss, "loss_rel": rel(loss, t_loss),
               "ours_grad_norm": norm, "trl_grad_norm": t_norm, "grad_norm_rel": rel(norm, t_norm),
               "grad_rel": grad_rel(grads, t_grads)}
        if case.name in cli or "all" in cli:
            c_loss, c_norm = ours_cli(recipe)
            row |= {"cli_loss": c_loss, "cli_grad_norm": c_norm,
                    "cli_rel": max(rel(c_loss, t_loss), rel(c_norm, t_norm))}
        rows.append(row)
        cli_rel = f"{row['cli_rel']:.1e}" if "cli_rel" in row else "-"
        print(f"{case.name:<38} {loss:>13.8f} {t_loss:>13.8f} {row['loss_rel']:>8.1e} {norm:>11.7f} "
              f"{t_norm:>11.7f} {row['grad_norm_rel']:>8.1e} {row['grad_rel']:>8.1e} {cli_rel:>8}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-path", help="a directory holding the trl package (pip install --target)")
    parser.add_argument("--work", type=Path, help="where models, data and runs go (default: a temp dir)")
    parser.add_argument("--cli", nargs="*", default=["reward-4x4-center0.01-margin"],
                        help="case names also run through `finetune train` (all: every case)")
    parser.add_argument("--cases", nargs="*", help="only these case names (default: every case)")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--pins", action="store_true",
                        help="print TRL's figures as tests/objectives/test_reward_trl.py pins them")
    args = parser.parse_args()
    if args.trl_path:
        sys.path.insert(0, args.trl_path)
    try:
        import trl
    except ImportError:
        sys.exit("TRL not importable: install trl==1.16.0 with pip --target DIR and pass --trl-path DIR")
    import datasets
    import torch
    import transformers

    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # the same reduction order on every run, and a fair share of a shared machine
    print(f"TRL {trl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    work = args.work or Path(tempfile.mkdtemp(prefix="reward-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_reward_model(work)
    pairs, margins = write_pairs(work)
    print(f"reward model {weights_digest(model)[:16]}, pairs {hashlib.sha256(pairs.read_bytes()).hexdigest()[:16]}, "
          f"with margins {hashlib.sha256(margins.read_bytes()).hexdigest()[:16]} (sha256)")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    rows = compare(cases, set(args.cli), work, (model, pairs, margins))
    worst = max(max(r["loss_rel"], r["grad_norm_rel"], r["grad_rel"], r.get("cli_rel", 0.0)) for r in rows)
    print(f"\nworst relative difference, ours vs TRL (loss, grad norm, whole gradient, CLI): {worst:.2e}")
    if args.pins:
        print("".join(f'    "{r["case"]}": ({r["trl_loss"]!r}, {r["trl_grad_norm"]!r}),\n' for r in rows), end="")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
