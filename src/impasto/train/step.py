"""One diffusion training step for SDXL: encode, noise, predict, loss.

The objective math lives in :mod:`impasto.objectives` (pure functions picked by name); this
module only wires it to the SDXL components and a :class:`~impasto.data.Batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from impasto.data import Batch
from impasto.models import SDXLComponents, add_time_ids
from impasto.objectives.objective import Objective
from impasto.train.memo import EncodingMemo


@dataclass(frozen=True)
class StepOutput:
    loss: Tensor  # scalar, differentiable
    per_sample_loss: Tensor  # [B], detached
    timesteps: Tensor  # [B], the UNet's time input (flow: t·T)


def training_step(
    models: SDXLComponents,
    objective: Objective,
    batch: Batch,
    generator: torch.Generator,
    autocast: Callable[[], AbstractContextManager],
    memo: EncodingMemo | None = None,
    train_text: bool = False,
) -> StepOutput:
    """The loss of one micro-batch. Randomness (VAE posterior, noise, t) comes from ``generator``.

    The generator lives on the CPU so a run draws the same numbers on any device. ``memo``
    (``cache: memory``) reuses earlier encodings of the same images and captions.
    ``train_text``: the prompts are encoded with gradients (a text encoder trains).
    """
    device = models.unet.device
    memo = memo or EncodingMemo(latents=False, text_embeddings=False)
    with torch.no_grad():
        mean, std = memo.posterior(models, batch)
        noise_for_posterior = torch.randn(mean.shape, generator=generator)
        latents = mean + std * noise_for_posterior.to(device, std.dtype)
        latents = (latents * models.vae_scaling_factor).float()
        time_ids = add_time_ids(
            batch.original_sizes, batch.crop_top_lefts, batch.target_sizes, dtype=torch.float32
        ).to(device)

    cached = None
    if batch.prompt_embeds is not None:
        cached = (batch.prompt_embeds, batch.pooled_prompt_embeds)
    with torch.set_grad_enabled(train_text):
        prompts = memo.prompts(models, batch.captions, autocast, cached)
    noise = torch.randn(latents.shape, generator=generator).to(device)
    height, width = (int(size) for size in batch.target_sizes[0])
    times = objective.sample_times(latents.shape[0], generator, device, (height, width))
    noise, noise_for_input = objective.shape_noise(noise, generator)
    noisy_latents, target, unet_timesteps = objective.noised(latents, noise, noise_for_input, times)
    with autocast():
        prediction = models.unet(
            noisy_latents,
            unet_timesteps,
            encoder_hidden_states=prompts.prompt_embeds,
            added_cond_kwargs={"text_embeds": prompts.pooled_prompt_embeds, "time_ids": time_ids},
        ).sample
    mask = None
    if batch.loss_masks is not None:  # pixel masks → latent resolution (mean over each cell)
        mask = F.interpolate(
            batch.loss_masks.to(device).float(), size=latents.shape[-2:], mode="area"
        )
    per_sample = objective.per_sample_loss(prediction, target, times, mask=mask)
    if batch.loss_weights is not None:
        per_sample = per_sample * batch.loss_weights.to(per_sample)
    return StepOutput(
        loss=per_sample.mean(), per_sample_loss=per_sample.detach(), timesteps=unet_timesteps
    )
