"""The base of every recipe section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, attribute docstrings become descriptions, and every
    number is finite (1e400 reads as infinity, .nan as not a number: both are errors)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)
