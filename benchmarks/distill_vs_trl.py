"""Distillation step one, ours (train.objective: distill) against TRL 1.16.0's GKDTrainer (trl.experimental.gkd).

    .venv/bin/python benchmarks/distill_vs_trl.py --trl-path /tmp/trl_pkgs   # TRL installed with
        .venv/bin/pip install --no-deps --target /tmp/trl_pkgs trl==1.16.0   (its other needs are in our venv)
    .venv/bin/python benchmarks/distill_vs_trl.py --trl-path /tmp/trl_pkgs --pins   # as the test pins them

One optimizer step of the seeded tiny Llama of benchmarks/grpo_vs_trl.py (the student: 2 layers, hidden 32, the
example tokenizer's 1024 tokens, float32, CPU) towards a teacher with the same tokenizer (the student's weights plus
0.3 times fresh ones, preference_vs_trl's reference: `distill.teacher: PATH`, TRL's `teacher_model`), on 16
single-turn chat rows of examples/data/quickstart_train.jsonl (its first 16 lines with one assistant message, one
with a system message), off-policy (TRL: lmbda 0, seq_kd False: the data's own completions, nothing sampled). For
beta 0 (forward KL), 0.5 and 1 (reverse KL) x temperature 1 and 2, at micro 16 x accumulation 1 and 4 x 4: both
step-one losses and pre-clip gradient norms, their relative differences, and the whole gradient's
(||ours - TRL|| / ||TRL||).

Ours: the trainer's own step functions (grpo_vs_trl.ours_step: the parts, plan, collated micro-batches and step of
`finetune train`), and `finetune train` itself for one case. TRL: GKDTrainer with its own collator
(DataCollatorForChatML) on the same rows, a callback that copies the gradient before the optimizer step, loss and
norm from its log (max_grad_norm 1e9 on both sides, bf16 off, one thread).

What had to match (docs/distill.md, "Against TRL's GKDTrainer"):
  * The temperature. TRL 1.16's GKDTrainer.compute_loss does not pass its `temperature` to generalized_jsd_loss
    (it only sets the sampling temperature; the divergence is always at T = 1). For T != 1 TRL here is a subclass,
    `TemperedGKDTrainer`, whose compute_loss is TRL's own with `temperature=self.temperature` passed to TRL's own
    generalized_jsd_loss (a subclass override in this benchmark, nothing patched); T = 1 rows run GKDTrainer as it
    ships. The row "-plain" shows the shipped GKDTrainer at temperature 2 (its divergence at T = 1) against ours at
    2 (not pinned).
  * The end of the completion. TRL's collator scores every token after the prompt rendered with the generation
    prompt, to the end of the template's rendering: with the quickstart template that is `10<|im_end|>\\n`, the
    newline the template writes after each turn included; ours scores what SFT trains, `10<|im_end|>`. The pinned
    rows use a copy of the example tokenizer whose template writes no newline after the conversation's last
    assistant turn (`write_tokenizer`), so both score `10<|im_end|>` (ours: the same figures under either
    template; the newline is after every token it scores). Rows "-newline" use the shipped template (not pinned).
  * The normalizer: TRL divides each micro-batch's summed divergence by the step's target tokens
    (num_items_in_batch, counted over every micro-batch of the step in one process) and the Trainer does not
    divide again by the accumulation steps, so its split 4 x 4 is its one-batch step; ours divides once by the
    step's target tokens. (Across processes TRL 1.16 gathers num_items_in_batch over ranks but DDP averages the
    gradients, so there its step is 1/world of one batch's; not measured here.)
"""

from __future__ import annotations

import hashlib
import json
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
ROWS = ROOT / "examples" / "data" / "quickstart_train.jsonl"
N_ROWS = 16
# The shipped template writes "\n" after every turn; this one not after the conversation's last assistant turn.
SHIPPED_END = "{%- endgeneration %}{{- '\\n' }}"
LAST_TURN_END = "{%- endgeneration %}{%- if not loop.last %}{{- '\\n' }}{%- endif %}"


@dataclass(frozen=True)
class Case:
    """One step-one comparison."""

    beta: float = 0.5
    temperature: float = 1.0
    micro: int = 16
    accum: int = 1
    newline: bool = False  # the shipped template (TRL scores the newline after the last <|im_end|>)
    plain: bool = False  # TRL's GKDTrainer as shipped even at temperature != 1 (its divergence at T = 1)

    @property
    def name(self) -> str:
        extra = ("-newline" if self.newline else "") + ("-plain" if self.plain else "")
        return f"b{self.beta:g}-t{self.temperature:g}-{self.micro}x{self.accum}{extra}"

    @property
    def known_difference(self) -> bool:
        """A row that shows a setting where ours and TRL's differ (module docstring)."""
        return self.newline or self.plain


CASES = [Case(b, t, m, a) for b in (0.0, 0.5, 1.0) for t in (1.0, 2.0) for m, a in ((16, 1), (4, 4))]
KNOWN = [Case(0.5, 1.0, newline=True), Case(0.0, 1.0, 4, 4, newline=True), Case(0.5, 2.0, plain=True)]


# --- the fixed inputs --------------------------------------------------------------------------------------------

def write_models(work: Path) -> tuple[Path, Path]:
    """(the student, a teacher near it): grpo_vs_trl's seeded tiny Llama and its perturbed copy, the teacher with
    the example tokenizer beside it (ours checks the teacher's tokenizer against the student's)."""
    from transformers import AutoTokenizer

    student = write_model(work / "student", seed=0)
    teacher = write_model(work / "teacher", seed=1, base=student)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(teacher)
    return student, teacher


def write_rows(path: Path, n: int = N_ROWS) -> Path:
    """The first n lines of the quickstart SFT data with one assistant message (TRL's GKD scores the last message
    only), byte for byte."""
    lines = [x for x in ROWS.read_text(encoding="utf-8").splitlines(keepends=True)
             if sum(m["role"] == "assistant" for m in json.loads(x)["messages"]) == 1]
    path.write_text("".join(lines[:n]), encoding="utf-8")
    return path


def write_tokenizer(path: Path) -> Path:
    """The example tokenizer with a chat template that writes no newline after the conversation's last assistant
    turn: TRL's completion (everything after the generation prompt) is then `answer<|im_end|>`, what ours scores."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((TOKENIZER / name).read_bytes())
    template = (TOKENIZER / "chat_template.jinja").read_text(encoding="utf-8")
    assert template.count(SHIPPED_END) == 1, "the example chat template changed: update write_tokenizer"
    (path / "chat_template.jinja").write_text(template.replace(SHIPPED_END, LAST_TURN_END), encoding="utf-8")
    return path


def write_inputs(work: Path) -> tuple[Path, Path, Path, Path]:
    """(student, teacher, rows, the last-turn tokenizer) under `work`."""
    student, teacher = write_models(work)
    return student, teacher, write_rows(work / "rows.jsonl"), write_tokenizer(work / "tokenizer-last-turn")


def inputs_digest(rows: Path, tokenizer: Path) -> tuple[str, str]:
    """sha256 of the rows file and of the last-turn tokenizer's files (name and bytes, in name order)."""
    digest = hashlib.sha256()
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        digest.update(name.encode() + (tokenizer / name).read_bytes())
    return hashlib.sha256(rows.read_bytes()).hexdigest(), digest.hexdigest()


def tokenizer_for(case: Case, tokenizer: Path) -> Path:
    return TOKENIZER if case.newline else tokenizer


# --- ours ----------------------------------------------------------------------------------------------------

def write_recipe(case: Case, work: Path, student: Path, teacher: Path, rows: Path, tokenizer: Path) -> Path:
    import yaml

    recipe = {
        "output_dir": str(work / f"ours-{case.name}"), "seed": 0,
        "model": {"path": str(student), "dtype": "float32"},
        "tokenizer": {"path": str(tokenizer_for(case, tokenizer))},
        "datasets": [{"path": str(rows), "format": "chat"}],
        "data": {"packing": False, "max_seq_len": 512, "cache_dir": str(work / "cache")},
        "train": {"objective": "distill", "micro_batch_size": case.micro,
                  "gradient_accumulation_steps": case.accum, "max_steps": 1, "lr": 1e-3,
                  "lr_scheduler": "constant", "warmup_steps": 0, "max_grad_norm": 1e9},
        "distill": {"teacher": str(teacher), "beta": case.beta, "temperature": case.temperature},
        "eval": {"at_start": False, "every_steps": None},
        "logging": {"every_steps": 1},
    }
    path = work / f"ours-{case.name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# --- TRL -----------------------------------------------------------------------------------------------------

def tempered_gkd_trainer() -> type:
    """GKDTrainer whose compute_loss passes its temperature to TRL's own generalized_jsd_loss: TRL 1.16's
    compute_loss (trl/experimental/gkd/gkd_trainer.py) line for line, plus `temperature=self.temperature`. TRL's
    GKDTrainer as shipped uses its temperature for sampling only."""
    from trl.experimental.gkd import GKDTrainer

    class TemperedGKDTrainer(GKDTrainer):
        def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            import torch

            student_outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            self.teacher_model.eval()
            with torch.no_grad():
                teacher_outputs = self.teacher_model(input_ids=inputs["input_ids"],
                                                     attention_mask=inputs["attention_mask"])
            loss = self.generalized_jsd_loss(
                student_logits=student_outputs.logits[:, :-1, :], teacher_logits=teacher_outputs.logits[:, :-1, :],
                labels=inputs["labels"][:, 1:], beta=self.beta, temperature=self.temperature,
                num_items_in_batch=num_items_in_batch)
            return (loss, student_outputs) if return_outputs else loss

    return TemperedGKDTrainer


def trl_step(case: Case, work: Path, student: Path, teacher: Path, rows: Path, tokenizer: Path
             ) -> tuple[float, float, dict[str, Any]]:
    """(loss, pre-clip grad norm, gradients by name) of TRL's first step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    args = GKDConfig(**trl_compare.trl_args(work / f"trl-{case.name}", case.micro, case.accum), lmbda=0.0,
                     seq_kd=False, beta=case.beta, temperature=case.temperature, max_length=512)
    trainer_class = GKDTrainer if case.temperature == 1 or case.plain else tempered_gkd_trainer()
    data = Dataset.from_list([json.loads(x) for x in rows.read_text(encoding="utf-8").splitlines()])
    return trl_compare.trl_first_step(lambda callbacks: trainer_class(
        model=AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32), args=args,
        train_dataset=data, processing_class=AutoTokenizer.from_pretrained(tokenizer_for(case, tokenizer)),
        callbacks=callbacks))


# --- the step-one comparison -----------------------------------------------------------------------------------

def compare(cases: list[Case], cli: set[str], work: Path, inputs: tuple[Path, Path, Path, Path]) -> list[dict]:
    table = trl_compare.Table(22, loss_digits=9, norm_digits=8)
    return trl_compare.side_by_side(cases, cli, table, lambda case: write_recipe(case, work, *inputs),
                                    lambda case: trl_step(case, work, *inputs))


def main() -> None:
    parser = trl_compare.make_parser(__doc__, ["b0.5-t2-4x4"])
    trl_compare.add_outputs(parser, "tests/objectives/test_distill_trl.py")
    args = parser.parse_args()
    print(trl_compare.versions(trl_compare.start_trl(args.trl_path)))
    work = trl_compare.work_dir(args.work, "distill-vs-trl-")
    inputs = write_inputs(work)
    student, teacher, rows_path, tokenizer = inputs
    rows_digest, tokenizer_digest = inputs_digest(rows_path, tokenizer)
    print(f"student {weights_digest(student)[:16]}, teacher {weights_digest(teacher)[:16]}, rows "
          f"{rows_digest[:16]}, last-turn tokenizer {tokenizer_digest[:16]} (sha256)")
    rows = compare(CASES + KNOWN, set(args.cli), work, inputs)
    print(f"\n! a setting where ours and TRL's differ (module docstring)\nworst relative difference, ours vs TRL, "
          f"other rows (loss, grad norm, whole gradient): {trl_compare.worst(rows):.2e}")
    if args.pins:  # tests/objectives/test_distill_trl.py's TRL (rows that match) and TRL_KNOWN (rows "!")
        for title, known in (("TRL", False), ("TRL_KNOWN", True)):
            table = trl_compare.pins(r for r in rows if r["known_difference"] == known)
            print(f"{title} = {{\n{table}}}")
    trl_compare.write_json(args.json, rows)


if __name__ == "__main__":
    main()
