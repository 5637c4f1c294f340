"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values never change after loading."""

    model_config = ConfigDict(extra="forbid", frozen=True)
