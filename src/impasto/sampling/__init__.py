"""Sampling: timestep ladders, ODE samplers, classifier-free guidance and SDXL generation.

``schedules``, ``samplers``, ``guidance`` and ``denoisers`` are pure tensor functions (torch
only, k-diffusion style); ``generate`` composes them with the SDXL components.
"""

from impasto.sampling.denoisers import PREDICTION_TYPES, denoised_from_prediction, vp_denoiser
from impasto.sampling.generate import (
    UNetConditioning,
    decode_latents,
    draw_noise,
    eval_mode,
    generate,
    generate_latents,
    image_generators,
    initial_noise,
    latent_shape,
    make_grid,
    noise_source,
    sdxl_alphas_cumprod,
    sdxl_conditioning,
    to_pil,
    unet_forward,
)
from impasto.sampling.guidance import cfg, guided_output, rescale_cfg
from impasto.sampling.samplers import (
    SAMPLERS,
    Denoiser,
    NoiseFn,
    SamplerSpec,
    get_sampler,
    sample_ddim,
    sample_dpmpp_2m,
    sample_euler,
    sample_euler_ancestral,
)
from impasto.sampling.schedules import (
    DPM_SPACINGS,
    FINAL_SIGMAS,
    SPACINGS,
    initial_noise_scale,
    karras_ladder,
    sampling_timesteps,
    sigmas_for_timesteps,
)

__all__ = [
    "DPM_SPACINGS",
    "FINAL_SIGMAS",
    "PREDICTION_TYPES",
    "SAMPLERS",
    "SPACINGS",
    "Denoiser",
    "NoiseFn",
    "SamplerSpec",
    "UNetConditioning",
    "cfg",
    "decode_latents",
    "denoised_from_prediction",
    "draw_noise",
    "eval_mode",
    "generate",
    "generate_latents",
    "get_sampler",
    "guided_output",
    "image_generators",
    "initial_noise",
    "initial_noise_scale",
    "karras_ladder",
    "latent_shape",
    "make_grid",
    "noise_source",
    "rescale_cfg",
    "sample_ddim",
    "sample_dpmpp_2m",
    "sample_euler",
    "sample_euler_ancestral",
    "sampling_timesteps",
    "sdxl_alphas_cumprod",
    "sdxl_conditioning",
    "sigmas_for_timesteps",
    "to_pil",
    "unet_forward",
    "vp_denoiser",
]
