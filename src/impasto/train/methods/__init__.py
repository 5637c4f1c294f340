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
    """One micro-step's result: the loss to backpropagate and metrics to log, as tensors read on
    logging steps only. A metric is a 0-dim tensor (a mean over the micro-batch: the loop logs
    the logging step's, averaged over its micro-batches and ranks), or a ``[2]`` tensor
    ``(sum, count)`` over some of the samples (:func:`subset_mean`): the loop sums those over
    the micro-batches, ranks and steps since the last logging step and logs sum / count
    (nothing when the count is 0), e.g. the loss of the samples in one timestep bucket."""

    loss: Tensor  # scalar, differentiable
    metrics: dict[str, Tensor] = field(default_factory=dict)


def subset_mean(values: Tensor, member: Tensor) -> Tensor:
    """``[2]``: (the sum of ``values`` [B] where ``member`` [B] (bool) holds, how many hold),
    float32 on their device, no host sync: a metric the loop logs as a mean over the logging
    interval (:class:`StepOutput`)."""
    member = member.to(values.dtype)
    return torch.stack([(values * member).sum(), member.sum()]).float()


def time_bucket_metrics(
    per_sample_loss: Tensor, time_fraction: Tensor, num_buckets: int
) -> dict[str, Tensor]:
    """``loss_t0`` … ``loss_t{n-1}``: the loss of the samples whose time, as a fraction of the
    process's range ([0, 1): clean to noise), falls in each of ``num_buckets`` equal buckets
    (:func:`subset_mean` each). Shows which noise levels the loss comes from."""
    bucket = (time_fraction.float() * num_buckets).long().clamp_(0, num_buckets - 1)
    return {
        f"loss_t{number}": subset_mean(per_sample_loss.detach().float(), bucket == number)
        for number in range(num_buckets)
    }


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


class EvalLoss(Protocol):
    """The optional validation-loss hooks of a method (``eval.*``; :mod:`impasto.train.evaluation`).
    A method without them (draftp) has no validation loss."""

    def eval_times(self, num_strata: int) -> Tensor:
        """``[S]``: the fixed times the validation loss is measured at, one per stratum of the
        method's time range (its midpoint), in the form :meth:`eval_loss` takes."""

    def eval_loss(self, batch: Batch, times: Tensor, noise: Tensor) -> Tensor:
        """``[S, B]``: the loss of each of the batch's ``B`` images at each of ``times`` ``[S]``
        with ``noise`` ``[S, B, C, h, w]`` (latent shape), without gradients and drawing no
        random number; called in eval mode."""


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
    "EvalLoss",
    "Method",
    "MethodContext",
    "WHOLE_STEP",
    "Rows",
    "StepOutput",
    "build_method",
    "register_method",
    "subset_mean",
    "time_bucket_metrics",
]
