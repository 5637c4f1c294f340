"""The sampling side of each noise process: what ``generate_latents`` needs per kind of model.

Keyed like :data:`impasto.objectives.NOISE_PROCESSES` (``"vp"`` / ``"flow"``, picked by
:func:`impasto.objectives.process_kind` from the prediction type), each entry turns a
:class:`SamplingRequest` into a :class:`SamplingPlan`: the sampler function and whether it
draws noise each step, the (timesteps, σ) ladder, the scale of the initial noise, the denoiser
factory, and the conversion of the sampler's final state to VP latents.

* ``"vp"``: the samplers work in VE form x = x_t/sqrt(ᾱ) = x0 + σ·ε (Karras et al. 2022,
  arXiv:2206.00364) from the DDPM prior, and the final state is scaled back to VP.
* ``"flow"``: the state is x_t itself, from x_1 = ε to t = 0 (``sampling/flow.py``); it is
  already the latent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from impasto.objectives import process_kind, shift_for_size
from impasto.sampling.denoisers import vp_denoiser
from impasto.sampling.flow import flow_denoiser, flow_timesteps, get_flow_sampler
from impasto.sampling.samplers import Denoiser, SampleFn, get_sampler
from impasto.sampling.schedules import initial_noise_scale

# (model, cond, uncond_and_cond, *, guidance_scale, guidance_rescale) -> Denoiser
DenoiserFactory = Callable[..., Denoiser]


@dataclass(frozen=True)
class SamplingRequest:
    """What the caller asked for, whatever the kind of model."""

    sampler: str  # a SAMPLERS name (flow: a FLOW_SAMPLERS name)
    num_steps: int
    prediction_type: str  # a PREDICTION_TYPES name or "flow"
    alphas_cumprod: Tensor  # [T] the training schedule; flow reads only T
    spacing: str = "leading"  # VP only: a SPACINGS name
    steps_offset: int = 1  # VP only
    flow_shift: float = 1.0  # flow only: the time shift s at flow_shift_resolution²
    flow_shift_resolution: int | None = None  # flow only: None, s at every size
    height: int = 64  # the image size in pixels (flow: scales the shift)
    width: int = 64
    frames: int = 1  # latent frames of a clip (flow: its frames scale the shift as pixels do)


@dataclass(frozen=True)
class SamplingPlan:
    """How to sample one kind of model: ``sample(make_denoiser(...), ε·noise_scale, ...)``."""

    sample: SampleFn  # samplers.py's signature
    stochastic: bool  # draws fresh noise each step: needs sample(..., noise=...)
    timesteps: Tensor  # [n], the model's time input at each level
    sigmas: Tensor  # [n + 1], the ladder the sampler walks (flow: t)
    noise_scale: float  # the std of the initial state, in units of ε
    make_denoiser: DenoiserFactory
    to_latents: Callable[[Tensor], Tensor]  # the final state → VP latents
    # (x0, level, ε) → the sampler's state at ``level`` (a σ of the ladder; flow: t), for
    # re-noising a sample to a step of the ladder (DRaFT-LV)
    noised: Callable[[Tensor, Tensor, Tensor], Tensor]


def ve_to_vp(x: Tensor, sigma: Tensor) -> Tensor:
    """x/sqrt(σ² + 1): the VP x_t of a VE state x at level σ (exactly x at σ = 0)."""
    return x / (sigma**2 + 1) ** 0.5


def _unchanged(x: Tensor) -> Tensor:
    return x


def ve_noised(x0: Tensor, sigma: Tensor, noise: Tensor) -> Tensor:
    """x0 + σ·ε: the VE state at level σ (Karras et al. 2022, eq. 1 with s(t) = 1)."""
    return x0 + sigma * noise


def flow_noised(x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """(1 − t)·x0 + t·ε: the rectified-flow state at time t."""
    return (1 - t) * x0 + t * noise


def vp_plan(request: SamplingRequest) -> SamplingPlan:
    """A DDPM model: VE state from the prior x_T·sqrt(ᾱ_T) ~ N(0, I), diffusers' ladders."""
    spec = get_sampler(request.sampler)
    timesteps, sigmas = spec.schedule(
        request.num_steps, request.alphas_cumprod, request.spacing, request.steps_offset
    )
    return SamplingPlan(
        sample=spec.sample,
        stochastic=spec.stochastic,
        timesteps=timesteps,
        sigmas=sigmas,
        noise_scale=initial_noise_scale(sigmas[0]),
        make_denoiser=functools.partial(vp_denoiser, prediction_type=request.prediction_type),
        to_latents=functools.partial(ve_to_vp, sigma=sigmas[-1]),
        noised=ve_noised,
    )


def flow_plan(request: SamplingRequest) -> SamplingPlan:
    """A rectified-flow model (SD3 convention): the shifted t ladder from x_1 = ε to t = 0."""
    sample = get_flow_sampler(request.sampler)
    shift = shift_for_size(
        request.flow_shift,
        request.height * request.frames,
        request.width,
        request.flow_shift_resolution,
    )
    timesteps, sigmas = flow_timesteps(request.num_steps, shift, request.alphas_cumprod.shape[0])
    return SamplingPlan(
        sample=sample,
        stochastic=False,
        timesteps=timesteps,
        sigmas=sigmas,
        noise_scale=1.0,
        make_denoiser=flow_denoiser,
        to_latents=_unchanged,
        noised=flow_noised,
    )


@runtime_checkable
class OwnSampling(Protocol):
    """Optional for a backbone (``impasto.models.backbone``): one that says how it samples,
    where the generic sampler's settings do not (a released flow model whose ladder and
    guidance are its own). ``impasto.sampling`` checks ``isinstance(backbone, OwnSampling)``
    and then uses both methods, whatever the run's ``objective.flow_shift`` and
    ``sample.guidance_scale`` would give. A backbone may also name the sampler it uses when
    none is asked (:func:`default_sampler`)."""

    def sampling_ladder(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        """``(timesteps [n], ts [n + 1])`` float32 of a flow model for an H×W image: the
        denoiser's time input t·T at each step, and the t ladder from 1 ending at 0."""

    def embedded_guidance(self, condition: Any, guidance_scale: float) -> Any | None:
        """``condition`` with ``guidance_scale`` given to the network as an input (a
        guidance-distilled model: one forward per step, no classifier-free guidance), or
        ``condition`` unchanged for a model sampled without guidance; None: the model uses
        classifier-free guidance at ``guidance_scale``."""


DEFAULT_SAMPLER = "euler"  # the sampler when none is asked and the family names none


def default_sampler(backbone: Any) -> str:
    """The sampler of a request that names none: the one the backbone's family samples with,
    its optional ``own_sampler`` attribute (``"unipc"`` for a model whose diffusers pipeline
    samples with ``UniPCMultistepScheduler``), else Euler. A sampler asked by name is always
    the one used."""
    return getattr(backbone, "own_sampler", None) or DEFAULT_SAMPLER


def family_plan(
    plan: SamplingPlan, backbone: Any, prediction_type: str, num_steps: int, height: int,
    width: int,
) -> SamplingPlan:  # fmt: skip
    """``plan`` on the backbone's own ladder (:class:`OwnSampling`) for a flow model; else
    ``plan`` itself."""
    if process_kind(prediction_type) != "flow" or not isinstance(backbone, OwnSampling):
        return plan
    timesteps, ts = backbone.sampling_ladder(num_steps, height, width)
    return replace(plan, timesteps=timesteps, sigmas=ts)


# kind (``impasto.objectives.process_kind``) → plan builder.
SAMPLING_PROCESSES: dict[str, Callable[[SamplingRequest], SamplingPlan]] = {
    "vp": vp_plan,
    "flow": flow_plan,
}


def sampling_plan(request: SamplingRequest) -> SamplingPlan:
    """The plan of the process ``request.prediction_type`` names; unknown types list the valid."""
    return SAMPLING_PROCESSES[process_kind(request.prediction_type)](request)
