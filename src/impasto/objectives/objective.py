"""The objective a config names, resolved: draw training times, noise, targets, weighted loss.

Glue between :class:`~impasto.config.schema.ObjectiveConfig` and the registries of this package;
the training step (``impasto.train.step``) and ``impasto inspect objective`` both use it, so
what is inspected is what is trained. DDPM objectives use int64 timesteps t in [0, T); flow
matching uses continuous t in (0, 1] (t = 1 noise) and feeds the UNet t·T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from impasto.config.schema import ObjectiveConfig
from impasto.objectives.flow import (
    add_flow_noise,
    flow_snr,
    flow_target,
    flow_unet_timesteps,
    shift_flow_times,
    shift_for_size,
)
from impasto.objectives.losses import HUBER_C_SCHEDULES, LOSSES
from impasto.objectives.noise import offset_noise, perturb_noise, pyramid_noise
from impasto.objectives.noising import PREDICTION_TARGETS, add_noise
from impasto.objectives.schedules import snr_from_alphas_cumprod, training_alphas_cumprod
from impasto.objectives.timesteps import FLOW_TIME_SAMPLERS, TIMESTEP_SAMPLERS
from impasto.objectives.weighting import FLOW_LOSS_WEIGHTINGS, LOSS_WEIGHTINGS


@dataclass(frozen=True)
class Objective:
    """The resolved objective: the schedule's ᾱ and the functions the config names."""

    config: ObjectiveConfig
    alphas_cumprod: Tensor  # [T], float64; zero terminal SNR already made finite

    @classmethod
    def from_config(cls, config: ObjectiveConfig) -> Objective:
        return cls(config=config, alphas_cumprod=training_alphas_cumprod(config))

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
        config = self.config
        params = config.timestep_sampler_params()
        if not config.is_flow:
            sampler = TIMESTEP_SAMPLERS[config.timestep_sampling]
            return sampler(batch_size, self.num_train_timesteps, generator, device, **params)
        t = FLOW_TIME_SAMPLERS[config.timestep_sampling](batch_size, generator, device, **params)
        return shift_flow_times(t, self.flow_shift(image_size))

    def flow_shift(self, image_size: tuple[int, int] | None = None) -> float:
        """The flow shift at an (H, W) image: ``flow_shift``, scaled by ``shift_for_size``."""
        config = self.config
        if config.flow_shift_resolution is not None and image_size is None:
            raise ValueError("flow_shift_resolution needs the image size to shift t")
        height, width = image_size or (0, 0)
        return shift_for_size(config.flow_shift, height, width, config.flow_shift_resolution)

    def noised(
        self, latents: Tensor, noise: Tensor, noise_for_input: Tensor, times: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(model input x_t, regression target, the UNet's time input [B]) at ``times``."""
        if self.config.is_flow:
            x_t = add_flow_noise(latents, noise_for_input, times)
            return (
                x_t,
                flow_target(latents, noise),
                flow_unet_timesteps(times, self.num_train_timesteps),
            )
        x_t = add_noise(latents, noise_for_input, times, self.alphas_cumprod)
        target_fn = PREDICTION_TARGETS[self.config.prediction_type]
        return x_t, target_fn(latents, noise, times, self.alphas_cumprod), times

    def snr(self, times: Tensor) -> Tensor:
        """SNR at ``times`` (float64 for DDPM objectives)."""
        if self.config.is_flow:
            return flow_snr(times.double())
        return snr_from_alphas_cumprod(self.alphas_cumprod.to(times.device)[times])

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
        kwargs = {"mask": mask}
        if config.loss in ("huber", "pseudo_huber"):
            fraction = times if config.is_flow else times / self.num_train_timesteps
            sigma = self.snr(times).rsqrt().float()
            schedule = HUBER_C_SCHEDULES[config.huber_schedule]
            kwargs["huber_c"] = schedule(fraction.float(), sigma, config.huber_c)
        loss = LOSSES[config.loss](prediction, target, **kwargs)
        if config.loss_weighting == "none":
            return loss
        return loss * self.loss_weights(times).to(loss.device)

    def loss_weights(self, times: Tensor) -> Tensor:
        """The loss weight at each of ``times``, float32 [B]."""
        config = self.config
        if config.is_flow and config.loss_weighting in FLOW_LOSS_WEIGHTINGS:
            return FLOW_LOSS_WEIGHTINGS[config.loss_weighting](times)
        return LOSS_WEIGHTINGS[config.loss_weighting](
            self.snr(times), config.prediction_type, **config.loss_weighting_params()
        )
