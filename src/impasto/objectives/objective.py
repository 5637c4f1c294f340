"""The objective a config names, resolved: draw training times, noise, targets, weighted loss.

Glue between an ``ObjectiveConfig`` (:mod:`impasto.config.schema`, read duck-typed: this
package imports torch only) and the registries of this package; the ``denoise`` training method
and ``impasto inspect objective`` both use it, so what is inspected is what is trained. What
differs between DDPM objectives (int64 timesteps t in [0, T)) and flow matching (continuous t in
(0, 1], t = 1 noise, the UNet fed t·T) is the :class:`~impasto.objectives.process.NoiseProcess`
the prediction type selects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from impasto.objectives.losses import HUBER_C_SCHEDULES, LOSSES
from impasto.objectives.noise import offset_noise, perturb_noise, pyramid_noise
from impasto.objectives.process import NoiseProcess, flow_shift_at, noise_process
from impasto.objectives.schedules import training_alphas_cumprod


def precondition(prediction: Tensor, target: Tensor, times: Tensor) -> tuple[Tensor, Tensor]:
    """Flow's velocity prediction and target as their x0 forms, for the loss (SD3's
    preconditioned outputs, ``objective.precondition_outputs``): diffusers'
    train_dreambooth_lora_sd3.py compares ``x̂0 = v̂·(−σ) + x_t`` with the clean latents
    ``x0 = x_t − σ·(ε − x0)``; their difference is ``−σ·(v̂ − v)``, so the pair
    ``(−σ·v̂, −σ·v)`` (σ = flow t [B]) gives every loss exactly the script's x0 error without
    needing x_t (with ``input_perturbation``, x0 is the one the target's ε makes)."""
    sigma = (-times.float()).view(-1, *([1] * (prediction.ndim - 1))).to(prediction.device)
    return prediction.float() * sigma, target.float() * sigma


@dataclass(frozen=True)
class Objective:
    """The resolved objective: the schedule's ᾱ, its noise process and the configured loss."""

    config: Any  # an ObjectiveConfig
    alphas_cumprod: Tensor  # [T], float64; zero terminal SNR already made finite
    process: NoiseProcess  # NOISE_PROCESSES[process_kind(config.prediction_type)]

    @classmethod
    def from_config(cls, config: Any) -> Objective:
        """Resolve an ``ObjectiveConfig``; ValueError for an unknown prediction type."""
        alphas_cumprod = training_alphas_cumprod(config)
        return cls(config, alphas_cumprod, noise_process(config, alphas_cumprod))

    @property
    def num_train_timesteps(self) -> int:
        return self.config.num_train_timesteps

    def sample_times(
        self,
        batch_size: int,
        generator: torch.Generator,
        device: torch.device,
        image_size: tuple[int, int] | None = None,
    ) -> Tensor:
        """The training times [B]: int64 timesteps of a DDPM objective, or flow t in (0, 1].

        Flow t is shifted by ``flow_shift`` (scaled to ``image_size`` (H, W) in pixels when
        ``flow_shift_resolution`` is set).
        """
        return self.process.sample_times(batch_size, generator, device, image_size)

    def flow_shift(self, image_size: tuple[int, int] | None = None) -> float:
        """The flow shift at an (H, W) image: ``flow_shift``, scaled by ``shift_for_size``."""
        config = self.config
        return flow_shift_at(config.flow_shift, config.flow_shift_resolution, image_size)

    def noised(
        self, latents: Tensor, noise: Tensor, noise_for_input: Tensor, times: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(model input x_t, regression target, the UNet's time input [B]) at ``times``."""
        return self.process.noised(latents, noise, noise_for_input, times)

    def snr(self, times: Tensor) -> Tensor:
        """SNR at ``times``, float64."""
        return self.process.snr(times)

    def shape_noise(self, noise: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(ε for the target, ε for x_t): offset then pyramid noise (kohya's order) change both;
        input perturbation changes only the second (DESIGN §5). Draws nothing when all are off.
        """
        config = self.config
        if config.noise_offset > 0:
            noise = offset_noise(
                noise,
                config.noise_offset,
                generator,
                random_strength=config.noise_offset_random_strength,
            )
        if config.multires_noise_iterations > 0:
            noise = pyramid_noise(
                noise,
                generator,
                iterations=config.multires_noise_iterations,
                discount=config.multires_noise_discount,
            )
        noise_for_input = noise
        if config.input_perturbation > 0:
            noise_for_input = perturb_noise(
                noise,
                config.input_perturbation,
                generator,
                random_strength=config.input_perturbation_random_strength,
            )
        return noise, noise_for_input

    def per_sample_loss(
        self, prediction: Tensor, target: Tensor, times: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """The configured loss per sample [B], times the loss weighting at each one's time.

        ``mask`` [B, 1, h, w] at the prediction's resolution: the loss is the mean over it.
        """
        config = self.config
        if getattr(config, "precondition_outputs", False):
            prediction, target = precondition(prediction, target, times)
        kwargs = {"mask": mask}
        if config.loss in ("huber", "pseudo_huber"):
            fraction = self.process.huber_fraction(times)
            sigma = self.snr(times).rsqrt().float()
            schedule = HUBER_C_SCHEDULES[config.huber_schedule]
            kwargs["huber_c"] = schedule(fraction.float(), sigma, config.huber_c)
        loss = LOSSES[config.loss](prediction, target, **kwargs)
        if config.loss_weighting == "none":
            return loss
        return loss * self.loss_weights(times).to(loss.device)

    def loss_weights(self, times: Tensor) -> Tensor:
        """The loss weight at each of ``times``, float32 [B]."""
        return self.process.loss_weights(times)
