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


class Method(Protocol):
    """A training method (see the module docstring)."""

    needs: DataNeeds

    def step(self, batch: Batch, generator: torch.Generator) -> StepOutput:
        """The loss of one micro-batch; every random draw comes from ``generator``."""


MethodBuilder = Callable[[MethodContext], Method]

METHODS: dict[str, MethodBuilder] = {}
"""``objective.method`` → the builder of that training method."""


register_method = registrar(METHODS, "training method")
"""Decorator: ``@register_method("name")`` on a builder ``(MethodContext) -> Method``."""


def build_method(context: MethodContext) -> Method:
    """The method ``objective.method`` names (default ``denoise``)."""
    return lookup(METHODS, context.config.objective.method, "objective.method", "method")(context)


from impasto.train.methods import denoise  # noqa: E402,F401  (registers "denoise")

__all__ = [
    "METHODS",
    "DataNeeds",
    "Method",
    "MethodContext",
    "StepOutput",
    "build_method",
    "register_method",
]
