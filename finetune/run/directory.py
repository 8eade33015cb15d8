"""The run directory: its layout, the readers of what a run wrote, and the rules for starting a run in one.

This is the one module that spells out the layout (docs/design.md, "The run directory"):

    output_dir/recipe.yaml        the fully resolved recipe
    output_dir/versions.json      library versions and the device
    output_dir/metrics.jsonl      one JSON object per optimizer step, plus eval lines
    output_dir/checkpoints/step-N/   resumable state (finetune/run/checkpoint.py writes it)
    output_dir/final/             the trained model (or adapter) in HF format
    output_dir/finetune-run.json  the marker: the run's id and the entries it owns (finetune/run/startup.py)
    output_dir/finetune-run.lock  held by the live run, gone when it ends (finetune/run/lock.py)

Everything else reaches those files through `RunDir` and the readers here. No torch: `finetune plot` and
`finetune runs compare` stay light.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune.errors import UserError, first_line
from finetune.recipe import Recipe, parse_yaml, validate
from finetune.run.atomic import displaced


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    root: Path

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def versions(self) -> Path:
        return self.root / "versions.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def marker(self) -> Path:
        """finetune-run.json: this directory is a finetune run's, which run, and which of its entries are the run's."""
        return self.root / MARKER_NAME

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def tracker(self, name: str) -> Path:
        """Where an offline tracker keeps its files: wandb, mlflow.db, mlartifacts or mlruns."""
        assert name in TRACKER_FILES, name
        return self.root / name


MARKER_NAME = "finetune-run.json"
TRACKER_FILES = ("wandb", "mlflow.db", "mlartifacts", "mlruns")
# Every entry a run may write (which ones a run owns, its marker lists: run/startup.py).
RUN_FILES = ("metrics.jsonl", "recipe.yaml", "versions.json", "checkpoints", "final", "tensorboard", *TRACKER_FILES)


# --- reading a run ---------------------------------------------------------------------------------------

def existing_run(run_dir: str | Path) -> RunDir:
    """The run directory `run_dir` names, or a UserError when it is not one (no recipe.yaml)."""
    run = RunDir(Path(run_dir).expanduser())
    if not run.root.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if not run.recipe.is_file():
        raise UserError(f"{run_dir} is not a run directory: it has no recipe.yaml (finetune train writes the "
                        "resolved recipe there when a run starts); give the run's output_dir")
    return run


def is_run(path: str | Path) -> bool:
    """Whether `path` is a run directory (it holds a recipe.yaml)."""
    return RunDir(Path(path).expanduser()).recipe.is_file()


def read_recipe_dict(run_dir: str | Path) -> dict[str, Any]:
    """The run's recipe.yaml as written, unvalidated: a run from an older finetune compares and plots even when
    today's schema would refuse its recipe."""
    file = existing_run(run_dir).recipe
    try:
        # The recipe loader's bounds: an alias bomb placed in a run directory is refused, not expanded for hours.
        data = parse_yaml(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: cannot read the run's recipe ({first_line(e)})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        problem = getattr(e, "problem", None) or first_line(e)
        raise UserError(f"{where}: cannot read the run's recipe ({problem})") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: not a recipe (expected a mapping of keys)")
    return data


def read_recipe(run_dir: str | Path) -> Recipe:
    """The run's recipe, validated (its data files need not exist any more: nothing reads them here)."""
    return validate(read_recipe_dict(run_dir), source=str(existing_run(run_dir).recipe))


def finished_run(run_dir: str | Path) -> tuple[Recipe, Path]:
    """(the run's recipe, its final/ directory) of a finished run, or a UserError saying what is missing."""
    run = existing_run(run_dir)
    if not run.final.is_dir():
        aside = displaced(run.final)  # a final save killed between its two renames (atomic.commit)
        if aside.is_dir():
            raise UserError(f"{run_dir} has no final/ directory, but {aside.name}: a final save was killed while "
                            "replacing final/, and that is the previous one. The next `finetune train` of this "
                            f"output_dir puts it back; or rename {aside} to final")
        raise UserError(f"{run_dir} has no final/ directory: the run did not finish (resume it with resume: auto)")
    return read_recipe(run_dir), run.final


def read_versions(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's versions.json, or None when it is missing or unreadable."""
    try:
        data = json.loads(RunDir(Path(run_dir)).versions.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_eval(record: dict[str, Any]) -> bool:
    """An eval line of metrics.jsonl (a train line has `loss`, an eval line `eval_loss`, or GRPO's `eval_reward`)."""
    return "eval_loss" in record or "eval_reward" in record


def number(record: dict[str, Any], key: str) -> float:
    """A numeric field of a metrics record, NaN when absent: a record from an older trainer must not break a
    reader."""
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


@dataclass
class RunMetrics:
    """A run's metrics.jsonl: train lines and eval lines, one per step, in step order.

    A resumed run appends the steps after its checkpoint again; the later line of a step wins (it is the one
    the final weights descend from). `lines` keeps every train line in file order, for wall-clock totals.
    """

    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """Read RUN_DIR/metrics.jsonl. UserError naming the file when it is missing, empty or corrupt.

    A last line cut short (a crash mid-write) is ignored; a bad line anywhere else is an error.
    """
    path = RunDir(Path(run_dir)).metrics
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise UserError(f"{path} not found: {run_dir} is not a training run directory, or its run has not "
                        "logged a step yet")
    # "\n" only, as JSON lines are: str.splitlines would also split inside a string at U+2028, U+0085, ...
    text_lines = [t for t in path.read_text(encoding="utf-8").split("\n") if t.strip()]
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    lines: list[dict[str, Any]] = []
    for line_no, text in enumerate(text_lines, 1):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            if line_no == len(text_lines):
                break
            raise UserError(f"{path}:{line_no}: not a JSON object ({e.msg}); fix or delete that line") from None
        if not isinstance(record, dict) or "step" not in record:
            raise UserError(f"{path}:{line_no}: not a metrics record (needs a 'step' field)")
        record = {k: float(v) if v in NON_FINITE else v for k, v in record.items()}
        if is_eval(record):
            evals[int(record["step"])] = record
        elif "loss" in record:
            train[int(record["step"])] = record
            lines.append(record)
    if not train and not evals:
        raise UserError(f"{path} has no metrics records (empty file): the run has not logged a step yet")
    return RunMetrics(path, [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)], lines)


# How metrics.jsonl writes a number that is not finite (metrics/sinks.py JsonlSink); read back as floats.
NON_FINITE = ("NaN", "Infinity", "-Infinity")


def total_elapsed(lines: list[dict[str, Any]]) -> float:
    """Wall-clock seconds of training over every launch: elapsed_s restarts at each resume, so sum the last
    value of each launch (a launch ends where elapsed_s goes down)."""
    total, last = 0.0, 0.0
    for r in lines:
        value = number(r, "elapsed_s")
        if not math.isfinite(value):
            continue
        if value < last:
            total += last
        last = value
    return total + last


# --- writing a run (rank 0; finetune/run/startup.py decides whether it may) -----------------------------

def write_run_header(run: RunDir, recipe_yaml: str, versions: dict[str, Any]) -> None:
    """recipe.yaml and versions.json, written when a run starts (or resumes: the resumed launch's versions)."""
    run.recipe.write_text(recipe_yaml, encoding="utf-8")
    run.versions.write_text(json.dumps(versions, indent=2), encoding="utf-8")


def truncate_metrics(run: RunDir, step: int) -> None:
    """Keep the metrics lines up to the resumed step: a killed run may have logged steps that are re-run now."""
    path = run.metrics
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)
