"""Early stopping (eval.early_stopping_patience): the run ends once that many evals in a row have not lowered the
best eval loss, as Hugging Face's EarlyStoppingCallback decides it (threshold 0; Axolotl's early_stopping_patience).

Only the evals during training count (every_steps / every_epochs), not the one before the first step: a model is
not stopped for failing to beat its own untrained self. The count and the best loss ride in each checkpoint, so a
resumed run stops at the step the uninterrupted one would. The run then ends as at its last step: final/ holds the
weights of the step it stopped at (not the best eval's: a checkpoint at that step keeps those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EarlyStopping:
    """The evals seen so far: the best loss, its step, and the evals since that did not improve on it."""

    patience: int | None
    best: float | None = None
    best_step: int | None = None
    since: int = 0

    def stops(self, step: int, loss: float | None) -> bool:
        """Take the eval loss at `step`; True when the run should end here."""
        if self.patience is None or loss is None:
            return False
        if self.best is None or loss < self.best:
            self.best, self.best_step, self.since = loss, step, 0
        else:
            self.since += 1
        return self.since >= self.patience

    def message(self, step: int) -> str:
        return (f"early stopping at step {step}: eval_loss has not improved for {self.since} evals "
                f"(eval.early_stopping_patience); the best, {self.best:.6g}, was at step {self.best_step}")

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps (None when early stopping is off)."""
        if self.patience is None:
            return None
        return {"best": self.best, "best_step": self.best_step, "since": self.since}

    @classmethod
    def resumed(cls, patience: int | None, state: dict[str, Any] | None) -> EarlyStopping:
        """Early stopping as a checkpoint's trainer state left it (fresh without one)."""
        saved = (state or {}).get("early_stopping") or {}
        return cls(patience, saved.get("best"), saved.get("best_step"), saved.get("since", 0))
