"""Training methods: what one micro-step computes, picked by ``objective.method``.

A method owns its step: it gets a batch and a generator and returns a typed
:class:`StepOutput` (the differentiable loss and any metrics, as tensors so the loop reads them
only on logging steps). The loop knows no method; a new one (DRaFT+, a distillation) is a new
module that registers itself here. A method also says what data it needs
(:class:`DataNeeds`), so the loop does not load images for a method that uses prompts only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from impasto.registry import lookup, registrar

if TYPE_CHECKING:
    from impasto.data import Batch
    from impasto.models.backbone import Backbone


class DataNeeds(enum.Enum):
    """What a method reads from the data: images with captions, or captions (prompts) only."""

    IMAGES_AND_CAPTIONS = "images_and_captions"
    PROMPTS = "prompts"


@dataclass(frozen=True)
class StepOutput:
    """One micro-step's result: the loss to backpropagate and metrics to log (0-dim tensors,
    read on logging steps only)."""

    loss: Tensor  # scalar, differentiable
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class MethodContext:
    """What a method is built from: the run's config, the backbone, which parts train, the
    context factory of the step (autocast and the attention kernel), and this process's rank
    among ``world`` (a method draws its randomness for the step's global batch)."""

    config: Any
    backbone: Backbone
    trained_parts: tuple[str, ...]
    autocast: Callable[[], Any]
    rank: int = 0
    world: int = 1


@dataclass(frozen=True)
class Rows:
    """Where a micro-batch sits in its optimizer step's global batch: ``slots`` micro-batches
    of ``batch_size`` rows (grad accumulation × ranks), this one slot ``slot``
    (``micro * world + rank``, the order the data stream hands them out in).

    A method draws its randomness for the whole global batch from the step's generator and
    keeps its rows, so a sample's noise and time do not depend on how the step is split:
    2 ranks × batch 2, 1 rank × batch 4 and 1 rank × batch 2 × 2 accumulation draw alike."""

    slot: int = 0
    slots: int = 1
    batch_size: int = 0  # per micro-batch, as configured

    def span(self, rows: int) -> tuple[slice, int]:
        """(this micro-batch's rows of the global draw, the global draw's length) for ``rows``
        rows here (fewer than ``batch_size`` when unreadable images were dropped)."""
        if self.slots == 1:
            return slice(0, rows), rows
        start = self.slot * self.batch_size
        return slice(start, start + rows), self.slots * self.batch_size


WHOLE_STEP = Rows()
"""A micro-batch that is its step's whole global batch (one process, no accumulation)."""


class Method(Protocol):
    """A training method (see the module docstring)."""

    needs: DataNeeds

    def step(self, batch: Batch, generator: torch.Generator, rows: Rows = WHOLE_STEP) -> StepOutput:
        """The loss of one micro-batch; every random draw comes from ``generator``, made for
        the step's global batch (``rows``: this micro-batch's place in it)."""


MethodBuilder = Callable[[MethodContext], Method]

METHODS: dict[str, MethodBuilder] = {}
"""``objective.method`` → the builder of that training method."""


register_method = registrar(METHODS, "training method")
"""Decorator: ``@register_method("name")`` on a builder ``(MethodContext) -> Method``."""


def build_method(context: MethodContext) -> Method:
    """The method ``objective.method`` names (default ``denoise``)."""
    return lookup(METHODS, context.config.objective.method, "objective.method", "method")(context)


from impasto.train.methods import denoise, draftp  # noqa: E402,F401  (register themselves)

__all__ = [
    "METHODS",
    "DataNeeds",
    "Method",
    "MethodContext",
    "WHOLE_STEP",
    "Rows",
    "StepOutput",
    "build_method",
    "register_method",
]
