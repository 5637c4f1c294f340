"""Sampling FLUX.1 as ``FluxPipeline`` does, with impasto's flow sampler: the Euler sampler and
flow denoiser of :mod:`impasto.sampling` over FLUX's time ladder.

FLUX's ladder differs from the one-shift ladder of ``impasto.sampling.flow.flow_timesteps``:
``n`` times evenly spaced from 1 down to 1/n, shifted by ``exp(mu)`` where ``mu`` grows
linearly with the image's tokens (``FluxPipeline``'s ``calculate_shift``: ``base_shift`` at
``base_image_seq_len`` tokens, ``max_shift`` at ``max_image_seq_len``). The ladder comes from
diffusers' own ``FlowMatchEulerDiscreteScheduler`` with the model's scheduler config, so it is
the pipeline's to the bit. Guidance-distilled sampling (FLUX.1-dev) gives the transformer the
guidance value ``model.flux.sample_guidance`` and runs one forward per step; a
``guidance_scale`` other than 1 adds classifier-free guidance with the negative prompt
(``FluxPipeline``'s ``true_cfg_scale``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.layout import sequence_length
from impasto.sampling.flow import flow_denoiser
from impasto.sampling.generate import draw_noise, eval_mode, image_generators, model_forward
from impasto.sampling.samplers import sample_euler

DEFAULT_STEPS = 28  # FluxPipeline's documented FLUX.1-dev setting (schnell: 4)


def flux_mu(image_seq_len: int, scheduler_config: dict) -> float:
    """``FluxPipeline``'s ``calculate_shift``: mu linear in the image's tokens."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


def flux_ladder(
    backbone: FluxBackbone, num_steps: int, height: int, width: int
) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], ts [n + 1])`` float32 of an H×W image: the transformer's time input
    t·T, and t ending at 0 (``FluxPipeline``'s, through diffusers' scheduler)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    _, rows, cols = backbone.latent_shape(height, width)
    scheduler = backbone.components.scheduler()
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = flux_mu(sequence_length(rows, cols), backbone.components.scheduler_config)
    if scheduler.config.use_dynamic_shifting:
        scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    else:  # a fixed-shift config (the scheduler's shift)
        scheduler.set_timesteps(sigmas=sigmas)
    return scheduler.timesteps.float(), scheduler.sigmas.float()


def generate_flux_latents(
    backbone: FluxBackbone,
    prompts: list[str],
    *,
    negative_prompt: str = "",
    num_images_per_prompt: int = 1,
    num_steps: int = DEFAULT_STEPS,
    guidance_scale: float = 1.0,
    seed: int = 0,
    height: int = 64,
    width: int = 64,
) -> Tensor:
    """Latents ``[B·k, 16, H/8, W/8]`` float32 on the model's device (not unscaled), rows
    prompt-major; row j starts from the noise of seed + j (``FluxPipeline`` called with
    ``generator=[torch.Generator().manual_seed(seed + j) ...]``)."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if num_images_per_prompt < 1:
        raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
    shape = backbone.latent_shape(height, width)
    prompts = [prompt for prompt in prompts for _ in range(num_images_per_prompt)]
    timesteps, ts = flux_ladder(backbone, num_steps, height, width)
    device = backbone.device
    with torch.no_grad(), eval_mode(*backbone.parts().values()):
        cond = backbone.sampling_condition(prompts, height, width)
        uncond_and_cond = None
        if guidance_scale != 1.0:
            negatives = [negative_prompt] * len(prompts)
            uncond_and_cond = backbone.sampling_condition(negatives, height, width).cat(cond)
        denoise = flow_denoiser(
            model_forward(backbone), cond, uncond_and_cond, guidance_scale=guidance_scale
        )
        x = draw_noise(image_generators(len(prompts), seed), shape).to(device)
        return sample_euler(denoise, x, ts.to(device), timesteps.to(device))


def generate_flux(backbone: FluxBackbone, prompts: list[str], **options: object) -> Tensor:
    """Images ``[B·k, 3, H, W]`` float32 on the CPU in [0, 1]: :func:`generate_flux_latents`,
    decoded by the VAE (its scale and shift undone)."""
    latents = generate_flux_latents(backbone, prompts, **options)
    with eval_mode(*backbone.modules().values()):
        return backbone.decode_latents(latents)
