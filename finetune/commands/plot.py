"""`finetune plot RUN_DIR [RUN_DIR ...]`: training curves of one or more runs, overlaid, as one PNG.

Four panels: loss (train per step, solid; eval, dashed with markers), learning rate, gradient norm (before
clipping) and throughput (real input tokens per second). Every run keeps one color in every panel and is
named by its run directory in the legends. GRPO runs add the panels of RL_PANELS (rewards in total with the
held-out eval reward, and per function; KL; entropy; the zero-advantage, clipped and truncated fractions;
completion length) and their generation's tokens/s beside the training's.

The x axis is the number of real input tokens seen by default: runs that split the same data into different
micro-batch x accumulation factorizations, or that use different batch sizes altogether, then line up on the
same axes, which they do not when plotted against optimizer steps.

matplotlib is imported lazily, with the Agg backend (files only, no display), through `Figure` rather than
pyplot, so no global figure state is touched.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.metrics import INSTALL_HINT
from finetune.run.directory import RunMetrics, read_metrics, read_recipe_dict

X_AXES = {
    "steps": ("step", "optimizer step"),
    "tokens": ("tokens_seen", "tokens seen (real input tokens, cumulative)"),
    "samples": ("samples", "samples seen (cumulative)"),
}


def plot_runs(run_dirs: list[str], out: str, x: str = "tokens") -> Path:
    """Write the curves of `run_dirs` to `out` (PNG unless its suffix names another format); return its path."""
    fig = build_figure(run_dirs, x)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=None if path.suffix else "png")
    return path


def build_figure(run_dirs: list[str], x: str = "tokens") -> Any:
    """The figure `plot_runs` writes (a matplotlib Figure; each panel titled, each curve labelled)."""
    if x not in X_AXES:
        raise UserError(f"--x {x!r}: choose one of {', '.join(X_AXES)}")
    if not run_dirs:
        raise UserError("finetune plot needs at least one run directory")
    runs = [read_metrics(d) for d in run_dirs]  # UserError naming the file when one is missing or empty
    names = _names(run_dirs)
    series = [_series(run, name, x) for run, name in zip(runs, names)]
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter
        from matplotlib.transforms import blended_transform_factory
    except ImportError:
        raise UserError(f"finetune plot needs matplotlib: {INSTALL_HINT} (or pip install matplotlib)") from None

    rl = any(s["rl"] or any(not math.isnan(v) for v in s["eval_reward"]) for s in series)
    rows = 2 + (len(RL_PANELS) + 1) // 2 if rl else 2  # GRPO runs: its rows of panels below the four
    fig = Figure(figsize=(13, 4 * rows + 0.5), dpi=100, layout="constrained")
    axes = fig.subplots(rows, 2, sharex=True)
    (ax_loss, ax_lr), (ax_grad, ax_tps) = axes[0], axes[1]
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        # Short runs get point markers: a one-step run would otherwise draw nothing at all.
        style = {"color": color, "linewidth": 1.2, "marker": "." if len(s["train_x"]) <= 30 else None}
        if s["train_x"]:
            ax_loss.plot(s["train_x"], s["loss"], label=f"{s['name']} train", **style)
            ax_lr.plot(s["train_x"], s["lr"], label=s["name"], **style)
            ax_grad.plot(s["train_x"], s["grad_norm"], label=s["name"], **style)
            generated = "generation_tokens_per_s" in s["rl"]
            ax_tps.plot(s["train_x"], s["tokens_per_s"], label=f"{s['name']} training" if generated else s["name"],
                        **style)
            if generated:  # GRPO: the policy generating its rollouts, timed apart from the training
                ax_tps.plot(s["train_x"], s["rl"]["generation_tokens_per_s"], label=f"{s['name']} generation",
                            **(style | {"linestyle": "--"}))
        if any(not math.isnan(v) for v in s["eval_loss"]):  # GRPO's evals are rewards (its own panel)
            ax_loss.plot(s["eval_x"], s["eval_loss"], color=color, linestyle="--", marker="o", markersize=4,
                         linewidth=1.2, label=f"{s['name']} eval")
        if s["bad_x"]:
            # Non-finite losses leave gaps in the curve; mark where, along the bottom edge of the panel.
            edge = blended_transform_factory(ax_loss.transData, ax_loss.transAxes)
            ax_loss.plot(s["bad_x"], [0.02] * len(s["bad_x"]), linestyle="none", marker="x", color=color,
                         markersize=7, transform=edge, label=f"{s['name']} non-finite loss")
    clip = _common_clip(run_dirs)
    if clip:
        ax_grad.axhline(clip, color="gray", linestyle=":", linewidth=1, label=f"clipped at {clip:g}")
    _log_scale_if_wide(ax_grad, [v for s in series for v in s["grad_norm"]])
    titled = [(ax_loss, "loss (token-weighted per step)"), (ax_lr, "learning rate"),
              (ax_grad, "gradient norm (before clipping)"), (ax_tps, "throughput (tokens/s)")]
    if rl:
        titled += _plot_rl([ax for row in axes[2:] for ax in row], series)

    x_label = X_AXES[x][1]
    for ax, title in titled:
        ax.set_title(title, fontsize=11)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel(x_label)
    if x != "steps":
        for ax in axes[-1]:
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 160k, 2.5M: token counts get long
    fig.suptitle(f"finetune runs vs {x_label}", fontsize=12)
    return fig


# GRPO's panels: title -> the train-line fields drawn in it, each (field, what its legend says, line style).
# "rewards/*" stands for every reward function's mean (rewards/NAME); the reward panel adds the eval points.
RL_PANELS: list[tuple[str, list[tuple[str, str, str]]]] = [
    ("reward (mean per completion)", [("reward", "train", "-")]),
    ("reward per function (mean)", [("rewards/*", "", "-")]),
    ("KL to the reference (per token)", [("kl", "", "-")]),
    ("entropy of the policy (per token, nats)", [("entropy", "", "-")]),
    ("fractions of the step", [("zero_std_groups", "groups with zero advantage", "-"),
                               ("clip_ratio", "clipped tokens", "--"), ("truncated", "truncated completions", ":")]),
    ("completion length (tokens)", [("completion_length", "mean", "-"), ("completion_length_max", "max", "--")]),
]


LINE_STYLES = ("-", "--", ":", "-.")


def _plot_rl(axes: list[Any], series: list[dict[str, Any]]) -> list[tuple[Any, str]]:
    """GRPO's panels (RL_PANELS), each run in its color, each field in its line style; the held-out greedy eval
    reward as points in the reward panel. Returns the panels with their titles (a spare one is hidden)."""
    for ax in axes[len(RL_PANELS):]:
        ax.set_visible(False)
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        marker = "." if len(s["train_x"]) <= 30 else None
        for ax, (_, fields) in zip(axes, RL_PANELS):
            for key, what, linestyle in fields:
                if key == "rewards/*":  # one line style per reward function (the color is the run's)
                    names = sorted(k for k in s["rl"] if k.startswith("rewards/"))
                    drawn = [(k, k.removeprefix("rewards/"), LINE_STYLES[j % 4]) for j, k in enumerate(names)]
                else:
                    drawn = [(key, what, linestyle)] if key in s["rl"] else []
                for k, label, style in drawn:
                    ax.plot(s["train_x"], s["rl"][k], color=color, linestyle=style, linewidth=1.2, marker=marker,
                            label=" ".join(x for x in (s["name"], label) if x))
        points = [(x, r) for x, r in zip(s["eval_x"], s["eval_reward"]) if not math.isnan(r)]
        if points:
            axes[0].plot(*zip(*points), color=color, linestyle="--", marker="o", markersize=4,
                         label=f"{s['name']} eval (greedy)")
    return [(ax, title) for ax, (title, _) in zip(axes, RL_PANELS)]


def _names(run_dirs: list[str]) -> list[str]:
    """Legend names: each run directory's own name, or the path as given when two names collide."""
    short = [Path(d).resolve().name or str(d) for d in run_dirs]
    return [s if short.count(s) == 1 else str(d) for s, d in zip(short, run_dirs)]


def _series(run: RunMetrics, name: str, x: str) -> dict[str, Any]:
    """The points one run contributes: train curves, eval points and non-finite steps, all against x."""
    steps = [int(r["step"]) for r in run.train]
    train_x = _x_values(run, name, x)
    at = dict(zip(steps, train_x))
    at.setdefault(0, 0.0)  # an eval before the first step sits at the origin of every axis
    if x == "steps":
        at.update({int(e["step"]): float(e["step"]) for e in run.evals})
    placed = [e for e in run.evals if int(e["step"]) in at]
    if len(placed) < len(run.evals):
        _note(f"{name}: {len(run.evals) - len(placed)} eval points have no train line to give them a "
              f"{X_AXES[x][0]} position (only eval lines logged); plot with --x steps to see them")
    loss = [_finite(r.get("loss")) for r in run.train]
    bad_x = [xv for xv, v in zip(train_x, loss) if math.isnan(v)]
    if bad_x:
        _note(f"{name}: {len(bad_x)} steps with a non-finite loss (gaps in the curve, marked with x)")
    return {
        "name": name,
        "train_x": train_x,
        "loss": loss,
        "lr": [_finite(r.get("lr")) for r in run.train],
        "grad_norm": [_finite(r.get("grad_norm")) for r in run.train],
        "tokens_per_s": [_finite(r.get("tokens_per_s")) for r in run.train],
        "eval_x": [at[int(e["step"])] for e in placed],
        "eval_loss": [_finite(e.get("eval_loss")) for e in placed],
        "eval_reward": [_finite(e.get("eval_reward")) for e in placed],
        "rl": {k: [_finite(r.get(k)) for r in run.train] for k in _rl_fields(run.train)},
        "bad_x": bad_x,
    }


RL_FIELDS = ("reward", "kl", "entropy", "zero_std_groups", "clip_ratio", "truncated", "completion_length",
             "completion_length_max", "generation_tokens_per_s")


def _rl_fields(train: list[dict[str, Any]]) -> list[str]:
    """The GRPO fields the run's train lines hold (none for other objectives), each reward function's included."""
    present = dict.fromkeys(k for r in train for k in r)
    return [k for k in (*RL_FIELDS, *(k for k in present if k.startswith("rewards/"))) if k in present]


def _x_values(run: RunMetrics, name: str, x: str) -> list[float]:
    if x == "steps":
        return [float(r["step"]) for r in run.train]
    if x == "samples":
        if any("samples" not in r for r in run.train):
            raise UserError(f"{run.path} has no cumulative `samples` field in its train lines (this trainer "
                            "version does not count samples), so it cannot be plotted against samples. Use "
                            "--x tokens (real input tokens seen: comparable across batch and accumulation "
                            "settings) or --x steps.")
        return [float(r["samples"]) for r in run.train]
    seen = [r.get("tokens_seen") for r in run.train]
    if all(isinstance(v, (int, float)) for v in seen) and all(a <= b for a, b in zip(seen, seen[1:])):
        return [float(v) for v in seen]
    # Older lines without tokens_seen, or a resume that restarted the count: rebuild it from the per-step
    # real token counts (one line per step, in step order, so the running sum is the tokens seen).
    _note(f"{name}: tokens_seen missing or not increasing; using the running sum of seq_tokens instead")
    total, out = 0.0, []
    for r in run.train:
        total += float(r.get("seq_tokens") or 0)
        out.append(total)
    return out


def _finite(value: Any) -> float:
    """A plottable float: NaN for absent, non-numeric or infinite values (matplotlib leaves a gap)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return float("nan")
    return float(value)


def _common_clip(run_dirs: list[str]) -> float | None:
    """train.max_grad_norm when every run has the same one (a reference line for the grad norm panel)."""
    values = set()
    for d in run_dirs:
        try:
            values.add(read_recipe_dict(d)["train"]["max_grad_norm"])
        except (UserError, KeyError, TypeError):
            return None
    value = values.pop() if len(values) == 1 else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _log_scale_if_wide(ax: Any, values: list[float]) -> None:
    """Gradient norms often span orders of magnitude early in training: a log axis keeps the tail readable."""
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len([v for v in values if not math.isnan(v)]) and \
            max(positive) / min(positive) > 50:
        ax.set_yscale("log")


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)
