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
    LOSSES,
    PREDICTION_TARGETS,
    TIMESTEP_SAMPLERS,
    add_noise,
    training_alphas_cumprod,
)
from impasto.train.memo import EncodingMemo


@dataclass(frozen=True)
class Objective:
    """The resolved objective: the schedule's ᾱ and the functions chosen by the config."""

    alphas_cumprod: Tensor  # [T], float64
    num_train_timesteps: int
    target: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    sample_timesteps: Callable[[int, int, torch.Generator, torch.device], Tensor]
    loss: Callable[[Tensor, Tensor], Tensor]

    @classmethod
    def from_config(cls, config: ObjectiveConfig) -> Objective:
        return cls(
            alphas_cumprod=training_alphas_cumprod(config),
            num_train_timesteps=config.num_train_timesteps,
            target=PREDICTION_TARGETS[config.prediction_type],
            sample_timesteps=TIMESTEP_SAMPLERS[config.timestep_sampling],
            loss=LOSSES[config.loss],
        )


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
    timesteps = objective.sample_timesteps(
        latents.shape[0], objective.num_train_timesteps, generator, device
    )
    noisy_latents = add_noise(latents, noise, timesteps, objective.alphas_cumprod)
    target = objective.target(latents, noise, timesteps, objective.alphas_cumprod)
    with autocast():
        prediction = models.unet(
            noisy_latents,
            timesteps,
            encoder_hidden_states=prompts.prompt_embeds,
            added_cond_kwargs={"text_embeds": prompts.pooled_prompt_embeds, "time_ids": time_ids},
        ).sample
    per_sample = objective.loss(prediction, target)
    return StepOutput(
        loss=per_sample.mean(), per_sample_loss=per_sample.detach(), timesteps=timesteps
    )
