"""Sampling SD3.5 as ``StableDiffusion3Pipeline`` does, with impasto's flow sampler: the Euler
sampler of :mod:`impasto.sampling` over SD3's time ladder, classifier-free guidance on the
velocity, and optionally skip-layer guidance (SD3.5 Medium's recommended ``skip_layers``
``[7, 8, 9]``).

The ladder comes from diffusers' own ``FlowMatchEulerDiscreteScheduler`` with the model's
scheduler config (SD3.5's: n times from 1 evenly spaced in the unshifted time, shifted by 3),
so it is the pipeline's to the bit. Guidance is the pipeline's: ``v_u + g·(v_c − v_u)`` with
the negative prompt's ``v_u`` (``""`` by default) when g > 1; with ``skip_layers``, for the
steps i with ``start·n < i < stop·n``, ``+ s·(v_c − v_skip)`` where ``v_skip`` is the
conditional velocity with those joint blocks left out.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from impasto.models.sd3.backbone import Sd3Backbone, Sd3Conditioning
from impasto.sampling.generate import draw_noise, eval_mode, image_generators
from impasto.sampling.guidance import cfg
from impasto.sampling.samplers import sample_euler

DEFAULT_STEPS = 28  # StableDiffusion3Pipeline's defaults
DEFAULT_GUIDANCE = 7.0
DEFAULT_SKIP_SCALE = 2.8  # the pipeline's skip_layer_guidance_scale, start and stop
DEFAULT_SKIP_START = 0.01
DEFAULT_SKIP_STOP = 0.2


def sd3_ladder(backbone: Sd3Backbone, num_steps: int) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], ts [n + 1])`` float32: the transformer's time input t·T, and t ending
    at 0 (``StableDiffusion3Pipeline``'s, through diffusers' scheduler)."""
    return backbone.sampling_ladder(num_steps, 0, 0)


def _velocity(backbone: Sd3Backbone, x: Tensor, timestep: Tensor, condition: Sd3Conditioning,
              skip_layers: list[int] | None = None) -> Tensor:  # fmt: skip
    x = x.to(backbone.dtype)
    return backbone.forward(x, timestep.to(x.device), condition, skip_layers).float()


def generate_sd3_latents(
    backbone: Sd3Backbone,
    prompts: list[str],
    *,
    negative_prompt: str = "",
    num_images_per_prompt: int = 1,
    num_steps: int = DEFAULT_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE,
    skip_layers: list[int] | None = None,
    skip_scale: float = DEFAULT_SKIP_SCALE,
    skip_start: float = DEFAULT_SKIP_START,
    skip_stop: float = DEFAULT_SKIP_STOP,
    seed: int = 0,
    height: int = 64,
    width: int = 64,
) -> Tensor:
    """Latents ``[B·k, 16, H/8, W/8]`` float32 on the model's device (not unscaled), rows
    prompt-major; row j starts from the noise of seed + j (``StableDiffusion3Pipeline`` called
    with ``generator=[torch.Generator().manual_seed(seed + j) ...]``)."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if num_images_per_prompt < 1:
        raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
    depth = len(backbone.components.transformer.transformer_blocks)
    if skip_layers is not None and not all(0 <= layer < depth for layer in skip_layers):
        raise ValueError(f"skip_layers must be joint blocks in [0, {depth}), got {skip_layers}")
    shape = backbone.latent_shape(height, width)
    prompts = [prompt for prompt in prompts for _ in range(num_images_per_prompt)]
    timesteps, ts = sd3_ladder(backbone, num_steps)
    device = backbone.device
    guided = guidance_scale > 1.0  # the pipeline's do_classifier_free_guidance
    with torch.no_grad(), eval_mode(*backbone.parts().values()):
        cond = backbone.sampling_condition(prompts, height, width)
        uncond_and_cond = None
        if guided:
            negatives = [negative_prompt] * len(prompts)
            uncond_and_cond = backbone.sampling_condition(negatives, height, width).cat(cond)
        steps = itertools.count()

        def denoise(x: Tensor, t: Tensor, timestep: Tensor) -> Tensor:
            step = next(steps)
            if uncond_and_cond is None:
                return x - t * _velocity(backbone, x, timestep, cond)
            both = _velocity(backbone, torch.cat([x, x]), timestep, uncond_and_cond)
            uncond_v, cond_v = both.chunk(2)
            velocity = cfg(uncond_v, cond_v, guidance_scale)
            if skip_layers is not None and num_steps * skip_start < step < num_steps * skip_stop:
                skipped = _velocity(backbone, x, timestep, cond, skip_layers)
                velocity = velocity + (cond_v - skipped) * skip_scale
            return x - t * velocity

        x = draw_noise(image_generators(len(prompts), seed), shape).to(device)
        return sample_euler(denoise, x, ts.to(device), timesteps.to(device))


def generate_sd3(backbone: Sd3Backbone, prompts: list[str], **options: object) -> Tensor:
    """Images ``[B·k, 3, H, W]`` float32 on the CPU in [0, 1]: :func:`generate_sd3_latents`,
    decoded by the VAE (its scale and shift undone)."""
    latents = generate_sd3_latents(backbone, prompts, **options)
    with eval_mode(*backbone.modules().values()):
        return backbone.decode_latents(latents)
