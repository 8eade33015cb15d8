"""Metrics: the logged step loss is the quantity the step trained on, sinks fan out and fail safely, the
console's window line is a token-weighted average that says so, TensorBoard events read back, MFU.

One real CLI run (the quickstart, shrunk, 2 steps without packing, TensorBoard on, W&B asked for but not
importable) backs the integration tests; the rest are unit tests on records built by hand.
"""

from __future__ import annotations

import io
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import QUICKSTART, TINY, eval_lines, run_cli, train_lines
from rich.console import Console

from finetune.metrics import (
    INSTALL_HINT,
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    flops_per_token,
    format_window,
    mfu,
    open_sinks,
    peak_flops,
    scalars,
    window_loss,
)
from finetune.recipe import LoggingConfig
from finetune.run.directory import RunDir, read_metrics, total_elapsed

# Few rows, so data building and the final eval cost little; no packing, so a step's rows are whole samples.
OVERRIDES = [*TINY, "train.max_steps=2", "data.packing=false", "datasets.0.max_rows=64",
             "eval_datasets.0.max_rows=8", "logging.tensorboard=true"]


def _console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=200, force_terminal=False, color_system=None), buffer


def _step(step: int, loss: float, tokens: int, **extra: Any) -> dict[str, Any]:
    return {"step": step, "total_steps": 10, "epoch": 0, "loss": loss, "grad_norm": 1.5, "lr": 1e-3,
            "tokens": tokens, "seq_tokens": 4 * tokens, "padded_tokens": 5 * tokens, "tokens_seen": 4 * tokens * step,
            "tokens_per_s": 100.0, "elapsed_s": float(step), **extra}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The real CLI, 2 steps, with TensorBoard on."""
    out = tmp_path_factory.mktemp("metrics") / "run"
    result = run_cli("train", str(QUICKSTART), f"output_dir={out}", *OVERRIDES)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    return out, result


def test_logged_step_loss_equals_independent_recomputation(cli_run):
    """metrics.jsonl step 1 `loss` == token-weighted cross-entropy of the model's full logits over step 1's rows.

    Independent of the trainer's loss path (fused/chunked loss, micro-batching, N_step bookkeeping): the same
    rows (build_samples, StepPlan), the same seeded random init, one padded batch of all the
    step's rows through the plain HF forward, and torch's own cross_entropy summed over every target token.
    """
    from finetune.data import StepPlan, build_samples
    from finetune.model.loading import load_model
    from finetune.model.tokenizer import load_tokenizer
    from finetune.recipe import load_recipe

    out, _ = cli_run
    logged = train_lines(out)[0]
    assert logged["step"] == 1
    recipe = load_recipe(QUICKSTART, [f"output_dir={out}", *OVERRIDES])
    torch.manual_seed(recipe.seed)
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    samples, _, _, _ = build_samples(recipe, tokenizer)
    _, rows = StepPlan(samples, recipe, world_size=1).step(0)
    assert len(rows) == recipe.train.micro_batch_size * recipe.train.gradient_accumulation_steps

    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    model = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.double()
    targets = labels[:, 1:]
    loss_sum = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
    n_targets = int((targets != -100).sum())
    expected = float(loss_sum) / n_targets
    assert logged["tokens"] == n_targets
    assert abs(logged["loss"] - expected) / expected <= 1e-5, (logged["loss"], expected)


def test_missing_tracker_fails_at_validation_with_install_line(tmp_path):
    """`logging.wandb=true` without wandb installed: the recipe is refused when it is loaded (exit 2, the install
    line), not an hour into a run that silently logs nowhere."""
    from importlib.util import find_spec

    if find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = tmp_path / "run"
    result = run_cli("train", str(QUICKSTART), f"output_dir={out}", *OVERRIDES, "logging.wandb=true")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "wandb" in result.stderr and INSTALL_HINT in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_tensorboard_events_have_train_loss_for_every_step(cli_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = cli_run
    assert list((out / "tensorboard").glob("events.out.tfevents.*")), "no event file"
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= set(tags)
    logged = {r["step"]: r["loss"] for r in train_lines(out)}
    read = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(read) == sorted(logged) == [1, 2]
    for step, loss in logged.items():
        assert read[step] == pytest.approx(loss, rel=1e-6)  # stored as float32
    assert [e.step for e in events.Scalars("eval/loss")] == [e["step"] for e in eval_lines(out)]


def test_metrics_lines_have_the_contract_fields(cli_run):
    out, _ = cli_run
    for r in train_lines(out):
        assert {"step", "epoch", "loss", "grad_norm", "lr", "tokens", "seq_tokens", "padded_tokens", "tokens_per_s",
                "elapsed_s", "tokens_seen"} <= set(r)
    seen = [r["tokens_seen"] for r in train_lines(out)]
    assert seen == list(_cumsum(r["seq_tokens"] for r in train_lines(out)))


def _cumsum(values: Any) -> Any:
    total = 0
    for v in values:
        total += v
        yield total


# --- console ---------------------------------------------------------------------------------------------

def test_window_line_is_token_weighted_and_says_so():
    records = [_step(1, 2.0, tokens=100), _step(2, 4.0, tokens=300)]
    assert window_loss(records) == pytest.approx((2.0 * 100 + 4.0 * 300) / 400)  # 3.5, not the plain mean 3.0
    line = format_window(records)
    assert "loss(avg 2) 3.5000" in line
    single = format_window(records[:1])
    assert "loss 2.0000" in single and "avg" not in single


def test_console_sink_prints_every_n_steps_with_window_average():
    console, buffer = _console()
    sink = ConsoleSink(console, total_steps=5, every=2)
    for step, (loss, tokens) in enumerate([(1.0, 10), (3.0, 30), (2.0, 5), (2.0, 5), (9.0, 1)], 1):
        sink.write(_step(step, loss, tokens))
    sink.write({"step": 5, "eval_loss": 1.25, "eval_tokens": 77})
    sink.close()
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 4, lines  # steps 2 and 4, the last (short) window at step 5, the eval line
    assert "loss(avg 2) 2.5000" in lines[0]  # (1*10 + 3*30) / 40
    assert "loss(avg 2) 2.0000" in lines[1]
    assert "step     5/10  loss 9.0000" in lines[2]
    assert "eval_loss 1.2500" in lines[3] and "77 tokens" in lines[3]


def test_console_sink_survives_records_without_optional_fields():
    console, buffer = _console()
    sink = ConsoleSink(console, total_steps=1, every=1)
    sink.write({"step": 1, "loss": float("nan"), "tokens": 0, "skipped": True})
    assert "loss nan" in buffer.getvalue() and "(1 skipped)" in buffer.getvalue()


# --- fan-out and failing sinks ---------------------------------------------------------------------------

class Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed: bool | None = None

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self, ok: bool = True) -> None:
        self.closed = ok


class Exploding(Recorder):
    def write(self, record: dict) -> None:
        raise RuntimeError("tracker server went away [500]")


def test_failing_sink_warns_once_is_dropped_and_others_keep_working(tmp_path):
    console, buffer = _console()
    good, bad = Recorder(), Exploding()
    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    logger = MetricsLogger([bad, good, jsonl], console)
    for step in (1, 2, 3):
        logger.log(_step(step, 1.0, 10))
    logger.close()
    warnings = [line for line in buffer.getvalue().splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "Exploding failed" in warnings[0] and "[500]" in warnings[0]  # printed verbatim, not as markup
    assert [r["step"] for r in good.records] == [1, 2, 3]
    assert bad.closed is False and good.closed is True
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    logger.close()  # a second close is harmless


def test_logger_closes_as_failed_when_training_raises():
    console, _ = _console()
    rec = Recorder()
    with pytest.raises(ValueError), MetricsLogger([rec], console):
        raise ValueError("training blew up")
    assert rec.closed is False


def _logging(**on: Any) -> LoggingConfig:
    return LoggingConfig(**{"every_steps": 1, "tensorboard": False, "wandb": False, "wandb_project": None,
                            "mlflow": False, **on})


def test_open_sinks_missing_packages_warn_with_install_line(tmp_path, monkeypatch):
    # sys.modules[name] = None makes `import name` raise ImportError: "not installed", wherever the test runs.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.entities", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    console, buffer = _console()
    logger = open_sinks(RunDir(tmp_path), _logging(wandb=True, mlflow=True), console, 3, 0)
    assert [type(s).__name__ for s in logger.sinks] == ["JsonlSink", "ConsoleSink"]
    text = buffer.getvalue()
    assert "logging.wandb needs the wandb package" in text and "logging.mlflow needs the mlflow package" in text
    assert text.count(INSTALL_HINT) == 2
    logger.close()


def test_open_sinks_tracker_that_cannot_start_is_left_out(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")

    def init(**kwargs: Any) -> None:
        raise RuntimeError("api_key not configured (no-tty)")

    fake.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    console, buffer = _console()
    logger = open_sinks(RunDir(tmp_path), _logging(wandb=True), console, 3, 0)
    assert len(logger.sinks) == 2
    assert "WANDB_MODE=offline" in " ".join(buffer.getvalue().split())
    logger.close()


def test_wandb_sink_gets_recipe_config_and_every_record(tmp_path, monkeypatch):
    """Through a stand-in `wandb` module: the glue (config, names, steps, finish) without the network."""
    calls: dict[str, Any] = {"log": []}

    class Run:
        def log(self, data: dict, step: int) -> None:
            calls["log"].append((step, data))

        def finish(self, exit_code: int = 0) -> None:
            calls["finish"] = exit_code

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.update(init=kw) or Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = {"train": {"lr": 0.001, "gradient_accumulation_steps": 4}}
    console, _ = _console()
    logger = open_sinks(RunDir(tmp_path), _logging(wandb=True, wandb_project="proj"), console, 2, 0, config=config)
    logger.log(_step(1, 2.0, 10))
    logger.log({"step": 1, "eval_loss": 1.5, "eval_tokens": 7})
    logger.close()
    assert calls["init"]["project"] == "proj" and calls["init"]["dir"] == str(tmp_path)
    assert calls["init"]["config"] == {"train": {"lr": 0.001, "gradient_accumulation_steps": 4}}
    assert calls["log"][0][0] == 1 and calls["log"][0][1]["train/loss"] == 2.0
    assert calls["log"][1] == (1, {"eval/loss": 1.5, "eval/tokens": 7.0})
    assert calls["finish"] == 0


def test_mlflow_sink_with_real_mlflow_logs_params_and_metrics_offline(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # optional dependency: checked where it is installed
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    from mlflow.tracking import MlflowClient

    config = {"train": {"lr": 0.001, "adam_betas": [0.9, 0.99]}}
    console, buffer = _console()
    logger = open_sinks(RunDir(tmp_path), _logging(mlflow=True), console, 2, 0, config=config)
    assert "MLflowSink" in [type(s).__name__ for s in logger.sinks], buffer.getvalue()
    sink = logger.sinks[-1]
    logger.log(_step(1, 2.0, 10))
    logger.log(_step(2, float("nan"), 10))
    logger.close()
    client = MlflowClient(tracking_uri=sink.uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.001" and run.data.params["train.adam_betas.1"] == "0.99"
    history = client.get_metric_history(sink.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2] and history[0].value == 2.0 and math.isnan(history[1].value)
    assert [a.path for a in client.list_artifacts(sink.run_id)] == ["recipe.yaml"]
    assert list(tmp_path.glob("mlartifacts/**/recipe.yaml")), "artifacts left the run directory"


# --- records, reading back, MFU --------------------------------------------------------------------------

def test_scalars_name_tags_per_kind():
    assert scalars({"step": 3, "total_steps": 9, "loss": 1.0, "skipped": False, "note": "x"}) == \
        {"train/loss": 1.0, "train/skipped": 0.0}
    assert scalars({"step": 3, "eval_loss": 2.0, "eval_tokens": 5}) == {"eval/loss": 2.0, "eval/tokens": 5.0}


def test_read_metrics_keeps_the_last_line_of_a_repeated_step_and_sums_elapsed(tmp_path):
    lines = [_step(1, 3.0, 10), _step(2, 2.9, 10), _step(3, 2.8, 10),  # first launch, checkpoint at step 2
             {**_step(3, 2.7, 10), "elapsed_s": 1.0}, {**_step(4, 2.6, 10), "elapsed_s": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 5, "lo')
    run = read_metrics(tmp_path)  # the cut-off last line (a crash mid-write) is ignored
    assert [(r["step"], r["loss"]) for r in run.train] == [(1, 3.0), (2, 2.9), (3, 2.7), (4, 2.6)]
    assert total_elapsed(run.lines) == pytest.approx(3.0 + 2.0)


def test_mfu_formula_and_device_table(monkeypatch):
    assert flops_per_token(n_params=1_000, n_layers=2, hidden=8, seq_len=16) == 6 * 1_000 + 12 * 2 * 8 * 16
    assert mfu(1e4, 10**9, 24, 2048, 2048, torch.device("cpu")) is None
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L4") == 121e12 and peak_flops("NVIDIA L40S") == 362e12
    assert peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert peak_flops("NVIDIA GeForce GTX 1080") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    got = mfu(1e4, 10**9, 24, 2048, 2048, torch.device("cuda", 0))
    assert got == pytest.approx(1e4 * (6e9 + 12 * 24 * 2048 * 2048) / 989e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert mfu(1e4, 10**9, 24, 2048, 2048, torch.device("cuda", 0)) is None


def test_console_sink_on_a_terminal_runs_a_progress_bar():
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=True, color_system=None)
    sink = ConsoleSink(console, total_steps=4, every=2, start_step=1)
    assert sink.progress is not None
    for step in (2, 3, 4):
        sink.write(_step(step, 2.0, 10))
    sink.close()
    text = buffer.getvalue()
    assert "step 4/4" in text and "tok/s" in text and "loss(avg 2) 2.0000" in text


def test_update_ratio_sample_is_bounded_and_exact_for_a_uniform_change():
    import torch

    from finetune.metrics import update_sums, weight_sample

    small, big = torch.randn(100), torch.randn(3000, 1000)
    assert weight_sample(small).numel() == 100  # all of a small tensor
    assert weight_sample(big).numel() <= 2 * 4096  # a bounded sample of a big one, not a copy
    before = [weight_sample(p).clone() for p in (small, big)]
    with torch.no_grad():
        small.mul_(1.01)
        big.mul_(1.01)
    delta, norm = update_sums(before, [small, big]).tolist()
    assert abs((delta / norm) ** 0.5 - 0.01) < 1e-6
    assert update_sums(before, before).tolist()[0] == 0.0


def test_non_finite_numbers_are_written_as_strict_json_and_read_back_as_floats(tmp_path):
    """Overflowing rewards or a NaN loss are data; metrics.jsonl writes them as the strings "NaN", "Infinity",
    "-Infinity" (strict JSON has no such numbers) and read_metrics gives the floats back."""
    from finetune.metrics.sinks import JsonlSink

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write({"step": 1, "loss": math.nan, "reward": math.inf, "reward_std": -math.inf, "tokens": 3})
    sink.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text == '{"step": 1, "loss": "NaN", "reward": "Infinity", "reward_std": "-Infinity", "tokens": 3}\n'
    json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in metrics.jsonl"))
    [line] = read_metrics(tmp_path).train
    assert math.isnan(line["loss"]) and line["reward"] == math.inf and line["reward_std"] == -math.inf
