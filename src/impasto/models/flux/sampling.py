"""Sampling FLUX.1 as ``FluxPipeline`` does, in Python, with its keyword names: impasto's Euler
flow sampler and flow denoiser over FLUX's ladder (:mod:`.ladder`), the guidance embedding's
value ``guidance_scale`` (FLUX.1-dev), one forward per step, and optionally classifier-free
guidance with a negative prompt at ``true_cfg_scale`` (``FluxPipeline``'s).

``impasto sample`` and a run's validation grids reach the same ladder and guidance through the
backbone's ``sampling_ladder`` and ``embedded_guidance`` hooks and the generic
:func:`impasto.sampling.generate` (with ``sample.guidance_scale`` as the embedding's value and
no classifier-free guidance, FluxPipeline's defaults); this module adds ``true_cfg_scale``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.ladder import flux_mu
from impasto.models.flux.options import DEFAULT_GUIDANCE
from impasto.sampling import generate_latents
from impasto.sampling.flow import flow_denoiser
from impasto.sampling.generate import draw_noise, eval_mode, image_generators, model_forward
from impasto.sampling.samplers import sample_euler

DEFAULT_STEPS = 28  # FluxPipeline's documented FLUX.1-dev setting (schnell: 4)

__all__ = ["DEFAULT_STEPS", "flux_ladder", "flux_mu", "generate_flux", "generate_flux_latents"]


def flux_ladder(
    backbone: FluxBackbone, num_steps: int, height: int, width: int
) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], ts [n + 1])`` float32 of an H×W image (``FluxPipeline``'s)."""
    return backbone.sampling_ladder(num_steps, height, width)


def generate_flux_latents(
    backbone: FluxBackbone,
    prompts: list[str],
    *,
    negative_prompt: str = "",
    num_images_per_prompt: int = 1,
    num_steps: int = DEFAULT_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE,
    true_cfg_scale: float = 1.0,
    seed: int = 0,
    height: int = 64,
    width: int = 64,
) -> Tensor:
    """Latents ``[B·k, 16, H/8, W/8]`` float32 on the model's device (not unscaled), rows
    prompt-major; row j starts from the noise of seed + j (``FluxPipeline`` called with
    ``generator=[torch.Generator().manual_seed(seed + j) ...]``)."""
    if true_cfg_scale == 1.0:  # what impasto sample runs: the generic sampler, the hooks
        return generate_latents(
            backbone, prompts, num_images_per_prompt=num_images_per_prompt,
            num_steps=num_steps, guidance_scale=guidance_scale, seed=seed, height=height,
            width=width, prediction_type="flow", sampler="euler",
        )  # fmt: skip
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if num_images_per_prompt < 1:
        raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
    shape = backbone.latent_shape(height, width)
    prompts = [prompt for prompt in prompts for _ in range(num_images_per_prompt)]
    timesteps, ts = backbone.sampling_ladder(num_steps, height, width)
    device = backbone.device
    with torch.no_grad(), eval_mode(*backbone.parts().values()):
        cond = backbone.sampling_condition(prompts, height, width)
        cond = backbone.embedded_guidance(cond, guidance_scale)
        negatives = [negative_prompt] * len(prompts)
        uncond = backbone.sampling_condition(negatives, height, width)
        uncond_and_cond = backbone.embedded_guidance(uncond, guidance_scale).cat(cond)
        denoise = flow_denoiser(
            model_forward(backbone), cond, uncond_and_cond, guidance_scale=true_cfg_scale
        )
        x = draw_noise(image_generators(len(prompts), seed), shape).to(device)
        return sample_euler(denoise, x, ts.to(device), timesteps.to(device))


def generate_flux(backbone: FluxBackbone, prompts: list[str], **options: object) -> Tensor:
    """Images ``[B·k, 3, H, W]`` float32 on the CPU in [0, 1]: :func:`generate_flux_latents`,
    decoded by the VAE (its scale and shift undone)."""
    latents = generate_flux_latents(backbone, prompts, **options)
    with eval_mode(*backbone.modules().values()):
        return backbone.decode_latents(latents)
