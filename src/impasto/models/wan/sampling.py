"""Sampling Wan 2.1 as ``WanPipeline`` does: diffusers' own ``UniPCMultistepScheduler`` with the
model's scheduler config (Wan2.1's: flow sigmas shifted by ``flow_shift`` 3.0; 5.0 for 720p),
driven step by step as the pipeline drives it, classifier-free guidance on the velocity with
the negative prompt (``""`` by default; Wan's recommended one is long, docs/wan.md):
``v_u + g·(v_c − v_u)`` for g > 1, the conditional and unconditional branches run one after the
other as the pipeline runs them.

``impasto sample`` (the generic sampler, :mod:`impasto.sampling`) samples this family with
its flow samplers on the same ladder (:func:`wan_ladder`, through the backbone's
``sampling_ladder``); :func:`generate_wan` is the pipeline's sampler to the bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from impasto.models.wan.backbone import WanBackbone
from impasto.sampling.generate import draw_noise, eval_mode, image_generators

DEFAULT_STEPS = 50  # WanPipeline's defaults
DEFAULT_GUIDANCE = 5.0


def wan_ladder(backbone: WanBackbone, num_steps: int) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], ts [n + 1])`` float32: the transformer's time input t·T, and t ending
    at 0 (WanPipeline's scheduler's)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = backbone.components.scheduler()
    scheduler.set_timesteps(num_steps)
    return scheduler.timesteps.float(), scheduler.sigmas.float()


def _velocity(backbone: WanBackbone, x: Tensor, timestep: Tensor, condition) -> Tensor:
    return backbone.forward(x.to(backbone.dtype), timestep.to(x.device), condition).float()


def generate_wan_latents(
    backbone: WanBackbone,
    prompts: list[str],
    *,
    negative_prompt: str = "",
    num_videos_per_prompt: int = 1,
    num_steps: int = DEFAULT_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE,
    seed: int = 0,
    height: int = 480,
    width: int = 832,
    frames: int = 81,
) -> Tensor:
    """Latents ``[B·k, 16, 1 + (frames − 1)/4, H/8, W/8]`` float32 on the model's device (not
    unscaled), rows prompt-major; row j starts from the noise of seed + j (``WanPipeline``
    called with ``generator=[torch.Generator().manual_seed(seed + j) ...]``)."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if num_videos_per_prompt < 1:
        raise ValueError(f"num_videos_per_prompt must be >= 1, got {num_videos_per_prompt}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    shape = backbone.latent_shape(height, width, frames)
    prompts = [prompt for prompt in prompts for _ in range(num_videos_per_prompt)]
    device = backbone.device
    scheduler = backbone.components.scheduler()
    scheduler.set_timesteps(num_steps, device=device)
    scheduler.set_begin_index(0)
    guided = guidance_scale > 1.0  # the pipeline's do_classifier_free_guidance
    with torch.no_grad(), eval_mode(*backbone.parts().values()):
        cond = backbone.sampling_condition(prompts, height, width)
        uncond = None
        if guided:
            uncond = backbone.sampling_condition([negative_prompt] * len(prompts), height, width)
        x = draw_noise(image_generators(len(prompts), seed), shape).to(device)
        for timestep in scheduler.timesteps:
            velocity = _velocity(backbone, x, timestep, cond)
            if uncond is not None:
                uncond_v = _velocity(backbone, x, timestep, uncond)
                velocity = uncond_v + guidance_scale * (velocity - uncond_v)
            x = scheduler.step(velocity, timestep, x, return_dict=False)[0]
        return x


def generate_wan(backbone: WanBackbone, prompts: list[str], **options: object) -> Tensor:
    """Clips ``[B·k, 3, frames, H, W]`` float32 on the CPU in [0, 1]:
    :func:`generate_wan_latents`, decoded by the VAE (WanPipeline's latent map undone)."""
    latents = generate_wan_latents(backbone, prompts, **options)
    with eval_mode(*backbone.modules().values()):
        return backbone.decode_latents(latents)
