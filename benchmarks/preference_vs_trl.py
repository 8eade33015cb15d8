"""DPO and ORPO step one, ours against TRL 1.16.0's DPOTrainer and (experimental) ORPOTrainer, and both learning
curves on the DPO example.

    .venv/bin/python benchmarks/preference_vs_trl.py --trl-path /tmp/trl_pkgs   # TRL installed with
        .venv/bin/pip install --no-deps --target /tmp/trl_pkgs trl==1.16.0   (its other needs are in our venv)
    .venv/bin/python benchmarks/preference_vs_trl.py --trl-path /tmp/trl_pkgs --pins   # as the test pins them
    .venv/bin/python benchmarks/preference_vs_trl.py --trl-path /tmp/trl_pkgs --curves runs/quickstart/final
        # also examples/yaml/quickstart-dpo.yaml through `finetune train` and TRL's DPOTrainer from that SFT model

Step one: one optimizer step of the seeded tiny Llama of benchmarks/grpo_vs_trl.py (2 layers, hidden 32, the
example tokenizer's 1024 tokens, float32, CPU) on 16 pairs of examples/data/quickstart_pref_train.jsonl (its first
16 rows: explicit and implicit prompts), with a reference that is not the policy (the policy's weights plus 0.3
times fresh ones: `dpo.reference: PATH`, TRL's `ref_model`). For each DPO loss (sigmoid, ipo, hinge, sigmoid with
label smoothing 0.1) at micro 16 x accumulation 1 and 4 x 4, and ORPO (beta 0.1) at 16 x 1: both step-one losses
and pre-clip gradient norms, their relative differences, and the whole gradient's (||ours - TRL|| / ||TRL||).

Learning curves (--curves SFT_MODEL): examples/yaml/quickstart-dpo.yaml (the quickstart model after SFT, 480 pairs
whose rejected answer breaks the format, 100 eval pairs) through `finetune train`, as shipped and with
dpo.completion_end: template, and TRL's DPOTrainer on the same model, pairs and hyperparameters (micro 8 x
accumulation 2, one epoch, AdamW lr 1e-3, cosine to 0 without warmup, no weight decay, clip 1, beta 0.1):
eval reward accuracy and loss every 5 steps, from step 0.

Ours: the trainer's own step functions (grpo_vs_trl.ours_step: the parts, plan, collated micro-batches and step of
`finetune train`), and `finetune train` itself for one case. TRL: the trainer with a callback that copies the
gradient before the optimizer step; loss and norm from its log (max_grad_norm 1e9 on both sides, bf16 off).

What had to match (docs/preference.md, "The completion boundary"):
  * dpo.completion_end: template (orpo.completion_end: template): TRL scores every token after the prompt to the end
    of the template's rendering, the newline ChatML writes after <|im_end|> too, and its ORPOTrainer appends one
    more <|im_end|> after that newline. Rows "-marker" show our default boundary against TRL's (not pinned).
  * orpo.nll: sequence: TRL's ORPOTrainer takes the cross-entropy over the whole chosen sequence, prompt included,
    as a mean per micro-batch; so ORPO matches at one micro-batch a step (16 x 1; "-4x4" shows the split).
  * Label smoothing: TRL 1.16's sigmoid loss ignores label_smoothing; conservative DPO there is its own
    loss_type ["sigmoid", "robust"] with loss_weights [2 (1 - e), -(1 - 2 e)] (robust's flipped term cancels
    against it), so TRL's code computes -(1 - e) log sigmoid(bD) - e log sigmoid(-bD).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): its siblings beside it
    sys.path.append(str(Path(__file__).resolve().parent))
import trl_compare  # noqa: E402
from grpo_vs_trl import weights_digest, write_model  # noqa: E402

ROOT = trl_compare.ROOT
ours_step, rel = trl_compare.ours_step, trl_compare.rel  # the tests' bench.ours_step and bench.rel

TOKENIZER = ROOT / "examples" / "tokenizer"
PAIRS = ROOT / "examples" / "data" / "quickstart_pref_train.jsonl"
N_PAIRS = 16
BETA = 0.1
SMOOTHING = 0.1


@dataclass(frozen=True)
class Case:
    """One step-one comparison."""

    objective: str = "dpo"
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    micro: int = 16
    accum: int = 1
    end: str = "template"  # completion_end; ORPO's template comes with orpo.nll: sequence (TRL's ORPO)

    @property
    def name(self) -> str:
        kind = self.loss + (f"-ls{self.label_smoothing:g}" if self.label_smoothing else "")
        head = f"dpo-{kind}" if self.objective == "dpo" else "orpo"
        return f"{head}-{self.micro}x{self.accum}" + ("-marker" if self.end == "marker" else "")

    @property
    def known_difference(self) -> bool:
        """A row that shows a setting where ours and TRL's differ: our default boundary, or ORPO split (TRL's
        per-micro-batch means)."""
        return self.end == "marker" or (self.objective == "orpo" and self.accum > 1)


DPO_LOSSES = (("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("sigmoid", SMOOTHING))
CASES = [Case("dpo", loss, ls, m, a) for loss, ls in DPO_LOSSES for m, a in ((16, 1), (4, 4))] + [Case("orpo")]
KNOWN = [Case("dpo", end="marker"), Case("orpo", end="marker"), Case("orpo", micro=4, accum=4)]


# --- the fixed inputs --------------------------------------------------------------------------------------------

def write_models(work: Path) -> tuple[Path, Path]:
    """(the policy, a reference near it): grpo_vs_trl's seeded tiny Llama and its perturbed copy."""
    policy = write_model(work / "policy", seed=0)
    return policy, write_model(work / "reference", seed=1, base=policy)


def write_pairs(path: Path, n: int = N_PAIRS) -> Path:
    """The first n rows of the quickstart pairs, byte for byte."""
    lines = PAIRS.read_text(encoding="utf-8").splitlines(keepends=True)[:n]
    path.write_text("".join(lines), encoding="utf-8")
    return path


# --- ours ----------------------------------------------------------------------------------------------------

def write_recipe(case: Case, work: Path, policy: Path, reference: Path, pairs: Path) -> Path:
    import yaml

    recipe = {
        "output_dir": str(work / f"ours-{case.name}"), "seed": 0,
        "model": {"path": str(policy), "dtype": "float32"},
        "tokenizer": {"path": str(TOKENIZER)},
        "datasets": [{"path": str(pairs), "format": "preference"}],
        "data": {"packing": False, "max_seq_len": 512, "cache_dir": str(work / "cache")},
        "train": {"objective": case.objective, "micro_batch_size": case.micro,
                  "gradient_accumulation_steps": case.accum, "max_steps": 1, "lr": 1e-3,
                  "lr_scheduler": "constant", "warmup_steps": 0, "max_grad_norm": 1e9},
        "eval": {"at_start": False, "every_steps": None},
        "logging": {"every_steps": 1},
    }
    if case.objective == "dpo":
        recipe["dpo"] = {"beta": BETA, "loss": case.loss, "label_smoothing": case.label_smoothing,
                         "reference": str(reference), "completion_end": case.end}
    else:
        recipe["orpo"] = {"beta": BETA, "completion_end": case.end,
                          "nll": "sequence" if case.end == "template" else "completion"}
    path = work / f"ours-{case.name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# --- TRL -----------------------------------------------------------------------------------------------------

def trl_rows(pairs: Path) -> list[dict]:
    """The pairs as TRL reads them: implicit-prompt rows split by TRL's own extract_prompt (one Dataset needs one
    layout)."""
    from trl.data_utils import extract_prompt

    rows = [json.loads(line) for line in pairs.read_text(encoding="utf-8").splitlines()]
    return [row if "prompt" in row else extract_prompt(row) for row in rows]


def trl_step(case: Case, work: Path, policy: Path, reference: Path, pairs: Path
             ) -> tuple[float, float, dict[str, Any]]:
    """(loss, pre-clip grad norm, gradients by name) of TRL's first step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = trl_compare.trl_args(work / f"trl-{case.name}", case.micro, case.accum)
    common |= {"beta": BETA, "max_length": 512}
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    data = Dataset.from_list(trl_rows(pairs))
    if case.objective == "dpo":
        from trl import DPOConfig, DPOTrainer

        losses, weights = [case.loss], None
        if case.label_smoothing:  # conservative DPO from TRL's own terms (module docstring)
            e = case.label_smoothing
            losses, weights = ["sigmoid", "robust"], [2 * (1 - e), -(1 - 2 * e)]
        args = DPOConfig(**common, loss_type=losses, loss_weights=weights, label_smoothing=case.label_smoothing)
        ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
        return trl_compare.trl_first_step(lambda callbacks: DPOTrainer(
            model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer,
            callbacks=callbacks))
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return trl_compare.trl_first_step(lambda callbacks: ORPOTrainer(
        model=model, args=ORPOConfig(**common), train_dataset=data, processing_class=tokenizer,
        callbacks=callbacks))


# --- the step-one comparison -----------------------------------------------------------------------------------

def compare(cases: list[Case], cli: set[str], work: Path, inputs: tuple[Path, Path, Path]) -> list[dict]:
    return trl_compare.side_by_side(cases, cli, trl_compare.Table(28),
                                    lambda case: write_recipe(case, work, *inputs),
                                    lambda case: trl_step(case, work, *inputs))


# --- learning curves on the DPO example ---------------------------------------------------------------------------

EXAMPLE = ROOT / "examples" / "yaml" / "quickstart-dpo.yaml"


def ours_curve(model: Path, work: Path, end: str) -> list[tuple[int, float, float]]:
    """(step, eval reward accuracy, eval loss) of `finetune train` on the example from `model`."""
    import subprocess

    out = work / f"curve-ours-{end}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "finetune", "train", str(EXAMPLE), f"model.path={model}",
                           f"output_dir={out}", f"data.cache_dir={work / 'cache'}", f"dpo.completion_end={end}",
                           "--overwrite"], cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"finetune train {EXAMPLE} failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x["eval_reward_accuracy"], x["eval_loss"]) for x in lines if "eval_loss" in x]


def trl_curve(model: Path, work: Path) -> list[tuple[int, float, float]]:
    """The same from TRL's DPOTrainer (its reference: a copy of the model as loaded; eval batches of 20, so its
    mean of batch means is the mean over the 100 pairs)."""
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import DPOConfig, DPOTrainer

    recipe = yaml.safe_load(EXAMPLE.read_text())
    train, dpo = recipe["train"], recipe["dpo"]
    data = {split: Dataset.from_list(trl_rows((EXAMPLE.parent / recipe[key][0]["path"]).resolve()))
            for split, key in (("train", "datasets"), ("eval", "eval_datasets"))}
    args = DPOConfig(output_dir=str(work / "curve-trl"), per_device_train_batch_size=train["micro_batch_size"],
                     per_device_eval_batch_size=20, gradient_accumulation_steps=train["gradient_accumulation_steps"],
                     num_train_epochs=train["epochs"], learning_rate=train["lr"], lr_scheduler_type="cosine",
                     warmup_steps=train["warmup_steps"], weight_decay=train["weight_decay"],
                     max_grad_norm=train["max_grad_norm"], beta=dpo["beta"], loss_type=[dpo["loss"]], bf16=False,
                     use_cpu=True, seed=recipe["seed"], eval_strategy="steps", eval_steps=recipe["eval"]["every_steps"],
                     eval_on_start=True, logging_steps=recipe["logging"]["every_steps"], save_strategy="no",
                     report_to="none", disable_tqdm=True, max_length=recipe["data"]["max_seq_len"])
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), args=args,
                         train_dataset=data["train"], eval_dataset=data["eval"],
                         processing_class=AutoTokenizer.from_pretrained(TOKENIZER))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [(x["step"], x["eval_rewards/accuracies"], x["eval_loss"]) for x in trainer.state.log_history
            if "eval_loss" in x]


def curves(model: Path, work: Path) -> list[dict]:
    """Both trainers on the example; each curve printed as it ends, with its wall time."""
    import time

    rows = []
    for name, run in (("ours (marker)", lambda: ours_curve(model, work, "marker")),
                      ("ours (template)", lambda: ours_curve(model, work, "template")),
                      ("TRL DPOTrainer", lambda: trl_curve(model, work))):
        start = time.perf_counter()
        points = run()
        seconds = time.perf_counter() - start
        rows.append({"curve": name, "seconds": seconds, "points": points})
        print(f"\n{name}: {seconds:.0f} s\n  step  eval_reward_accuracy  eval_loss\n"
              + "\n".join(f"  {s:>4}  {a:>20.2f}  {loss:>9.4f}" for s, a, loss in points), flush=True)
    return rows


def main() -> None:
    parser = trl_compare.make_parser(__doc__, ["dpo-sigmoid-4x4", "orpo-16x1"])
    trl_compare.add_outputs(parser, "tests/objectives/test_preference_trl.py")
    parser.add_argument("--curves", type=Path, metavar="SFT_MODEL",
                        help="also train examples/yaml/quickstart-dpo.yaml from this model under both (slow)")
    parser.add_argument("--no-step-one", action="store_true", help="the curves only")
    args = parser.parse_args()
    print(trl_compare.versions(trl_compare.start_trl(args.trl_path)))
    work = trl_compare.work_dir(args.work, "preference-vs-trl-")
    policy, reference = write_models(work)
    pairs = write_pairs(work / "pairs.jsonl")
    print(f"policy {weights_digest(policy)[:16]}, reference {weights_digest(reference)[:16]}, pairs "
          f"{hashlib.sha256(pairs.read_bytes()).hexdigest()[:16]} (sha256)")
    rows = [] if args.no_step_one else compare(CASES + KNOWN, set(args.cli), work, (policy, reference, pairs))
    if rows:
        print(f"\n! a setting where ours and TRL's differ (module docstring)\nworst relative difference, ours vs "
              f"TRL, other rows (loss, grad norm, whole gradient): {trl_compare.worst(rows):.2e}")
    if args.pins:
        print(trl_compare.pins(rows), end="")
    if args.curves:
        rows += curves(args.curves.resolve(), work)
    trl_compare.write_json(args.json, rows)


if __name__ == "__main__":
    main()
