"""`finetune runs compare DIR_A DIR_B` (comparing runs): what differs between two runs and how each one ended.

One rich table: the resolved recipes' differing keys (dotted, `datasets.0.path`; identical keys and
output_dir are left out), the library versions that differ, what each run ran (versions.json's run record: the
loss, the attention, the packed-attention kernel and why; shown whether or not they differ, since two runs of one
recipe may run different kernels on different machines), then each run's summary from its metrics.jsonl:
final train loss, best and final eval loss with their steps, steps, tokens seen, mean throughput, elapsed time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from rich.markup import escape
from rich.table import Table

from finetune.recipe import flatten
from finetune.run.directory import (
    RunDir,
    RunMetrics,
    read_metrics,
    read_recipe_dict,
    read_versions,
    total_elapsed,
)

ABSENT = "[dim](absent)[/dim]"
# Keys every pair of runs differs in by construction; the table's column headers already name the runs.
IGNORED_KEYS = ("output_dir",)
IGNORED_VERSION_KEYS = ("executable", "unpinned_warnings")
# versions.json's run record (finetune/train/setup.py), shown in its own section: key -> row label.
RAN = {"loss": "loss", "attention": "attention", "packed_kernel": "packed kernel",
       "packed_kernel_why": "packed kernel: why"}


def compare_runs(run_a: str, run_b: str) -> Table:
    """The comparison table of two run directories. UserError when either is not a run."""
    recipe_a, recipe_b = read_recipe_dict(run_a), read_recipe_dict(run_b)
    name_a, name_b = _names(run_a, run_b)
    table = Table(title=escape(f"runs compare: {name_a} vs {name_b}"), title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    table.add_column(escape(name_a), overflow="fold")
    table.add_column(escape(name_b), overflow="fold")

    diffs = recipe_differences(recipe_a, recipe_b)
    table.add_row("[cyan]recipe[/cyan]", f"[cyan]{len(diffs)} differing keys[/cyan]", "")
    for key, a, b in diffs:
        table.add_row(key, a, b)
    if not diffs:
        table.add_row("", "(identical recipes)", "")
    version_diffs = _version_differences(run_a, run_b)
    if version_diffs:
        table.add_section()
        table.add_row("[cyan]versions[/cyan]", "", "")
        for key, a, b in version_diffs:
            table.add_row(key, a, b)
    ran = _ran(run_a, run_b)
    if ran:
        table.add_section()
        table.add_row("[cyan]what ran[/cyan]", "", "")
        for label, a, b in ran:
            table.add_row(label, a, b)
    table.add_section()
    table.add_row("[cyan]metrics[/cyan]", "", "")
    sum_a, sum_b = summarize(_metrics(run_a)), summarize(_metrics(run_b))
    for label in dict.fromkeys([*sum_a, *sum_b]):
        a, b = sum_a.get(label), sum_b.get(label)
        table.add_row(label, *_mark_better(label, a, b))
    return table


def recipe_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(dotted key, value in a, value in b) for every key whose values differ, in recipe order."""
    flat_a, flat_b = flatten(a), flatten(b)
    keys = [k for k in dict.fromkeys([*flat_a, *flat_b]) if k not in IGNORED_KEYS]
    return [(k, _show(flat_a, k), _show(flat_b, k)) for k in keys
            if k not in flat_a or k not in flat_b or flat_a[k] != flat_b[k]]


def summarize(metrics: RunMetrics | None) -> dict[str, tuple[str, float] | None]:
    """The table's metric rows: label -> (text, value to compare, NaN when not comparable) or None if absent."""
    if metrics is None:
        return {"final train loss": ("no metrics logged", math.nan)}
    train, evals = metrics.train, metrics.evals
    rows: dict[str, tuple[str, float] | None] = {}
    if train:
        last = train[-1]
        rows["final train loss"] = (f"{_fmt(last.get('loss'))} (step {last['step']})", _val(last.get("loss")))
    finite_evals = [e for e in evals if math.isfinite(_val(e.get("eval_loss")))]
    if finite_evals:
        best = min(finite_evals, key=lambda e: e["eval_loss"])
        rows["best eval loss"] = (f"{_fmt(best['eval_loss'])} (step {best['step']})", best["eval_loss"])
    if evals:
        last_eval = evals[-1]
        rows["final eval loss"] = (f"{_fmt(last_eval.get('eval_loss'))} (step {last_eval['step']})",
                                   _val(last_eval.get("eval_loss")))
    if train:
        last = train[-1]
        total = last.get("total_steps")
        text = f"{last['step']}" if total in (None, last["step"]) else f"{last['step']} of {total} (unfinished)"
        rows["steps"] = (text, math.nan)
        if isinstance(last.get("tokens_seen"), (int, float)):
            rows["tokens seen"] = (f"{int(last['tokens_seen']):,}", math.nan)
        if isinstance(last.get("samples"), (int, float)):
            rows["samples seen"] = (f"{int(last['samples']):,}", math.nan)
        rate = mean_tokens_per_s(train)
        rows["mean tokens/s"] = (f"{rate:,.0f}" if math.isfinite(rate) else "-", math.nan)
        mfus = [r["mfu"] for r in train if isinstance(r.get("mfu"), (int, float))]
        if mfus:
            rows["mean MFU"] = (f"{100 * sum(mfus) / len(mfus):.1f}%", math.nan)
        rows["training time"] = (_duration(total_elapsed(metrics.lines)), math.nan)
    return rows


def mean_tokens_per_s(train: list[dict[str, Any]]) -> float:
    """Real input tokens over training seconds, both summed over the steps (the seconds of a step being
    seq_tokens / tokens_per_s): a slow step weighs by its duration, unlike a mean of the per-step rates."""
    tokens = seconds = 0.0
    for r in train:
        n, rate = _val(r.get("seq_tokens")), _val(r.get("tokens_per_s"))
        if math.isfinite(n) and math.isfinite(rate) and rate > 0:
            tokens, seconds = tokens + n, seconds + n / rate
    return tokens / seconds if seconds else math.nan


def _metrics(run_dir: str) -> RunMetrics | None:
    """The run's metrics, or None when it has logged nothing yet (a run that stopped before its first step)."""
    file = RunDir(Path(run_dir)).metrics
    if not file.is_file() or not file.read_text(encoding="utf-8").strip():
        return None
    return read_metrics(run_dir)


def _version_differences(run_a: str, run_b: str) -> list[tuple[str, str, str]]:
    """Differing entries of the two versions.json files (library versions, device), when both have one."""
    versions_a, versions_b = read_versions(run_a), read_versions(run_b)
    if versions_a is None or versions_b is None:
        return []
    a, b = flatten(versions_a), flatten(versions_b)
    keys = [k for k in dict.fromkeys([*a, *b]) if k not in IGNORED_VERSION_KEYS and not k.startswith("run.")]
    return [(k, _show(a, k), _show(b, k)) for k in keys if a.get(k, ...) != b.get(k, ...)]


def _ran(run_a: str, run_b: str) -> list[tuple[str, str, str]]:
    """(label, run a's, run b's) of each run-record entry either run has: what computed its steps."""
    records = [(read_versions(run) or {}).get("run") for run in (run_a, run_b)]
    a, b = (r if isinstance(r, dict) else {} for r in records)
    rows = [(label, _cell(a, key), _cell(b, key)) for key, label in RAN.items()
            if a.get(key) is not None or b.get(key) is not None]
    return rows + _code_rows(a.get("code"), b.get("code"))


def _code_rows(a: Any, b: Any) -> list[tuple[str, str, str]]:
    """One row per code reference either run imported (recipe key: module:function and its file's sha256), the
    differing ones marked: an edited reward module changes the training without changing the recipe."""
    a, b = (r if isinstance(r, dict) else {} for r in (a, b))
    rows = []
    for key in dict.fromkeys([*a, *b]):
        cells = [_code_cell(r.get(key)) for r in (a, b)]
        mark = " [yellow](differs)[/yellow]" if cells[0] != cells[1] else ""
        rows.append((f"code {key}{mark}", *cells))
    return rows


def _code_cell(entry: Any) -> str:
    if not isinstance(entry, dict):
        return ABSENT
    digest = entry.get("sha256")
    return escape(f"{entry.get('ref')} ({entry.get('file')}, sha256 {digest[:12] if digest else '-'})")


def _cell(record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    return "-" if value is None else escape(str(value))


def _names(run_a: str, run_b: str) -> tuple[str, str]:
    a, b = Path(run_a).resolve().name, Path(run_b).resolve().name
    return (a, b) if a != b else (str(run_a), str(run_b))


def _show(flat: dict[str, Any], key: str) -> str:
    if key not in flat:
        return ABSENT
    value = flat[key]
    # Values are data, not markup: a chat template's "[INST]" must print as written.
    if isinstance(value, str):
        return escape(value)
    return escape(yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip())


def _mark_better(label: str, a: tuple[str, float] | None, b: tuple[str, float] | None) -> tuple[str, str]:
    """The two cells of a metric row; for losses, the lower one in bold green."""
    text_a, text_b = (a[0] if a else "-"), (b[0] if b else "-")
    if a and b and "loss" in label and math.isfinite(a[1]) and math.isfinite(b[1]) and a[1] != b[1]:
        if a[1] < b[1]:
            text_a = f"[bold green]{text_a}[/bold green]"
        else:
            text_b = f"[bold green]{text_b}[/bold green]"
    return text_a, text_b


def _val(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _fmt(value: Any) -> str:
    v = _val(value)
    return f"{v:.4f}" if math.isfinite(v) else str(value)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds <= 0:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
