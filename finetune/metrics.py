"""Per-step metrics records, their sinks, MFU, and reading a run's metrics.jsonl back.

The trainer computes one record per optimizer step (and one per evaluation) exactly once and hands it to a
`MetricsLogger`, which fans it out to every sink: the console, metrics.jsonl, and the optional trackers
(TensorBoard, Weights & Biases, MLflow). Trackers are imported lazily; one that is not installed or cannot
start is reported and left out, and one that fails mid-run is reported once and dropped: training never dies
from a tracker. metrics.jsonl is the record of truth; `finetune plot` and `finetune runs compare` read it back
with `read_metrics`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from finetune.errors import UserError

if TYPE_CHECKING:  # torch is heavy: only the step-time helpers need it, lazily
    import torch

INSTALL_HINT = "pip install 'finetune[tracking]'"


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self, ok: bool = True) -> None: ...


def is_eval(record: dict[str, Any]) -> bool:
    return "eval_loss" in record


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


class JsonlSink:
    """metrics.jsonl: one JSON object per line, flushed each write so a crash loses nothing written.

    NaN is written as the bare token `NaN` (Python's json reads it back): a non-finite step loss is data.
    """

    def __init__(self, path: Path) -> None:
        self.handle = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record, allow_nan=True) + "\n")
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
        if is_eval(record):
            self.console.print(f"eval  step {record['step']:>5}  eval_loss {record['eval_loss']:.4f}  "
                               f"({record.get('eval_tokens', '?')} tokens)")
            return
        self.window.append(record)
        if self.progress is not None:
            info = (f"loss {_num(record, 'loss'):.4f}  lr {_num(record, 'lr'):.2e}  "
                    f"{_num(record, 'tokens_per_s'):.0f} tok/s")
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


def _num(record: dict[str, Any], key: str) -> float:
    """A numeric field, NaN when absent: a record from an older trainer must not kill the console."""
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def window_loss(records: list[dict[str, Any]]) -> float:
    """Token-weighted mean loss of several steps: sum(loss_i * tokens_i) / sum(tokens_i).

    Each step's loss is already a mean over its own target tokens, so weighting by those counts gives the mean
    over every target token of the window, the same quantity one step logs. A plain mean of the step losses
    would overweight steps with few targets.
    """
    tokens = sum(_num(r, "tokens") for r in records)
    if not tokens:
        return float("nan")
    return sum(_num(r, "loss") * _num(r, "tokens") for r in records) / tokens


def format_window(records: list[dict[str, Any]]) -> str:
    """One console line for the steps since the last line, loss token-weighted over them."""
    last = records[-1]
    label = "loss" if len(records) == 1 else f"loss(avg {len(records)})"
    line = (f"step {last['step']:>5}/{last.get('total_steps', '?')}  {label} {window_loss(records):.4f}  "
            f"grad_norm {_num(last, 'grad_norm'):.3f}  lr {_num(last, 'lr'):.2e}  "
            f"{_num(last, 'tokens_per_s'):.0f} tok/s")
    if "update_ratio" in last:
        line += f"  upd {_num(last, 'update_ratio'):.1e}"
    if isinstance(last.get("mfu"), (int, float)):
        line += f"  mfu {100 * last['mfu']:.1f}%"
    skipped = sum(1 for r in records if r.get("skipped"))
    if skipped:
        line += f"  ({skipped} skipped)"
    return line


class TensorBoardSink:
    """TensorBoard events under output_dir/tensorboard (needs the `tensorboard` package).

    Tags are those of `scalars` (train/loss, eval/loss, ...); the resolved recipe is stored as a text summary
    so the event file alone says what produced it.
    """

    def __init__(self, log_dir: Path, recipe_yaml: str | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency

        self.writer = SummaryWriter(str(log_dir))
        if recipe_yaml:
            # Markdown code block, so TensorBoard's text tab keeps the indentation.
            self.writer.add_text("recipe", "```yaml\n" + recipe_yaml + "\n```", 0)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self, ok: bool = True) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases. wandb itself reads WANDB_MODE (offline: files under output_dir/wandb, no network;
    `wandb sync` uploads them later), WANDB_API_KEY, WANDB_ENTITY, etc.; nothing here overrides them.

    Every launch is its own W&B run, named after the run directory; a resumed training shows as a second run
    starting at its resume step.
    """

    def __init__(self, output_dir: Path, project: str | None, config: dict[str, Any] | None) -> None:
        import wandb  # lazy: optional dependency

        self.run = wandb.init(project=project or "finetune", name=output_dir.resolve().name,
                              dir=str(output_dir), config=config or {})

    def write(self, record: dict[str, Any]) -> None:
        # An eval line at step N follows train step N: same step, which W&B accepts (it never goes back).
        self.run.log(scalars(record), step=record["step"])

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MLflowSink:
    """MLflow, through an explicit `MlflowClient` (no global active run to leak into the user's process).

    The tracking store is MLFLOW_TRACKING_URI when set, else a local store inside the run directory
    (`local_mlflow_uri`): offline, and next to the run it describes (`mlflow ui --backend-store-uri
    sqlite:///RUN/mlflow.db` shows it). The
    experiment is MLFLOW_EXPERIMENT_NAME, else `logging.mlflow_experiment`, else "finetune". The resolved
    recipe is logged as dotted params and as the artifact recipe.yaml.
    """

    MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value; longer values (chat templates) are cut
    BATCH = 100  # MLflow's limit on params per log_batch call

    def __init__(self, output_dir: Path, experiment: str | None, config: dict[str, Any] | None,
                 recipe_yaml: str | None = None) -> None:
        from mlflow.entities import Param  # lazy: optional dependency
        from mlflow.tracking import MlflowClient

        remote = os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = remote or local_mlflow_uri(output_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment or "finetune"
        found = self.client.get_experiment_by_name(name)
        # A local database store's default artifact root is ./mlruns under the *current directory*: keep a
        # local run's artifacts inside its run directory instead. A configured store keeps its own default.
        artifacts = None if remote else (output_dir / "mlartifacts").resolve().as_uri()
        experiment_id = found.experiment_id if found else self.client.create_experiment(name, artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=output_dir.resolve().name).info.run_id
        params = [Param(k, _param_text(v)[: self.MAX_PARAM_LENGTH]) for k, v in flatten(config or {}).items()]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i: i + self.BATCH])
        if recipe_yaml:
            self.client.log_text(self.run_id, recipe_yaml, "recipe.yaml")

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, int(record["step"])) for tag, value in scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


def local_mlflow_uri(output_dir: Path) -> str:
    """The offline MLflow store of a run: SQLite at output_dir/mlflow.db, else files under output_dir/mlruns.

    MLflow >= 3.7 keeps its file store in maintenance mode and refuses to open one unless
    MLFLOW_ALLOW_FILE_STORE=true (measured with 3.17: MlflowException at the first call); SQLite is its own
    default now and needs SQLAlchemy, which the full `mlflow` package brings. `mlflow-skinny` and MLflow 2.x
    without SQLAlchemy still get the file store, which they accept.
    """
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is not None:
        return f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
    return (output_dir / "mlruns").resolve().as_uri()


def _param_text(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as dotted keys (`train.lr`, `datasets.0.path`); empty containers stay values."""
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict) and value:
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list) and value:
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, child in items:
        out.update(flatten(child, f"{prefix}.{key}" if prefix else key))
    return out


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
                                   f"{_first_line(e)}); it is dropped for the rest of the run")
                self.sinks.remove(sink)
                with contextlib.suppress(Exception):  # release its files/threads if it still can
                    _close(sink, ok=False)

    def close(self, ok: bool = True) -> None:
        """Close every sink (best effort). ok=False marks tracker runs as failed (training raised)."""
        sinks, self.sinks = self.sinks, []  # idempotent: a second close does nothing
        for sink in sinks:
            with contextlib.suppress(Exception):  # closing a broken tracker is best effort
                _close(sink, ok)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        self.close(ok=exc_type is None)


def _close(sink: Sink, ok: bool) -> None:
    try:
        sink.close(ok=ok)
    except TypeError:  # a sink written to the older protocol: close(self)
        sink.close()


def open_sinks(output_dir: Path, logging_cfg: Any, console: Console, total_steps: int,
               start_step: int, config: dict[str, Any] | None = None) -> MetricsLogger:
    """The sinks a recipe asks for. Optional trackers that cannot start warn and are left out.

    `config` is the resolved recipe (as a dict) for W&B's config and MLflow's params; when not given it is read
    from output_dir/recipe.yaml, which the trainer writes before opening the sinks.
    """
    sinks: list[Sink] = [JsonlSink(output_dir / "metrics.jsonl"),
                         ConsoleSink(console, total_steps, logging_cfg.every_steps, start_step)]
    recipe_file = output_dir / "recipe.yaml"
    recipe_yaml = recipe_file.read_text(encoding="utf-8") if recipe_file.is_file() else None
    if config is None and recipe_yaml is not None:
        import yaml

        config = yaml.safe_load(recipe_yaml)
    wanted: list[tuple[str, str, Any]] = []  # (recipe key, module to import, how to start the sink)
    if getattr(logging_cfg, "tensorboard", False):
        wanted.append(("logging.tensorboard", "tensorboard",
                       lambda: TensorBoardSink(output_dir / "tensorboard", recipe_yaml)))
    if getattr(logging_cfg, "wandb", False):
        wanted.append(("logging.wandb", "wandb",
                       lambda: WandbSink(output_dir, getattr(logging_cfg, "wandb_project", None), config)))
    if getattr(logging_cfg, "mlflow", False):
        wanted.append(("logging.mlflow", "mlflow",
                       lambda: MLflowSink(output_dir, getattr(logging_cfg, "mlflow_experiment", None), config,
                                          recipe_yaml)))
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
            warn(console, f"{key}: {module} could not start ({type(e).__name__}: {_first_line(e)}){hint}; "
                          "continuing without it")
    return MetricsLogger(sinks, console)


def warn(console: Console, message: str) -> None:
    """A yellow warning line, printed verbatim: no rich markup, or `finetune[tracking]` would lose its
    `[tracking]` (rich reads it as a style tag) and an exception's text could restyle the line."""
    console.print(f"warning: {message}", style="yellow", markup=False, highlight=False)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


# --- MFU -------------------------------------------------------------------------------------------------

# Dense (no sparsity) peak bf16 tensor-core FLOP/s per GPU, from the vendors' data sheets. Checked in order
# against torch.cuda.get_device_name(); specific variants come before the family name.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2.5e15),
    (r"\bB200\b", 2.25e15),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\b(H100|H800|H200|GH200)\b", 989e12),  # SXM / HBM3 parts
    (r"\b(A100|A800)\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
    (r"\bRTX 6000 Ada\b", 364e12),
    (r"\bA6000\b", 155e12),
    (r"\b4090\b", 165e12),  # GeForce: bf16 with fp32 accumulation
    (r"\b3090\b", 71e12),
    (r"\bMI300X\b", 1307e12),
    (r"\bMI250X?\b", 383e12),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU by its name, None when it is not in the table."""
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops
    return None


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·H·T (PaLM, appendix B).

    6N: every weight does one multiply-add (2 FLOPs) per token in the forward and two in the backward (the
    gradients with respect to the activations and to the weight). 12·L·H·T: attention's QK^T and AV products,
    2·2·H·T FLOPs per token and layer forward, times 3 with the backward. N counts every parameter, frozen
    ones too (the convention; for LoRA, whose frozen weights need no weight gradient, it overstates the
    work by up to a third). T is the sequence length the model attends over (data.max_seq_len).
    """
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def mfu(tokens_per_s: float, n_params: int, n_layers: int, hidden: int, seq_len: int,
        device: torch.device) -> float | None:
    """Model FLOPs utilization: achieved FLOP/s (tokens/s x `flops_per_token`) over the GPU's bf16 peak.

    `tokens_per_s` is this GPU's throughput (divide a global figure by the world size). None on a CPU or a GPU
    that is not in PEAK_BF16_FLOPS: a made-up peak would give a made-up utilization.
    """
    if device.type != "cuda" or not math.isfinite(tokens_per_s):
        return None
    import torch

    try:
        name = torch.cuda.get_device_name(device)
    except Exception:  # no driver, bad index: no figure rather than a crash
        return None
    peak = peak_flops(name)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token(n_params, n_layers, hidden, seq_len) / peak


# --- reading a run back ----------------------------------------------------------------------------------

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
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise UserError(f"{path} not found: {run_dir} is not a training run directory, or its run has not "
                        "logged a step yet")
    text_lines = [t for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    lines: list[dict[str, Any]] = []
    for number, text in enumerate(text_lines, 1):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            if number == len(text_lines):
                break
            raise UserError(f"{path}:{number}: not a JSON object ({e.msg}); fix or delete that line") from None
        if not isinstance(record, dict) or "step" not in record:
            raise UserError(f"{path}:{number}: not a metrics record (needs a 'step' field)")
        if is_eval(record):
            evals[int(record["step"])] = record
        elif "loss" in record:
            train[int(record["step"])] = record
            lines.append(record)
    if not train and not evals:
        raise UserError(f"{path} has no metrics records (empty file): the run has not logged a step yet")
    return RunMetrics(path, [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)], lines)


def total_elapsed(lines: list[dict[str, Any]]) -> float:
    """Wall-clock seconds of training over every launch: elapsed_s restarts at each resume, so sum the last
    value of each launch (a launch ends where elapsed_s goes down)."""
    total, last = 0.0, 0.0
    for r in lines:
        value = _num(r, "elapsed_s")
        if not math.isfinite(value):
            continue
        if value < last:
            total += last
        last = value
    return total + last


def peak_memory_mb() -> float:
    """Peak CUDA memory when on a GPU, else the process's peak resident set size."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux
    except ImportError:  # not on Windows
        return float("nan")


def weight_sample(p: torch.Tensor, size: int = 4096) -> torch.Tensor:
    """A fixed strided view of a weight (this rank's shard under FSDP2), at most ~2 x size elements (all of a
    smaller one): update_ratio compares it before and after the step, because copying every trainable weight
    each step would double their memory in a full fine-tune."""
    flat = (p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
    return flat[:: max(1, flat.numel() // size)]


def update_sums(before: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """[sum of squared changes, sum of squares before] over the weight samples, in float64."""
    import torch

    delta = sum(float((weight_sample(p).float() - b.float()).pow(2).sum()) for p, b in zip(params, before))
    norm = sum(float(b.float().pow(2).sum()) for b in before)
    return torch.tensor([delta, norm], dtype=torch.float64)


class Stopwatch:
    """Elapsed seconds since creation, and per-step durations."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def start_lap(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def finite(x: float) -> bool:
    return math.isfinite(x)
