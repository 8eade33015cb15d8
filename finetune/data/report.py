"""`finetune preprocess`: what the data became. Dataset statistics, a histogram of sample lengths, the packing
of epoch 0 against padding, a token accounting that must balance, and samples with their trained tokens marked.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from finetune.data.batching import epoch_order, steps_in
from finetune.data.cache import Prepared, prepare
from finetune.data.pack import PackStats, checked_lengths, pack_samples, plan_packing, plan_stats
from finetune.data.stats import DataStats
from finetune.data.store import pair_flags
from finetune.labels import IGNORE_INDEX
from finetune.recipe import Recipe


def preprocess(recipe: Recipe, tokenizer: Any, *, show: int = 0, rebuild: bool = False,
               console: Any = None) -> Prepared:
    """Tokenize (or reuse the cache), then print the dataset statistics, the packing of epoch 0 and, with
    `show`, that many training samples with trained and masked tokens told apart."""
    from rich.console import Console

    console = console or Console(soft_wrap=True)
    prepared = prepare(recipe, tokenizer, rebuild=rebuild)
    console.print(prepared.note, markup=False, highlight=False)
    if recipe.data.streaming:  # nothing of the training data to count or cache: it is read as training goes
        _print_streamed(console, recipe, tokenizer, prepared, show)
        return prepared
    _print_stats(console, prepared)
    _print_histogram(console, checked_lengths(prepared.train), recipe.data.max_seq_len)
    _print_packing(console, recipe, prepared)
    for i, sample in enumerate(prepared.train[: max(0, show)]):
        console.print()
        print_sample(console, tokenizer, sample, f"sample {i}")
    return prepared


def _print_streamed(console: Any, recipe: Recipe, tokenizer: Any, prepared: Prepared, show: int) -> None:
    """A streamed recipe: the eval data's figures, and with `show` the first samples of the stream (read now)."""
    from finetune.data.stream import head_samples  # the stream's reader: only for a streamed recipe

    s = prepared.eval_stats
    console.print(f"eval: {s.rows_read:,} rows read, {s.samples:,} samples, {s.tokens:,} tokens, "
                  f"{s.target_tokens:,} target tokens", markup=False, highlight=False)
    for i, sample in enumerate(head_samples(recipe, tokenizer, show) if show > 0 else []):
        console.print()
        print_sample(console, tokenizer, sample, f"streamed sample {i}")


def _print_stats(console: Any, p: Prepared) -> None:
    from rich.table import Table

    table = Table(title="data", title_justify="left")
    table.add_column("")
    table.add_column("train", justify="right")
    table.add_column("eval", justify="right")
    rows = [("rows read", "rows_read"), ("bad rows skipped", "bad_rows_skipped"),
            ("duplicates dropped", "duplicates_dropped"), ("samples", "samples"),
            ("tokens", "tokens"), ("target tokens", "target_tokens"), ("truncated samples", "truncated"),
            ("truncated tokens", "truncated_tokens"), ("dropped samples", "dropped_too_long"),
            ("dropped tokens", "dropped_tokens")]
    for label, name in rows:
        table.add_row(label, f"{getattr(p.train_stats, name):,}", f"{getattr(p.eval_stats, name):,}")
    console.print(table)
    for example in p.train_stats.bad_row_examples + p.eval_stats.bad_row_examples:
        console.print(f"  bad row: {example}", markup=False, highlight=False)
    for example in p.train_stats.duplicate_examples + p.eval_stats.duplicate_examples:
        console.print(f"  duplicate: {example}", markup=False, highlight=False)
    for example in p.train_stats.dropped_examples + p.eval_stats.dropped_examples:
        console.print(f"  dropped: {example}", markup=False, highlight=False)
    for line in template_notes(p.train_stats) + template_notes(p.eval_stats, "eval: "):
        console.print(f"  note: {line}", markup=False, highlight=False)


def template_notes(stats: DataStats, prefix: str = "") -> list[str]:
    """One line per thing the chat template did that a user should know of (none when nothing happened)."""
    lines = []
    if stats.turns_text_changed:
        lines.append(f"{prefix}{stats.turns_text_changed:,} trained turns are rendered with text of theirs left out "
                     "or changed by the chat template (e.g. reasoning it drops from earlier turns); only what is "
                     "rendered is trained (docs/chat-templates.md)")
    if stats.turns_not_rendered:
        lines.append(f"{prefix}{stats.turns_not_rendered:,} trained messages are not rendered by the chat template "
                     "at all (e.g. Mistral Nemo drops the system prompt unless a user message comes last)")
    if stats.rows_with_special_token_text:
        lines.append(f"{prefix}{stats.rows_with_special_token_text:,} rows have message text that spells a special "
                     "token (e.g. <|im_end|>): it is tokenized as that token, as at inference")
    return lines


def _nice_step(span: int, bins: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that cuts `span` into at most `bins` bins."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if span <= factor * step * bins:
                return factor * step
        step *= 10


def histogram_lines(lengths: Sequence[int] | np.ndarray, *, bins: int = 16, width: int = 40,
                    bar: str = "#") -> list[str]:
    """A text histogram of sample lengths: one line per bin of equal width, bars scaled to the fullest bin."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        return []
    step = _nice_step(int(lengths.max()) + 1, bins)
    counts = np.bincount(lengths // step).tolist()
    top = max(counts)
    digits = len(str(len(counts) * step))
    lines = []
    for k, count in enumerate(counts):
        filled = round(width * count / top) if count else 0
        filled = max(filled, 1 if count else 0)  # a nonempty bin is never invisible
        lines.append(f"{k * step:>{digits}}-{(k + 1) * step - 1:<{digits}} {count:>8,} "
                     f"{100 * count / len(lengths):5.1f}% {bar * filled}")
    return lines


def _print_histogram(console: Any, lengths: np.ndarray, max_seq_len: int | None) -> None:
    if not len(lengths):
        return
    ordered = np.sort(lengths)
    pick = lambda q: int(ordered[min(len(ordered) - 1, int(q * len(ordered)))])  # noqa: E731
    cap = f" (max_seq_len {max_seq_len})" if max_seq_len else ""
    console.print(f"\ntraining sample lengths in tokens{cap}: min {int(ordered[0])}, median "
                  f"{float(np.median(ordered)):g}, p90 {pick(0.9)}, p99 {pick(0.99)}, max {int(ordered[-1])}",
                  markup=False, highlight=False)
    bar = "█" if (console.encoding or "").lower().startswith("utf") else "#"
    for line in histogram_lines(ordered, bar=bar):
        console.print("  " + line, markup=False, highlight=False)


def padded_tokens_of_epoch(samples: Sequence[dict], recipe: Recipe, epoch: int = 0) -> tuple[int, int]:
    """(rows, tokens computed) of one epoch with packing off: each micro-batch pads to its longest sample,
    exactly as the trainer batches it (world size 1; rank_micro_batches), from the samples' lengths alone (in
    numpy: a loop over 10M rows in Python took seconds)."""
    data = recipe.data
    lengths = checked_lengths(samples)
    rows = lengths[epoch_order(len(lengths), data, recipe.seed, epoch)]
    if not len(rows):
        return 0, 0
    micro = recipe.train.micro_batch_size
    batch = micro * recipe.train.gradient_accumulation_steps
    if data.group_by_length:  # longest first within each optimizer step
        whole = len(rows) // batch * batch
        rows = np.concatenate([-np.sort(-rows[:whole].reshape(-1, batch), axis=1).reshape(-1),
                               -np.sort(-rows[whole:])])
    # A step holds whole micro-batches (batch is a multiple of micro), so they start every `micro` rows.
    starts = np.arange(0, len(rows), micro)
    widths = np.maximum.reduceat(rows, starts)
    sizes = np.diff(np.append(starts, len(rows)))
    multiple = data.pad_to_multiple_of or 1
    return len(rows), int(((-(-widths // multiple)) * multiple * sizes).sum())


def pack_epoch0(samples: Sequence[dict], recipe: Recipe) -> tuple[list[dict], PackStats]:
    """The packed rows of epoch 0, as the trainer builds them."""
    data = recipe.data
    return pack_samples(samples, data.max_seq_len or 0, seed=recipe.seed, epoch=0, truncation=data.truncation)


def pack_stats_epoch0(samples: Sequence[dict], recipe: Recipe) -> PackStats:
    """What packing epoch 0 does, from the samples' lengths and labels: no row is built."""
    data = recipe.data
    plan = plan_packing(checked_lengths(samples), pair_flags(samples), data.max_seq_len or 0, seed=recipe.seed,
                        epoch=0, truncation=data.truncation)
    return plan_stats(samples, plan)


def token_accounting(stats: DataStats, pack: PackStats | None) -> tuple[int, int, int, int]:
    """(tokens in, tokens that reach training, truncated tokens, dropped tokens), tokenizer to packed rows.

    `tokens in` counts every tokenized sample before truncation. The identity in = kept + truncated + dropped
    always holds; `finetune preprocess` prints it so that nothing can vanish unseen.
    """
    kept = pack.tokens if pack else stats.tokens
    truncated = stats.truncated_tokens + (pack.truncated_tokens if pack else 0)
    dropped = stats.dropped_tokens + (pack.dropped_tokens if pack else 0)
    return stats.input_tokens, kept, truncated, dropped


def _print_packing(console: Any, recipe: Recipe, p: Prepared) -> None:
    from rich.table import Table

    t = recipe.train
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps
    width = recipe.data.max_seq_len
    table = Table(title=f"epoch 0, world size 1: {global_batch} rows per optimizer step (micro-batch "
                        f"{t.micro_batch_size} x accumulation {t.gradient_accumulation_steps})", title_justify="left")
    # slots: row capacity when packed (rows x max_seq_len), tokens computed with padding when padded.
    for name in ("mode", "rows", "steps", "real tokens", "slots", "efficiency"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    pack = None
    packing = recipe.data.packing
    if width:  # packing needs a row length; without max_seq_len only the padded mode exists
        pack = pack_stats_epoch0(p.train, recipe)
        steps = steps_in(pack.rows, global_batch, recipe.data.drop_last)
        table.add_row(f"packed ({width})" + (" *" if packing else ""), f"{pack.rows:,}", f"{steps:,}",
                      f"{pack.tokens:,}", f"{pack.capacity:,}", f"{pack.efficiency:.3f}")
    n_rows, computed = padded_tokens_of_epoch(p.train, recipe)
    real = p.train_stats.tokens
    table.add_row("padded" + ("" if packing else " *"), f"{n_rows:,}",
                  f"{steps_in(n_rows, global_batch, recipe.data.drop_last):,}", f"{real:,}", f"{computed:,}",
                  f"{real / computed if computed else 0:.3f}")
    console.print()
    console.print(table)
    console.print("* this recipe's mode (data.packing). efficiency: real tokens / slots (packed: rows x "
                  "max_seq_len; padded: tokens computed with padding)", markup=False, highlight=False)
    if not packing and recipe.data.padding_free is not False and recipe.train.objective == "sft":
        console.print("data.padding_free: where the model keeps documents apart (decided when training starts), each "
                      "micro-batch's samples are laid end to end and its padding is not computed", markup=False,
                      highlight=False)
    tokens_in, kept, truncated, dropped = token_accounting(p.train_stats, pack if packing else None)
    verdict = "balanced" if tokens_in == kept + truncated + dropped else "MISMATCH (a bug: please report it)"
    where = "packed" if packing and pack else "kept"
    console.print(f"token accounting (train): {tokens_in:,} tokenized = {kept:,} {where} + {truncated:,} truncated "
                  f"+ {dropped:,} dropped: {verdict}", markup=False, highlight=False)
    if t.max_steps:
        console.print(f"train.max_steps: {t.max_steps} caps the run", markup=False, highlight=False)


def print_sample(console: Any, tokenizer: Any, sample: dict, title: str) -> None:
    """One sample, decoded, with trained tokens told apart from masked ones, and each image's tokens shown as one
    mark (its file, its size, its number of tokens; never trained).

    On a terminal trained tokens are bold green, masked ones dim and images magenta; otherwise (a pipe, a file)
    trained text is wrapped in [[...]] and an image is <<image ...>>. Tokens are decoded in runs of equal masking
    rather than one by one, so a character that byte-level BPE splits over several tokens still prints whole.
    """
    from rich.text import Text

    ids, labels = sample["input_ids"], sample["labels"]
    trained_count = sum(1 for x in labels if x != IGNORE_INDEX)
    items = sorted((sample.get("images") or {}).get("items", []), key=lambda item: item["start"])
    console.print(f"--- {title}: {len(ids)} tokens, {trained_count} trained"
                  f"{f', {len(items)} images' if items else ''} ---", markup=False, highlight=False)
    color = console.is_terminal and not console.no_color
    text, at = Text(), 0
    for item in [*items, None]:
        end = item["start"] if item is not None else len(ids)
        for trained, run in itertools.groupby(zip(ids[at:end], labels[at:end]),
                                              key=lambda pair: pair[1] != IGNORE_INDEX):
            piece = tokenizer.decode([token for token, _ in run], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
            if color:
                text.append(piece, style="bold green" if trained else "dim")
            else:
                text.append(f"[[{piece}]]" if trained else piece)
        if item is not None:
            mark = (f"image {Path(item['path']).name} {item['size'][1]}x{item['size'][0]}: {item['length']} tokens, "
                    f"{item['features']} features")
            if color:
                text.append(mark, style="magenta")
            else:
                text.append(f"<<{mark}>>")
            at = item["start"] + item["length"]
    console.print(text)
    if color:
        console.print(Text.assemble(("legend: ", ""), ("trained", "bold green"), (" / ", ""), ("masked", "dim"),
                                    *((" / ", ""), ("image (never trained)", "magenta")) if items else ()))
