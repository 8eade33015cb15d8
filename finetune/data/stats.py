"""DataStats: what happened to the data on its way from rows to samples, so that nothing vanishes uncounted."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from finetune.data.sources import BadRow

EXAMPLES = 5  # bad rows and dropped samples named per split: enough to find the pattern, not a flood

@dataclass
class DataStats:
    """What happened to the data on its way to samples: nothing is dropped without being counted here."""

    rows_read: int = 0
    bad_rows_skipped: int = 0
    samples: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    tokens: int = 0
    target_tokens: int = 0
    bad_row_examples: list[str] = field(default_factory=list)
    dropped_examples: list[str] = field(default_factory=list)
    """The first samples dropped as too long, each `file:line: why`, as bad rows are named."""
    duplicates_dropped: int = 0
    """Rows dropped as the same example as an earlier row (data.deduplicate: exact)."""
    duplicate_examples: list[str] = field(default_factory=list)
    """The first of them, by file:line."""

    def bad_row(self, error: BadRow, on_bad_row: str) -> None:
        """Stop on a bad row (`data.on_bad_row: error`) or count it and keep a few examples (`skip`)."""
        # Printable whatever the row held: a lone surrogate quoted from a row would make printing the message fail.
        why = str(error).encode("utf-8", "backslashreplace").decode("utf-8")
        if on_bad_row == "error":
            raise BadRow(f"{why}\n  Fix the row, or set data.on_bad_row: skip to skip bad rows "
                         "(they are counted).") from None
        self.bad_rows_skipped += 1
        if len(self.bad_row_examples) < EXAMPLES:
            self.bad_row_examples.append(why)

    def duplicate(self, origin: str) -> None:
        """Count a row dropped as a duplicate (data.deduplicate: exact) and name the first few."""
        self.duplicates_dropped += 1
        if len(self.duplicate_examples) < EXAMPLES:
            self.duplicate_examples.append(origin.encode("utf-8", "backslashreplace").decode("utf-8"))

    def drop(self, origin: str, tokens: int, why: str) -> None:
        """Count a sample dropped as too long (its `tokens` lost) and name the first few by their row's origin."""
        self.dropped_too_long += 1
        self.dropped_tokens += tokens
        if len(self.dropped_examples) < EXAMPLES:
            text = f"{origin}: {why}".encode("utf-8", "backslashreplace").decode("utf-8")
            self.dropped_examples.append(text)
    # Token accounting, so that `finetune preprocess` can show nothing vanished:
    # input_tokens == tokens + truncated_tokens + dropped_tokens.
    input_tokens: int = 0  # tokens of every tokenized sample, before truncation
    truncated_tokens: int = 0  # cut off the end of truncated samples
    dropped_tokens: int = 0  # in samples dropped as too long (truncation: drop)
    # What chat templates did (tokenize.py's notes), so that `finetune preprocess` can say so:
    turns_text_changed: int = 0  # trained turns whose text the template changed beyond whitespace (reasoning dropped)
    turns_not_rendered: int = 0  # trained messages the template did not render at all
    rows_with_special_token_text: int = 0  # rows whose message text spells a special token (it becomes that token)

    def add_notes(self, notes: Mapping[str, int]) -> None:
        """Add tokenize.py's per-example notes (keys: the counters above)."""
        for name, count in notes.items():
            setattr(self, name, getattr(self, name) + count)

    def take(self) -> DataStats:
        """These counts, moved out: this object starts again from zero."""
        taken = DataStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        self.__init__()  # type: ignore[misc]
        return taken

    def add(self, other: DataStats) -> None:
        """Add another part's counts (parallel tokenization): the same totals as one serial pass."""
        for f in fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, list):  # the named examples: the first few, in order, as one serial pass keeps
                mine.extend(getattr(other, f.name)[: max(0, EXAMPLES - len(mine))])
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

