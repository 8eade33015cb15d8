"""What every side-by-side with TRL shares (benchmarks/*_vs_trl.py): TRL on the path, the common options, ours and
TRL's step one, their relative differences, the table, the worst difference and the pins.

Not a benchmark itself: grpo_vs_trl.py, preference_vs_trl.py, distill_vs_trl.py and reward_vs_trl.py import it
(benchmarks/ is on sys.path when they run as scripts; each adds it when loaded by path). Each keeps its own inputs,
cases, recipe and TRL trainer; what differs between them (column widths, which rows are marked) is a `Table`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without an editable install
    sys.path.insert(0, str(ROOT))

# (loss, pre-clip grad norm, gradients by name) of one step one
Figures = tuple[float, float, dict[str, Any]]


# --- TRL and the common options --------------------------------------------------------------------------------

def make_parser(doc: str, cli: list[str], work: str = "models, data and runs") -> argparse.ArgumentParser:
    """The options every side-by-side takes first: --trl-path, --work (where `work` go), --cli (default `cli`)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-path", help="a directory holding the trl package (pip install --target)")
    parser.add_argument("--work", type=Path, help=f"where {work} go (default: a temp dir)")
    parser.add_argument("--cli", nargs="*", default=cli,
                        help="case names also run through `finetune train` (all: every case)")
    return parser


def add_outputs(parser: argparse.ArgumentParser, test: str) -> None:
    """--json (every row) and --pins (TRL's figures as the test file `test` pins them)."""
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--pins", action="store_true", help=f"print TRL's figures as {test} pins them")


def start_trl(trl_path: str | None, user_warnings: bool = True) -> ModuleType:
    """TRL imported (from `trl_path`, a `pip install --target` directory, first), or exit saying how to get it; then
    quiet (TRL's experimental notice, FutureWarnings, UserWarnings with `user_warnings`, transformers' logging below
    errors and its progress bars) and torch on one thread. Returns the trl module."""
    if trl_path:
        sys.path.insert(0, trl_path)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
    except ImportError:
        sys.exit("TRL not importable: install trl==1.16.0 with pip --target DIR and pass --trl-path DIR")
    import torch
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed gradient_checkpointing
    if user_warnings:
        warnings.filterwarnings("ignore", category=UserWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # the same reduction order on every run, and a fair share of a shared machine
    return trl


def versions(trl: ModuleType) -> str:
    """`TRL x, torch y, transformers z`."""
    import torch
    import transformers

    return f"TRL {trl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}"


def work_dir(work: Path | None, prefix: str) -> Path:
    """`work`, or a new temporary directory named `prefix`..., made."""
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work


def write_json(path: Path | None, rows: list[dict]) -> None:
    """Every row to `path` (--json), when given."""
    if path:
        path.write_text(json.dumps(rows, indent=1))


# --- ours ------------------------------------------------------------------------------------------------------

def ours_step(recipe_path: Path) -> Figures:
    """(loss, pre-clip grad norm, gradients by name) of step one, through the trainer's own step functions in
    this process: the same parts, plan, micro-batches and step as `finetune train`'s loop."""
    import torch

    from finetune import dist
    from finetune.data import collate, rank_micro_batches
    from finetune.recipe import load_recipe
    from finetune.train.parts import load_parts, plan_for
    from finetune.train.step import clip_gradients, forward_backward, read_step, step_counts

    recipe = load_recipe(recipe_path)
    torch.manual_seed(recipe.seed)
    world, device = dist.World(), torch.device("cpu")
    parts = load_parts(recipe, world, device, lambda message: None, splits=("train",))
    rows = plan_for(recipe, parts, world).step(0)[1]
    micro = [collate(chunk, recipe.data, parts.tokenizer.pad_token_id).to(device) for chunk in
             rank_micro_batches(rows, recipe.train.micro_batch_size, 1, 0, recipe.data.group_by_length)]
    parts.net.train()
    counts = step_counts(parts.objective, micro, world, device)[0]
    sums = forward_backward(parts.net, parts.objective, micro, counts, world, device)
    grads = {name: p.grad.detach().clone() for name, p in parts.lm.named_parameters() if p.grad is not None}
    norm = clip_gradients([p for p in parts.lm.parameters() if p.requires_grad], recipe.train.max_grad_norm)
    figures = read_step(parts.objective, sums, norm, counts)
    return figures.loss, figures.grad_norm, grads


def ours_cli(recipe_path: Path) -> tuple[float, float]:
    """(loss, grad_norm) of step one from metrics.jsonl of `finetune train RECIPE`."""
    import subprocess

    import yaml

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "finetune", "train", str(recipe_path), "--overwrite"], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"finetune train {recipe_path} failed:\n{done.stderr[-3000:]}")
    run = Path(yaml.safe_load(recipe_path.read_text())["output_dir"])
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(x for x in lines if "loss" in x)
    return first["loss"], first["grad_norm"]


# --- TRL -------------------------------------------------------------------------------------------------------

def trl_args(output_dir: Path, micro: int, accum: int, bf16: bool = False) -> dict[str, Any]:
    """The TRL config arguments of every step one: one optimizer step at lr 1e-3 (constant), max_grad_norm 1e9
    (nothing is clipped, as ours), bf16 off unless asked, the CPU, seed 0; no saving, reporting or progress bar."""
    return {"output_dir": str(output_dir), "per_device_train_batch_size": micro,
            "gradient_accumulation_steps": accum, "bf16": bf16, "learning_rate": 1e-3,
            "lr_scheduler_type": "constant", "max_steps": 1, "logging_steps": 1, "save_strategy": "no",
            "report_to": "none", "use_cpu": True, "seed": 0, "max_grad_norm": 1e9, "disable_tqdm": True}


def trl_first_step(trainer: Callable[[list], Any]) -> Figures:
    """(loss, pre-clip grad norm, gradients by name) of a TRL trainer's first step: `trainer(callbacks)` builds it
    with these callbacks, one of which copies every gradient before the optimizer step; loss and norm come from
    its log."""
    from transformers import PrinterCallback, TrainerCallback

    captured: dict[str, Any] = {}

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            captured.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    built = trainer([Gradients()])
    built.remove_callback(PrinterCallback)  # its log lines would interleave with the table
    built.train()
    log = next(x for x in built.state.log_history if "loss" in x)
    return log["loss"], log["grad_norm"], captured


# --- the comparison --------------------------------------------------------------------------------------------

def rel(a: float, b: float) -> float:
    """|a - b| / |b|; where |b| < 1e-6 (a loss that is 0 mathematically: normalize sequences at beta 0, where each
    group's advantages sum to 0 and every completion weighs the same) the absolute difference."""
    return abs(a - b) / abs(b) if abs(b) >= 1e-6 else abs(a - b)


def grad_rel(a: dict[str, Any], b: dict[str, Any]) -> float:
    """||a - b|| / ||b|| over every parameter's gradient."""
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    return math.sqrt(diff / max(sum(float(b[n].double().pow(2).sum()) for n in b), 1e-300))


@dataclass(frozen=True)
class Table:
    """A benchmark's step-one table: the case column's width, the losses' and norms' widths and decimals; with
    `marked`, rows carry their case's known_difference ("!" after the loss rel), with `zero`, a TRL loss that is 0
    mathematically is marked "*" (its rel is absolute)."""

    name: int
    loss: int = 13
    loss_digits: int = 8
    norm: int = 11
    norm_digits: int = 7
    marked: bool = True
    zero: bool = False

    def header(self) -> str:
        return (f"{'case':<{self.name}} {'ours loss':>{self.loss}} {'TRL loss':>{self.loss}} {'rel':>8} "
                f"{'ours |g|':>{self.norm}} {'TRL |g|':>{self.norm}} {'rel':>8} {'grad rel':>8} {'CLI rel':>8}")

    def line(self, row: dict) -> str:
        loss, norm = f">{self.loss}.{self.loss_digits}f", f">{self.norm}.{self.norm_digits}f"
        if self.marked:
            mark = "*" if self.zero and abs(row["trl_loss"]) < 1e-6 else "!" if row["known_difference"] else " "
            loss_rel = f"{row['loss_rel']:>7.1e}{mark}"
        else:
            loss_rel = f"{row['loss_rel']:>8.1e}"
        cli_rel = f"{row['cli_rel']:.1e}" if "cli_rel" in row else "-"
        return (f"{row['case']:<{self.name}} {row['ours_loss']:{loss}} {row['trl_loss']:{loss}} {loss_rel} "
                f"{row['ours_grad_norm']:{norm}} {row['trl_grad_norm']:{norm}} {row['grad_norm_rel']:>8.1e} "
                f"{row['grad_rel']:>8.1e} {cli_rel:>8}")


def side_by_side(cases: Iterable[Any], cli: set[str], table: Table, recipe: Callable[[Any], Path],
            trl: Callable[[Any], Figures]) -> list[dict]:
    """Each case: ours (ours_step on `recipe(case)`; `finetune train` too when the case is named in `cli`, or `cli`
    holds all) and TRL (`trl(case)`); a row each, printed as it ends under the table's header."""
    rows = []
    print(table.header(), flush=True)
    for case in cases:
        path = recipe(case)
        loss, norm, grads = ours_step(path)
        t_loss, t_norm, t_grads = trl(case)
        row = {"case": case.name} | ({"known_difference": case.known_difference} if table.marked else {})
        row |= {"ours_loss": loss, "trl_loss": t_loss, "loss_rel": rel(loss, t_loss), "ours_grad_norm": norm,
                "trl_grad_norm": t_norm, "grad_norm_rel": rel(norm, t_norm), "grad_rel": grad_rel(grads, t_grads)}
        if case.name in cli or "all" in cli:
            c_loss, c_norm = ours_cli(path)
            row |= {"cli_loss": c_loss, "cli_grad_norm": c_norm,
                    "cli_rel": max(rel(c_loss, t_loss), rel(c_norm, t_norm))}
        rows.append(row)
        print(table.line(row), flush=True)
    return rows


def worst(rows: list[dict], whole_gradient: bool = True) -> float:
    """The largest relative difference of the compared rows without a known difference: loss, grad norm, the whole
    gradient (with `whole_gradient`) and the CLI's."""
    keys = ("loss_rel", "grad_norm_rel", "grad_rel") if whole_gradient else ("loss_rel", "grad_norm_rel")
    return max(max(*(r[k] for k in keys), r.get("cli_rel", 0.0)) for r in rows
               if "loss_rel" in r and not r.get("known_difference"))


def pins(rows: Iterable[dict]) -> str:
    """The rows' TRL figures, full precision, as the tests' TRL tables hold them: `    "case": (loss, norm),` lines."""
    return "".join(f'    "{r["case"]}": ({r["trl_loss"]!r}, {r["trl_grad_norm"]!r}),\n' for r in rows)
