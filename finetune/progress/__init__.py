"""A long phase's progress (what it is doing, how far, at what rate, how long left), said on stderr: a line that
updates in place on a terminal, a line every `every` seconds off one (a log keeps one line per update, never a run of
carriage returns). A plain re-export: the logic is in phase.py."""

from finetune.progress.phase import Phase, log_friendly_libraries, on_terminal

__all__ = ["Phase", "log_friendly_libraries", "on_terminal"]
