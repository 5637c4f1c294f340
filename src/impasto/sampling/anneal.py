"""Annealed guidance: sample with a mix of a base model and its fine-tuned version.

Annealed importance guidance (AIG; Jena et al. 2024, "Elucidating Optimal Reward-Diversity
Tradeoffs in Text-to-Image Diffusion Models", the DRaFT+ paper; NeMo-Aligner's
``examples/mm/stable_diffusion/anneal_sdxl.py``) samples a reward-tuned model together with
its base: at sampler step i of n (i = 0 the noisiest) the prediction is

    d_i = (1 − w_i)·d_base + w_i·d_tuned,

with the weight w_i of a schedule over the fraction i/n (the table :data:`ANNEAL_SCHEDULES`).
``draft`` (w = 1) is the tuned model, ``base`` (w = 0) the base; the others hand the early,
layout-setting steps to the base and the late, detail-setting steps to the tuned model.

Why mixing the two *network outputs* is the mix NeMo describes (of denoised x̂0, or of the
sampler's update d): every conversion between the network output and what the sampler reads is
affine in the output with coefficients that depend only on (x_t, σ): x̂0 = (x_t − sqrt(1 − ᾱ)·ε̂)
/sqrt(ᾱ) for ε, sqrt(ᾱ)·x_t − sqrt(1 − ᾱ)·v̂ for v, the output itself for x0, x_t − t·v̂ for
flow; and classifier-free guidance u + s·(c − u) is linear in the output. An affine map f with
f(y) = A + B·y satisfies f((1 − w)·y₁ + w·y₂) = (1 − w)·f(y₁) + w·f(y₂), because the weights sum
to 1; so the mixed output gives the mixed x̂0, and, each sampler step being affine in x̂0 (Euler,
DDIM, DPM++ 2M's extrapolation, the ancestral step), the mixed update. (Guidance rescale, a ratio of
standard deviations, is not affine: with φ > 0 it is applied to the mixed output.)

Torch only, as the rest of ``sampling``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ModelForward = Callable[[Tensor, Tensor, Any], Tensor]  # (x_t, timestep, conditioning) -> output


def _positive(text: str) -> float:
    """P of ``power_P``: a finite number > 0."""
    value = _number(text)
    if not value > 0:
        raise ValueError("P must be > 0")
    return value


def _fraction(text: str) -> float:
    """F of ``step_F``: a number in [0, 1]."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("F must be in [0, 1]")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or text != text.strip():
        raise ValueError(f"{text!r} is not a finite number")
    return value


@dataclass(frozen=True)
class AnnealSchedule:
    """One form of ``--anneal``: how it reads its parameter and the weights it gives."""

    form: str  # how a user writes it, for error messages (``power_P`` ...)
    weights: Callable[[Tensor, float], Tensor]  # (i/n [n] float64, parameter) → w [n] float64
    # a ``prefix_`` name's parameter: the text after the prefix → the value (or ValueError)
    parameter: Callable[[str], float] | None = None


# name (a ``prefix_`` takes its parameter after the underscore) → schedule, as NeMo-Aligner's
# ``anneal_sdxl.py`` ``weight_type``: w_i over the fraction i/n of the sampler's steps.
ANNEAL_SCHEDULES: dict[str, AnnealSchedule] = {
    "base": AnnealSchedule("base", lambda fraction, _: torch.zeros_like(fraction)),
    "draft": AnnealSchedule("draft", lambda fraction, _: torch.ones_like(fraction)),
    "linear": AnnealSchedule("linear", lambda fraction, _: fraction),
    "power_": AnnealSchedule(
        "power_P (P > 0, e.g. power_2)", lambda fraction, p: fraction**p, _positive
    ),
    "step_": AnnealSchedule(
        "step_F (0 <= F <= 1, e.g. step_0.6)",
        lambda fraction, f: (fraction >= f).to(fraction.dtype),
        _fraction,
    ),
}


def _bad_spec(spec: str, reason: str) -> ValueError:
    forms = ", ".join(schedule.form for schedule in ANNEAL_SCHEDULES.values())
    return ValueError(f"anneal schedule {spec!r}: {reason}; valid forms: {forms}")


def anneal_weights(spec: str, num_steps: int) -> Tensor:
    """w ``[num_steps]`` float64: the base/tuned mixing weight of each sampler step.

    ``spec`` is a name of :data:`ANNEAL_SCHEDULES`, a ``prefix_`` name followed by its
    parameter (``power_2``, ``step_0.6``). Step i (0 = the noisiest) gets the schedule at
    i/n, so w_0 = 0 for ``linear`` and ``power_P``, and w_{n−1} = (n − 1)/n for ``linear``
    (NeMo-Aligner's ``i / total`` with total = n). A bad spec is a one-line ``ValueError``
    listing the valid forms.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    for name, schedule in ANNEAL_SCHEDULES.items():
        matches = spec == name if schedule.parameter is None else spec.startswith(name)
        if not matches:
            continue
        try:
            parameter = schedule.parameter(spec[len(name) :]) if schedule.parameter else 0.0
        except ValueError as error:
            raise _bad_spec(spec, str(error)) from None
        fraction = torch.arange(num_steps, dtype=torch.float64) / num_steps  # i/n, i = 0..n−1
        return schedule.weights(fraction, parameter)
    raise _bad_spec(spec, "unknown schedule")


def _step_index(levels: list[float], level: float, last: int) -> int:
    """The first index of ``level`` in ``levels`` after ``last``, wrapping round to 0.

    Each sampler step evaluates the model once, at the plan's timesteps[i] in order, so the
    next step is the next occurrence after the last one found; this tells apart steps whose
    timesteps are equal, and a second sampling pass starts over from the top.
    """
    for index in [*range(last + 1, len(levels)), *range(last + 1)]:
        if levels[index] == level:
            return index
    raise ValueError(
        f"timestep {level} is not one of the sampling plan's timesteps; pass annealed_forward "
        "the timesteps the sampler steps through"
    )


def annealed_forward(
    base_forward: ModelForward, tuned_forward: ModelForward, timesteps: Tensor, weights: Tensor
) -> ModelForward:
    """``(x_t, timestep, conditioning) -> (1 − w_i)·base + w_i·tuned``, i the step of timestep.

    ``timesteps`` ``[n]`` are the sampling plan's (the model's time input at each step) and
    ``weights`` ``[n]`` the mix (:func:`anneal_weights`). The step index is found from the
    value of the 0-d ``timestep`` (see :func:`_step_index`), not from a count of calls. A
    weight of 0 or 1 evaluates only the model it selects, so ``base`` and ``draft`` cost one
    network call per step and return that model's output bit for bit. Why mixing outputs is
    mixing the denoised x̂0: the module docstring.
    """
    if weights.shape != timesteps.shape or timesteps.ndim != 1:
        raise ValueError(
            f"timesteps and weights must both be [n], got {tuple(timesteps.shape)} and "
            f"{tuple(weights.shape)}; build the weights with anneal_weights(spec, n)"
        )
    levels = timesteps.tolist()
    mix = weights.tolist()
    last = -1  # the step found by the previous call

    def forward(x_t: Tensor, timestep: Tensor, conditioning: Any) -> Tensor:
        nonlocal last
        last = _step_index(levels, float(timestep), last)
        weight = mix[last]
        if weight == 0.0:
            return base_forward(x_t, timestep, conditioning)
        if weight == 1.0:
            return tuned_forward(x_t, timestep, conditioning)
        base = base_forward(x_t, timestep, conditioning)
        return (1 - weight) * base + weight * tuned_forward(x_t, timestep, conditioning)

    return forward


@dataclass(frozen=True)
class Annealing:
    """Annealed guidance for ``generate``: the schedule and the base model's forward."""

    spec: str  # an anneal_weights spec: base, draft, linear, power_P, step_F
    # the base model as generate.model_forward returns it; it reads the sampled backbone's
    # conditioning, so both models must share their text encoders
    base_forward: ModelForward
