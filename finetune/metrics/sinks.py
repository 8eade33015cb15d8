"""Where each metrics record goes: metrics.jsonl, the console, and the trackers a recipe turns on.

The trainer computes one record per optimizer step (and one per evaluation) exactly once and hands it to a
`MetricsLogger`, which fans it out to every sink. Trackers (metrics/trackers.py) are imported lazily; one that
is not installed or cannot start is reported and left out, and one that fails mid-run is reported once and
dropped: training never dies from a tracker. metrics.jsonl is the record of truth; `finetune plot` and
`finetune runs compare` read it back (finetune/run/directory.py).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from finetune.errors import first_line
from finetune.recipe import LoggingConfig, to_yaml
from finetune.run.directory import RunDir, is_eval, number

INSTALL_HINT = "pip install 'finetune[tracking]'"


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self, ok: bool = True) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record as tracker tags: `train/loss`, `train/lr`, ..., `eval/loss`, `eval/tokens`.

    One naming for every tracker, so a TensorBoard tag and a W&B or MLflow key of the same quantity match.
    `step` is the x axis, not a value; `total_steps` is a constant; booleans (`skipped`) become 0/1.
    """
    prefix = "eval" if is_eval(record) else "train"
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "total_steps") or not isinstance(value, (int, float)):
            continue
        name = key.removeprefix("eval_") if prefix == "eval" else key
        out[f"{prefix}/{name}"] = float(value)
    return out


def _finite_or_name(value: Any) -> Any:
    """A float as it is, or the name JSON readers know for it when it is not finite ("NaN", "Infinity")."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)  # Python's own spelling: NaN, Infinity, -Infinity
    return value


class JsonlSink:
    """metrics.jsonl: one JSON object per line, flushed each write so a crash loses nothing written.

    A non-finite number (a NaN step loss, rewards that overflow) is data, but strict JSON has no such numbers:
    it is written as the string "NaN", "Infinity" or "-Infinity", which run/directory.read_metrics turns back into
    a float.
    """

    def __init__(self, path: Path) -> None:
        self.handle = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps({k: _finite_or_name(v) for k, v in record.items()}, allow_nan=False) + "\n")
        self.handle.flush()

    def close(self, ok: bool = True) -> None:
        self.handle.close()


class ConsoleSink:
    """A progress bar (step/total, loss, lr, tokens/s, time left) on a terminal; plain lines otherwise.

    Lines come every `every` steps; a line's loss is the token-weighted mean of the steps since the last line,
    and it says so (`loss(avg N)`), so no window average is ever shown as a single step's value.
    """

    def __init__(self, console: Console, total_steps: int, every: int, start_step: int = 0) -> None:
        self.console, self.every, self.total = console, max(1, every), total_steps
        self.window: list[dict[str, Any]] = []
        self.progress: Progress | None = None
        if console.is_terminal:
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def write(self, record: dict[str, Any]) -> None:
        if is_eval(record) and "eval_reward" in record:
            self.console.print(f"eval  step {record['step']:>5}  eval_reward {record['eval_reward']:.4f}  "
                               f"({record['eval_prompts']} prompts, greedy)")
            return
        if is_eval(record):
            counted = "pairs" if "eval_pairs" in record else "tokens"
            line = (f"eval  step {record['step']:>5}  eval_loss {record['eval_loss']:.4f}  "
                    f"({record.get(f'eval_{counted}', '?')} {counted})")
            if "eval_reward_accuracy" in record:
                line += f"  reward_accuracy {record['eval_reward_accuracy']:.3f}"
            self.console.print(line)
            return
        self.window.append(record)
        if self.progress is not None:
            info = (f"loss {number(record, 'loss'):.4f}  lr {number(record, 'lr'):.2e}  "
                    f"{number(record, 'tokens_per_s'):.0f} tok/s")
            self.progress.update(self.task, completed=record["step"], info=info)
        if record["step"] % self.every == 0 or record["step"] == self.total:
            self.console.print(format_window(self.window))
            self.window = []

    def close(self, ok: bool = True) -> None:
        if self.window and not ok:  # a run that stopped mid-window still shows what it had
            self.console.print(format_window(self.window))
            self.window = []
        if self.progress is not None:
            self.progress.stop()


def window_loss(records: list[dict[str, Any]]) -> float:
    """Token-weighted mean loss of several steps: sum(loss_i * tokens_i) / sum(tokens_i) (pair-weighted for
    preference objectives, whose loss is per pair).

    Each step's loss is already a mean over its own target tokens, so weighting by those counts gives the mean
    over every target token of the window, the same quantity one step logs. A plain mean of the step losses
    would overweight steps with few targets. (ORPO's loss has a per-token and a per-pair part: weighting by
    pairs makes its window mean close, not exact.)
    """
    unit = "pairs" if "pairs" in records[-1] else "tokens"
    weight = sum(number(r, unit) for r in records)
    if not weight:
        return float("nan")
    return sum(number(r, "loss") * number(r, unit) for r in records) / weight


def format_window(records: list[dict[str, Any]]) -> str:
    """One console line for the steps since the last line, loss token-weighted over them."""
    last = records[-1]
    label = "loss" if len(records) == 1 else f"loss(avg {len(records)})"
    line = (f"step {last['step']:>5}/{last.get('total_steps', '?')}  {label} {window_loss(records):.4f}  "
            f"grad_norm {number(last, 'grad_norm'):.3f}  lr {number(last, 'lr'):.2e}  "
            f"{number(last, 'tokens_per_s'):.0f} tok/s")
    if "update_ratio" in last:
        line += f"  upd {number(last, 'update_ratio'):.1e}"
    if isinstance(last.get("mfu"), (int, float)):
        line += f"  mfu {100 * last['mfu']:.1f}%"
    if "zero_std_groups" in last:  # GRPO: the step's mean reward, and how many of its groups had nothing to learn
        line += f"  reward {number(last, 'reward'):.3f}  zero_std_groups {number(last, 'zero_std_groups'):.2f}"
    if "reward_accuracy" in last:
        line += f"  reward_accuracy {number(last, 'reward_accuracy'):.3f}  margin {number(last, 'reward_margin'):.3f}"
    skipped = sum(1 for r in records if r.get("skipped"))
    if skipped:
        line += f"  ({skipped} skipped)"
    return line



class MetricsLogger:
    """Fans each record out to the sinks; a sink that raises is reported once and dropped.

    Catches `Exception` only: Ctrl-C and SystemExit still stop training as the user asked.
    """

    def __init__(self, sinks: list[Sink], console: Console) -> None:
        self.sinks, self.console = list(sinks), console

    def log(self, record: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as e:  # a tracker must never end a training run
                warn(self.console, f"metrics sink {type(sink).__name__} failed ({type(e).__name__}: "
                                   f"{first_line(e)}); it is dropped for the rest of the run")
                self.sinks.remove(sink)
                with contextlib.suppress(Exception):  # release its files/threads if it still can
                    sink.close(ok=False)

    def close(self, ok: bool = True) -> None:
        """Close every sink (best effort). ok=False marks tracker runs as failed (training raised)."""
        sinks, self.sinks = self.sinks, []  # idempotent: a second close does nothing
        for sink in sinks:
            with contextlib.suppress(Exception):  # closing a broken tracker is best effort
                sink.close(ok=ok)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        self.close(ok=exc_type is None)


def open_sinks(run: RunDir, logging: LoggingConfig, console: Console, total_steps: int, start_step: int,
               config: dict[str, Any] | None = None) -> MetricsLogger:
    """The sinks a recipe asks for. Optional trackers that cannot start warn and are left out.

    `config` is the resolved recipe as a dict (recipe.model_dump(mode="json")): W&B's config, MLflow's params,
    and as YAML the recipe TensorBoard and MLflow store beside the metrics.
    """
    from finetune.metrics import trackers  # each tracker's own package is imported only when it starts

    sinks: list[Sink] = [JsonlSink(run.metrics), ConsoleSink(console, total_steps, logging.every_steps, start_step)]
    recipe_yaml = to_yaml(config) if config is not None else None
    wanted: list[tuple[str, str, Any]] = []  # (recipe key, module to import, how to start the sink)
    if logging.tensorboard:
        wanted.append(("logging.tensorboard", "tensorboard",
                       lambda: trackers.TensorBoardSink(run.tensorboard, recipe_yaml)))
    if logging.wandb:
        wanted.append(("logging.wandb", "wandb", lambda: trackers.WandbSink(run, logging.wandb_project, config)))
    if logging.mlflow:
        wanted.append(("logging.mlflow", "mlflow",
                       lambda: trackers.MLflowSink(run, logging.mlflow_experiment, config, recipe_yaml)))
    for key, module, start in wanted:
        try:
            sinks.append(start())
        except ImportError as e:
            # A missing package (or a broken install of one of its dependencies): say how to get it.
            missing = getattr(e, "name", None) or module
            warn(console, f"{key} needs the {module} package ({missing} could not be imported): "
                          f"{INSTALL_HINT}; continuing without it")
        except Exception as e:  # no login, no network, a bad store URI: the run goes on without it
            hint = "; set WANDB_MODE=offline to log without network" if module == "wandb" else ""
            warn(console, f"{key}: {module} could not start ({type(e).__name__}: {first_line(e)}){hint}; "
                          "continuing without it")
    return MetricsLogger(sinks, console)


def warn(console: Console, message: str) -> None:
    """A yellow warning line, printed verbatim: no rich markup, or `finetune[tracking]` would lose its
    `[tracking]` (rich reads it as a style tag) and an exception's text could restyle the line."""
    console.print(f"warning: {message}", style="yellow", markup=False, highlight=False)


