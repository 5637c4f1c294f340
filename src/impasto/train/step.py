"""One diffusion training step for SDXL: encode, noise, predict, loss.

The objective math lives in :mod:`impasto.objectives` (pure functions picked by name); this
module only wires it to the SDXL components and a :class:`~impasto.data.Batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor

from impasto.config.schema import ObjectiveConfig
from impasto.data import Batch
from impasto.models import SDXLComponents, add_time_ids
from impasto.objectives import (
    HUBER_C_SCHEDULES,
    LOSS_WEIGHTINGS,
    LOSSES,
    PREDICTION_TARGETS,
    TIMESTEP_SAMPLERS,
    add_noise,
    offset_noise,
    perturb_noise,
    pyramid_noise,
    snr_from_alphas_cumprod,
    training_alphas_cumprod,
)
from impasto.train.memo import EncodingMemo


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

    def sample_timesteps(
        self, batch_size: int, generator: torch.Generator, device: torch.device
    ) -> Tensor:
        sampler = TIMESTEP_SAMPLERS[self.config.timestep_sampling]
        params = self.config.timestep_sampler_params()
        return sampler(batch_size, self.num_train_timesteps, generator, device, **params)

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

    def per_sample_loss(self, prediction: Tensor, target: Tensor, timesteps: Tensor) -> Tensor:
        """The configured loss per sample [B], times the loss weighting of each one's SNR."""
        config = self.config
        kwargs = {}
        if config.loss in ("huber", "pseudo_huber"):
            schedule = HUBER_C_SCHEDULES[config.huber_schedule]
            kwargs["huber_c"] = schedule(timesteps, self.alphas_cumprod, config.huber_c)
        loss = LOSSES[config.loss](prediction, target, **kwargs)
        if config.loss_weighting == "none":
            return loss
        snr = snr_from_alphas_cumprod(self.alphas_cumprod.to(timesteps.device)[timesteps])
        weights = LOSS_WEIGHTINGS[config.loss_weighting](
            snr, config.prediction_type, **config.loss_weighting_params()
        )
        return loss * weights.to(loss.device)


@dataclass(frozen=True)
class StepOutput:
    loss: Tensor  # scalar, differentiable
    per_sample_loss: Tensor  # [B], detached
    timesteps: Tensor  # [B]


def training_step(
    models: SDXLComponents,
    objective: Objective,
    batch: Batch,
    generator: torch.Generator,
    autocast: Callable[[], AbstractContextManager],
    memo: EncodingMemo | None = None,
) -> StepOutput:
    """The loss of one micro-batch. Randomness (VAE posterior, noise, t) comes from ``generator``.

    The generator lives on the CPU so a run draws the same numbers on any device. ``memo``
    (``cache: memory``) reuses earlier encodings of the same images and captions.
    """
    device = models.unet.device
    memo = memo or EncodingMemo(latents=False, text_embeddings=False)
    with torch.no_grad():
        mean, std = memo.posterior(models, batch)
        noise_for_posterior = torch.randn(mean.shape, generator=generator)
        latents = mean + std * noise_for_posterior.to(device, std.dtype)
        latents = (latents * models.vae_scaling_factor).float()
        prompts = memo.prompts(models, batch.captions, autocast)
        time_ids = add_time_ids(
            batch.original_sizes, batch.crop_top_lefts, batch.target_sizes, dtype=torch.float32
        ).to(device)

    noise = torch.randn(latents.shape, generator=generator).to(device)
    timesteps = objective.sample_timesteps(latents.shape[0], generator, device)
    noise, noise_for_input = objective.shape_noise(noise, generator)
    noisy_latents = add_noise(latents, noise_for_input, timesteps, objective.alphas_cumprod)
    target_fn = PREDICTION_TARGETS[objective.config.prediction_type]
    target = target_fn(latents, noise, timesteps, objective.alphas_cumprod)
    with autocast():
        prediction = models.unet(
            noisy_latents,
            timesteps,
            encoder_hidden_states=prompts.prompt_embeds,
            added_cond_kwargs={"text_embeds": prompts.pooled_prompt_embeds, "time_ids": time_ids},
        ).sample
    per_sample = objective.per_sample_loss(prediction, target, timesteps)
    return StepOutput(
        loss=per_sample.mean(), per_sample_loss=per_sample.detach(), timesteps=timesteps
    )
