"""`finetune plot` and `finetune runs compare` on run directories made here: real resolved recipes (the
quickstart with other accumulation settings) and metrics.jsonl written by the trainer's own JsonlSink, with
made-up but realistic curves. No training, so every case (NaN losses, eval-only runs, missing files) is cheap.
"""

from __future__ import annotations

import io
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import QUICKSTART, run_cli
from rich.console import Console

from finetune.commands.compare import compare_runs
from finetune.commands.plot import RL_PANELS, _series, build_figure, plot_runs
from finetune.errors import UserError
from finetune.metrics import INSTALL_HINT, JsonlSink
from finetune.recipe import load_recipe, to_yaml
from finetune.run.directory import read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, name: str, *, micro: int = 8, accum: int = 1, steps: int = 40, eval_every: int = 10,
             nan_steps: tuple[int, ...] = (), train: bool = True, samples: bool = True) -> Path:
    """A run directory: resolved recipe.yaml and a metrics.jsonl whose tokens per step follow the batch size."""
    out = root / name
    out.mkdir(parents=True)
    recipe = load_recipe(QUICKSTART, [f"output_dir={out}", f"train.micro_batch_size={micro}",
                                      f"train.gradient_accumulation_steps={accum}", f"train.max_steps={steps}"])
    (out / "recipe.yaml").write_text(to_yaml(recipe))
    sink = JsonlSink(out / "metrics.jsonl")
    rows = micro * accum
    seen = 0
    sink.write({"step": 0, "eval_loss": 7.0, "eval_tokens": 3576})
    for step in range(1, steps + 1):
        seen += 500 * rows
        if train:
            loss = math.nan if step in nan_steps else 1.5 + 5.5 * math.exp(-seen / 40_000)
            record = {"step": step, "total_steps": steps, "epoch": 0, "loss": loss, "grad_norm": 2.0 / step ** 0.5,
                      "lr": 3e-3 * min(1.0, step / 10), "tokens": 150 * rows, "seq_tokens": 500 * rows,
                      "padded_tokens": 512 * rows, "tokens_seen": seen, "tokens_per_s": 1000.0 + 10 * step,
                      "elapsed_s": 0.5 * rows * step}
            if samples:
                record["samples"] = 2 * rows * step
            sink.write(record)
        if step % eval_every == 0:
            sink.write({"step": step, "eval_loss": 1.4 + 5.0 * math.exp(-seen / 40_000), "eval_tokens": 3576})
    sink.close()
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """The same training data at 8 rows per step (8 x 1) and at 16 rows per step (4 x 4): half the steps."""
    return make_run(tmp_path, "accum1", micro=8, accum=1, steps=40), \
        make_run(tmp_path, "accum4", micro=4, accum=4, steps=20, nan_steps=(7,))


def test_plot_cli_writes_a_png_of_overlaid_runs(two_runs, tmp_path):
    out = tmp_path / "plots" / "curves.png"
    result = run_cli("plot", *map(str, two_runs), "--out", str(out), "--x", "tokens")
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    width, height = png_size(out)
    assert (width, height) == (1300, 850)
    assert out.stat().st_size > 30_000  # four panels of curves, not a blank canvas
    assert "accum4: 1 steps with a non-finite loss" in result.stderr


@pytest.mark.parametrize("x", ["steps", "samples"])
def test_plot_other_x_axes(two_runs, tmp_path, x):
    path = plot_runs([str(d) for d in two_runs], str(tmp_path / f"{x}.png"), x=x)
    assert png_size(path) == (1300, 850)


def test_tokens_axis_lines_up_different_accumulation_settings(two_runs):
    a, b = (read_metrics(d) for d in two_runs)
    by_tokens = _series(a, "a", "tokens"), _series(b, "b", "tokens")
    assert by_tokens[0]["train_x"][-1] == by_tokens[1]["train_x"][-1]  # same data seen at the end
    assert set(by_tokens[1]["eval_x"]) < set(by_tokens[0]["eval_x"])  # evals at equal tokens share an x
    by_steps = _series(a, "a", "steps"), _series(b, "b", "steps")
    assert by_steps[0]["train_x"][-1] == 2 * by_steps[1]["train_x"][-1]  # against steps they do not


def test_nan_losses_are_gaps_and_marked(two_runs):
    series = _series(read_metrics(two_runs[1]), "b", "tokens")
    assert len(series["bad_x"]) == 1 and math.isnan(series["loss"][6])


def test_plot_run_with_only_eval_lines(tmp_path, capsys):
    run = make_run(tmp_path, "evalonly", train=False, steps=20)
    assert png_size(plot_runs([str(run)], str(tmp_path / "e.png"), x="steps")) == (1300, 850)
    series = _series(read_metrics(run), "evalonly", "steps")
    assert series["eval_x"] == [0.0, 10.0, 20.0] and series["train_x"] == []
    plot_runs([str(run)], str(tmp_path / "t.png"), x="tokens")  # only the step-0 eval can be placed
    assert "2 eval points have no train line" in capsys.readouterr().err
    assert _series(read_metrics(run), "evalonly", "tokens")["eval_x"] == [0.0]


def make_grpo_run(root: Path, name: str = "grpo", steps: int = 6) -> Path:
    """A GRPO run's metrics.jsonl as the trainer writes it (its fields: rl/plan.py, rl/live.py, objectives/grpo.py),
    evals with the held-out greedy reward, two reward functions."""
    out = make_run(root, name, steps=steps, train=False, eval_every=10 ** 6)
    (out / "metrics.jsonl").unlink()
    sink = JsonlSink(out / "metrics.jsonl")
    sink.write({"step": 0, "eval_reward": 0.1, "eval_prompts": 8, "eval_completion_length": 12.0})
    for step in range(1, steps + 1):
        sink.write({"step": step, "total_steps": steps, "epoch": 0, "loss": 0.01 * step, "grad_norm": 0.5, "lr": 1e-5,
                    "tokens": 400, "seq_tokens": 900, "tokens_seen": 900 * step, "samples": 16 * step,
                    "tokens_per_s": 3000.0 + step, "reward": 0.1 * step, "reward_std": 0.3, "rewards/exact_answer":
                    0.05 * step, "rewards_std/exact_answer": 0.2, "rewards/length": -0.5 + 0.01 * step,
                    "rewards_std/length": 0.1, "zero_std_groups": 0.25, "kl": 0.001 * step, "entropy": 2.0 - 0.1 * step,
                    "clip_ratio": 0.0, "truncated": 0.125, "completion_length": 20.0 + step,
                    "completion_length_max": 32, "generation_s": 4.0, "generation_tokens_per_s": 80.0 + step,
                    "reward_s": 0.01, "rollout_s": 4.1, "elapsed_s": 5.0 * step})
        if step % 3 == 0:
            sink.write({"step": step, "eval_reward": 0.1 + 0.1 * step, "eval_prompts": 8,
                        "eval_completion_length": 12.0})
    sink.close()
    return out


def _panels(fig) -> dict[str, dict[str, Any]]:
    """Each visible panel's title -> its curves by legend label."""
    return {ax.get_title(): {line.get_label(): line for line in ax.get_lines()} for ax in fig.axes if ax.get_visible()}


def test_plot_grpo_run_draws_its_panels(tmp_path):
    """A GRPO run beside an SFT run: the four common panels (the GRPO run's generation tokens/s beside its
    training's) and GRPO's own (rewards in total with the eval points, per function; KL; entropy; zero-advantage,
    clipped and truncated fractions; completion length mean and max), each curve the run's logged values."""
    grpo, sft = make_grpo_run(tmp_path), make_run(tmp_path, "sft", steps=6, eval_every=3)
    fig = build_figure([str(grpo), str(sft)], x="steps")
    panels = _panels(fig)
    assert list(panels) == ["loss (token-weighted per step)", "learning rate", "gradient norm (before clipping)",
                            "throughput (tokens/s)", *(title for title, _ in RL_PANELS)]
    assert set(panels["throughput (tokens/s)"]) == {"grpo training", "grpo generation", "sft"}
    assert list(panels["throughput (tokens/s)"]["grpo generation"].get_ydata()) == [80.0 + s for s in range(1, 7)]
    expected = {
        "reward (mean per completion)": {"grpo train", "grpo eval (greedy)"},
        "reward per function (mean)": {"grpo exact_answer", "grpo length"},
        "KL to the reference (per token)": {"grpo"},
        "entropy of the policy (per token, nats)": {"grpo"},
        "fractions of the step": {"grpo groups with zero advantage", "grpo clipped tokens", "grpo truncated completions"},
        "completion length (tokens)": {"grpo mean", "grpo max"},
    }
    for title, labels in expected.items():
        assert set(panels[title]) == labels, title  # the SFT run draws nothing in GRPO's panels
    evals = panels["reward (mean per completion)"]["grpo eval (greedy)"]
    assert list(evals.get_xdata()) == [0.0, 3.0, 6.0] and list(evals.get_ydata()) == pytest.approx([0.1, 0.4, 0.7])
    per_function = panels["reward per function (mean)"]["grpo exact_answer"]
    assert list(per_function.get_ydata()) == pytest.approx([0.05 * s for s in range(1, 7)])
    assert per_function.get_linestyle() != panels["reward per function (mean)"]["grpo length"].get_linestyle()
    assert list(panels["entropy of the policy (per token, nats)"]["grpo"].get_ydata()) == \
        pytest.approx([2.0 - 0.1 * s for s in range(1, 7)])
    assert list(panels["completion length (tokens)"]["grpo max"].get_ydata()) == [32.0] * 6
    assert png_size(plot_runs([str(grpo)], str(tmp_path / "g.png"), x="tokens")) == (1300, 2050)


def test_plot_without_grpo_runs_has_four_panels(two_runs):
    assert len(_panels(build_figure([str(d) for d in two_runs], x="steps"))) == 4


def test_plot_samples_without_samples_field_explains(tmp_path):
    run = make_run(tmp_path, "old", samples=False, steps=5)
    with pytest.raises(UserError, match=r"no cumulative `samples` field.*--x tokens"):
        plot_runs([str(run)], str(tmp_path / "s.png"), x="samples")


def test_plot_missing_or_empty_metrics_names_the_file(tmp_path):
    (tmp_path / "nometrics").mkdir()
    with pytest.raises(UserError, match=r"nometrics/metrics\.jsonl not found"):
        plot_runs([str(tmp_path / "nometrics")], str(tmp_path / "x.png"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=r"empty/metrics\.jsonl has no metrics records"):
        plot_runs([str(tmp_path / "empty")], str(tmp_path / "x.png"))
    result = run_cli("plot", str(tmp_path / "empty"), "--out", str(tmp_path / "x.png"))
    assert result.returncode == 2 and "metrics.jsonl has no metrics records" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x.png").exists()


def test_plot_without_matplotlib_says_how_to_install(two_runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `import matplotlib.figure` now fails
    with pytest.raises(UserError, match=r"needs matplotlib") as info:
        plot_runs([str(two_runs[0])], str(tmp_path / "x.png"))
    assert INSTALL_HINT in str(info.value)


def _render(table: Any) -> str:
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.export_text()


def test_runs_compare_shows_differing_keys_and_metrics(two_runs):
    text = _render(compare_runs(str(two_runs[0]), str(two_runs[1])))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in text.splitlines() if line.count("│") >= 4}
    assert rows["train.gradient_accumulation_steps"] == ["1", "4"]
    assert rows["train.micro_batch_size"] == ["8", "4"]
    assert rows["train.max_steps"] == ["40", "20"]
    assert "train.lr" not in rows and "output_dir" not in rows  # identical / always different: left out
    assert rows["final train loss"][0].endswith("(step 40)") and rows["final train loss"][1].endswith("(step 20)")
    assert rows["best eval loss"][0].endswith("(step 40)") and rows["best eval loss"][1].endswith("(step 20)")
    assert rows["steps"] == ["40", "20"]
    assert rows["tokens seen"] == ["160,000", "160,000"]
    assert rows["mean tokens/s"][0] == f"{sum(4000 for _ in range(40)) / sum(4000 / (1000 + 10 * s) for s in range(1, 41)):,.0f}"
    assert rows["training time"] == ["0:02:40", "0:02:40"]


def test_runs_compare_cli(two_runs, tmp_path):
    result = run_cli("runs", "compare", *map(str, two_runs), env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    for needle in ("train.gradient_accumulation_steps", "final train loss", "best eval loss", "tokens seen"):
        assert needle in result.stdout
    (tmp_path / "not-a-run").mkdir()
    result = run_cli("runs", "compare", str(two_runs[0]), str(tmp_path / "not-a-run"))
    assert result.returncode == 2 and "not-a-run is not a run directory: it has no recipe.yaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_runs_compare_run_without_metrics_yet(two_runs):
    (two_runs[1] / "metrics.jsonl").unlink()
    text = _render(compare_runs(str(two_runs[0]), str(two_runs[1])))
    assert "no metrics logged" in text
