"""Noise processes: how a kind of diffusion model is trained, one class per kind.

A process answers the training questions that differ between kinds of model: which times to
draw, how to noise a clean latent and what the network regresses, the SNR at a time, and the
loss weight. :class:`~impasto.objectives.objective.Objective` delegates to the one
:data:`NOISE_PROCESSES` names for the configured prediction type (:func:`process_kind`), so no
caller branches on the kind; ``impasto.sampling.process`` is the sampling side, keyed the same.

* ``"vp"`` — :class:`VPProcess`, DDPM (Ho et al. 2020, arXiv:2006.11239): integer t in [0, T),
  x_t = sqrt(ᾱ_t)·x0 + sqrt(1 − ᾱ_t)·ε; the network predicts ε, v (Salimans & Ho 2022,
  arXiv:2202.00512) or x0.
* ``"flow"`` — :class:`FlowProcess`, rectified flow (Liu et al. 2022, arXiv:2209.03003) in the
  SD3 convention (Esser et al. 2024, arXiv:2403.03206): t in (0, 1], x_t = (1 − t)·x0 + t·ε,
  target ε − x0, the network receiving t·T.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from impasto.objectives.flow import (
    add_flow_noise,
    flow_snr,
    flow_target,
    flow_unet_timesteps,
    shift_flow_times,
    shift_for_size,
    shifted_flow_density,
)
from impasto.objectives.noising import PREDICTION_TARGETS, add_noise
from impasto.objectives.schedules import sigmas_from_alphas_cumprod, snr_from_alphas_cumprod
from impasto.objectives.timesteps import (
    FLOW_TIME_DENSITIES,
    FLOW_TIME_SAMPLERS,
    TIMESTEP_PROBABILITIES,
    TIMESTEP_SAMPLERS,
)
from impasto.objectives.weighting import FLOW_LOSS_WEIGHTINGS, LOSS_WEIGHTINGS

FLOW = "flow"  # the prediction type of rectified flow (SD3 convention)

# prediction type → the kind of noise process that trains (and samples) it.
PROCESS_KINDS: dict[str, str] = {**dict.fromkeys(PREDICTION_TARGETS, "vp"), FLOW: "flow"}


def process_kind(prediction_type: str) -> str:
    """``"vp"`` or ``"flow"``: the key of :data:`NOISE_PROCESSES` for ``prediction_type``."""
    if prediction_type not in PROCESS_KINDS:
        raise ValueError(
            f"unknown prediction type {prediction_type!r}; valid types: {sorted(PROCESS_KINDS)}"
        )
    return PROCESS_KINDS[prediction_type]


class NoiseProcess(Protocol):
    """The training side of one kind of noise process; ``times`` [B] are its own time values."""

    @property
    def num_train_timesteps(self) -> int:
        """T: the number of training timesteps (flow: the network receives t·T)."""
        ...

    def sample_times(
        self,
        batch_size: int,
        generator: torch.Generator,
        device: torch.device,
        image_size: tuple[int, int] | None = None,
    ) -> Tensor:
        """Training times [B] on ``device``; ``image_size`` (H, W) in pixels where they matter."""
        ...

    def noised(
        self, latents: Tensor, noise: Tensor, noise_for_input: Tensor, times: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(x_t from ``noise_for_input``, the target from ``noise``, the network's time [B])."""
        ...

    def snr(self, times: Tensor) -> Tensor:
        """SNR [B] at ``times``, float64."""
        ...

    def huber_fraction(self, times: Tensor) -> Tensor:
        """The position of ``times`` in the process, 0 clean to 1 noise: the Huber "fraction"."""
        ...

    def loss_weights(self, times: Tensor) -> Tensor:
        """The configured loss weight at each of ``times``, float32 [B]."""
        ...

    def grid_times(self) -> Tensor:
        """T times covering the process, one per row of ``impasto inspect objective``."""
        ...

    def time_probabilities(
        self, times: Tensor, image_size: tuple[int, int] | None = None
    ) -> Tensor:
        """P(t) at ``times``: the probability (integer t) or density (continuous t) of a draw."""
        ...

    def sigmas(self, times: Tensor) -> Tensor:
        """The VE noise level σ = 1/sqrt(SNR) at ``times``."""
        ...


@dataclass(frozen=True, eq=False)
class VPProcess:
    """DDPM / VP at integer t in [0, T) on ᾱ [T] float64 (zero terminal SNR already finite)."""

    alphas_cumprod: Tensor  # [T], float64
    prediction_type: str  # a PREDICTION_TARGETS name: epsilon, v_prediction or sample
    timestep_sampling: str  # a TIMESTEP_SAMPLERS name
    sampler_params: Mapping[str, Any]
    loss_weighting: str  # a LOSS_WEIGHTINGS name
    weighting_params: Mapping[str, Any]

    @classmethod
    def from_config(cls, config: Any, alphas_cumprod: Tensor) -> VPProcess:
        """From an ``ObjectiveConfig`` (read duck-typed) and its schedule's ᾱ."""
        return cls(
            alphas_cumprod=alphas_cumprod,
            prediction_type=config.prediction_type,
            timestep_sampling=config.timestep_sampling,
            sampler_params=config.timestep_sampler_params(),
            loss_weighting=config.loss_weighting,
            weighting_params=config.loss_weighting_params(),
        )

    @property
    def num_train_timesteps(self) -> int:
        return self.alphas_cumprod.shape[0]

    def sample_times(
        self,
        batch_size: int,
        generator: torch.Generator,
        device: torch.device,
        image_size: tuple[int, int] | None = None,
    ) -> Tensor:
        """int64 timesteps [B] from ``TIMESTEP_SAMPLERS``; ``image_size`` is unused."""
        sampler = TIMESTEP_SAMPLERS[self.timestep_sampling]
        return sampler(
            batch_size, self.num_train_timesteps, generator, device, **self.sampler_params
        )

    def noised(
        self, latents: Tensor, noise: Tensor, noise_for_input: Tensor, times: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x_t = sqrt(ᾱ_t)·x0 + sqrt(1 − ᾱ_t)·ε (Ho et al. eq. 4), the target, and t itself."""
        x_t = add_noise(latents, noise_for_input, times, self.alphas_cumprod)
        target_fn = PREDICTION_TARGETS[self.prediction_type]
        return x_t, target_fn(latents, noise, times, self.alphas_cumprod), times

    def snr(self, times: Tensor) -> Tensor:
        """ᾱ_t/(1 − ᾱ_t), float64."""
        return snr_from_alphas_cumprod(self.alphas_cumprod.to(times.device)[times])

    def huber_fraction(self, times: Tensor) -> Tensor:
        """t/T."""
        return times / self.num_train_timesteps

    def loss_weights(self, times: Tensor) -> Tensor:
        """``LOSS_WEIGHTINGS[loss_weighting]`` of the SNR at ``times``."""
        weights = LOSS_WEIGHTINGS[self.loss_weighting]
        return weights(self.snr(times), self.prediction_type, **self.weighting_params)

    def grid_times(self) -> Tensor:
        """Every training timestep 0..T−1."""
        return torch.arange(self.num_train_timesteps)

    def time_probabilities(
        self, times: Tensor, image_size: tuple[int, int] | None = None
    ) -> Tensor:
        """``TIMESTEP_PROBABILITIES[timestep_sampling]`` at ``times``."""
        probabilities = TIMESTEP_PROBABILITIES[self.timestep_sampling]
        return probabilities(self.num_train_timesteps, **self.sampler_params)[times]

    def sigmas(self, times: Tensor) -> Tensor:
        """sqrt((1 − ᾱ_t)/ᾱ_t)."""
        return sigmas_from_alphas_cumprod(self.alphas_cumprod)[times]


def flow_shift_at(shift: float, reference: int | None, image_size: tuple[int, ...] | None) -> float:
    """``shift`` at an (H, W) image, scaled by ``shift_for_size`` when ``reference`` is set; a
    clip's size is ``(latent frames, H, W)``: its frames count as more pixels, so the shift
    grows with the sample's tokens (an image is one frame)."""
    if reference is not None and image_size is None:
        raise ValueError("flow_shift_resolution needs the image size to shift t")
    *frames, height, width = image_size or (0, 0)
    return shift_for_size(shift, height * math.prod(frames), width, reference)


@dataclass(frozen=True, eq=False)
class FlowProcess:
    """Rectified flow, SD3 convention: t in (0, 1] (t = 1 noise), shifted toward noise by s."""

    num_train_timesteps: int  # T: the network receives t·T
    timestep_sampling: str  # a FLOW_TIME_SAMPLERS name
    sampler_params: Mapping[str, Any]
    shift: float  # s of t → s·t/(1 + (s − 1)·t)
    shift_resolution: int | None  # the image side s holds at; None: every size
    loss_weighting: str  # a FLOW_LOSS_WEIGHTINGS or LOSS_WEIGHTINGS name
    weighting_params: Mapping[str, Any]

    @classmethod
    def from_config(cls, config: Any, alphas_cumprod: Tensor) -> FlowProcess:
        """From an ``ObjectiveConfig`` (read duck-typed); of ᾱ only its length T is read."""
        return cls(
            num_train_timesteps=alphas_cumprod.shape[0],
            timestep_sampling=config.timestep_sampling,
            sampler_params=config.timestep_sampler_params(),
            shift=config.flow_shift,
            shift_resolution=config.flow_shift_resolution,
            loss_weighting=config.loss_weighting,
            weighting_params=config.loss_weighting_params(),
        )

    def shift_at(self, image_size: tuple[int, int] | None = None) -> float:
        """The shift at an (H, W) image (Esser et al. 2024, §5.3.2)."""
        return flow_shift_at(self.shift, self.shift_resolution, image_size)

    def sample_times(
        self,
        batch_size: int,
        generator: torch.Generator,
        device: torch.device,
        image_size: tuple[int, int] | None = None,
    ) -> Tensor:
        """t [B] from ``FLOW_TIME_SAMPLERS``, shifted by the shift at ``image_size``."""
        sampler = FLOW_TIME_SAMPLERS[self.timestep_sampling]
        t = sampler(batch_size, generator, device, **self.sampler_params)
        return shift_flow_times(t, self.shift_at(image_size))

    def noised(
        self, latents: Tensor, noise: Tensor, noise_for_input: Tensor, times: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x_t = (1 − t)·x0 + t·ε, the velocity ε − x0, and t·T."""
        return (
            add_flow_noise(latents, noise_for_input, times),
            flow_target(latents, noise),
            flow_unet_timesteps(times, self.num_train_timesteps),
        )

    def snr(self, times: Tensor) -> Tensor:
        """((1 − t)/t)², float64."""
        return flow_snr(times.double())

    def huber_fraction(self, times: Tensor) -> Tensor:
        """t itself."""
        return times

    def loss_weights(self, times: Tensor) -> Tensor:
        """An SD3 weighting of t, or a DDPM weighting of the flow SNR (prediction type flow)."""
        if self.loss_weighting in FLOW_LOSS_WEIGHTINGS:
            return FLOW_LOSS_WEIGHTINGS[self.loss_weighting](times)
        weights = LOSS_WEIGHTINGS[self.loss_weighting]
        return weights(self.snr(times), FLOW, **self.weighting_params)

    def grid_times(self) -> Tensor:
        """The T midpoints (i + ½)/T of (0, 1), float64."""
        num_steps = self.num_train_timesteps
        return (torch.arange(num_steps, dtype=torch.float64) + 0.5) / num_steps

    def time_probabilities(
        self, times: Tensor, image_size: tuple[int, int] | None = None
    ) -> Tensor:
        """The density of the shifted t (``shifted_flow_density``) at ``times``."""
        density = FLOW_TIME_DENSITIES[self.timestep_sampling]
        return shifted_flow_density(
            density, times, self.shift_at(image_size), **self.sampler_params
        )

    def sigmas(self, times: Tensor) -> Tensor:
        """t/(1 − t), the VE level (not diffusers' flow "sigma", which is t)."""
        return self.snr(times).rsqrt()


# kind (``process_kind``) → process class, built by ``cls.from_config(config, alphas_cumprod)``.
NOISE_PROCESSES: dict[str, type[VPProcess] | type[FlowProcess]] = {
    "vp": VPProcess,
    "flow": FlowProcess,
}


def noise_process(config: Any, alphas_cumprod: Tensor) -> NoiseProcess:
    """The process of an ``ObjectiveConfig`` (read duck-typed) on its schedule's ᾱ [T]."""
    process_class = NOISE_PROCESSES[process_kind(config.prediction_type)]
    return process_class.from_config(config, alphas_cumprod)
