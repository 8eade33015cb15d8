"""The optional experiment trackers as metrics sinks: TensorBoard, Weights & Biases, MLflow.

Each is imported only when a recipe turns it on. Every tracker gets the same tag names (`scalars`), so a
TensorBoard tag and a W&B or MLflow key of the same quantity match.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from finetune.metrics.sinks import scalars
from finetune.recipe import flatten
from finetune.run.directory import RunDir


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

    def __init__(self, run: RunDir, project: str | None, config: dict[str, Any] | None) -> None:
        import wandb  # lazy: optional dependency

        self.run = wandb.init(project=project or "finetune", name=run.root.resolve().name,
                              dir=str(run.root), config=config or {})

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

    def __init__(self, run: RunDir, experiment: str | None, config: dict[str, Any] | None,
                 recipe_yaml: str | None = None) -> None:
        from mlflow.entities import Param  # lazy: optional dependency
        from mlflow.tracking import MlflowClient

        remote = os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = remote or local_mlflow_uri(run)
        self.client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment or "finetune"
        found = self.client.get_experiment_by_name(name)
        # A local database store's default artifact root is ./mlruns under the *current directory*: keep a
        # local run's artifacts inside its run directory instead. A configured store keeps its own default.
        artifacts = None if remote else run.tracker("mlartifacts").resolve().as_uri()
        experiment_id = found.experiment_id if found else self.client.create_experiment(name, artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run.root.resolve().name).info.run_id
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


def local_mlflow_uri(run: RunDir) -> str:
    """The offline MLflow store of a run: SQLite at output_dir/mlflow.db, else files under output_dir/mlruns.

    MLflow >= 3.7 keeps its file store in maintenance mode and refuses to open one unless
    MLFLOW_ALLOW_FILE_STORE=true (measured with 3.17: MlflowException at the first call); SQLite is its own
    default now and needs SQLAlchemy, which the full `mlflow` package brings. `mlflow-skinny` and MLflow 2.x
    without SQLAlchemy still get the file store, which they accept.
    """
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is not None:
        return f"sqlite:///{run.tracker('mlflow.db').resolve()}"
    return run.tracker("mlruns").resolve().as_uri()


def _param_text(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


