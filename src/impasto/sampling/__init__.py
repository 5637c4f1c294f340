"""Sampling: timestep ladders, ODE samplers, classifier-free guidance and SDXL generation.

``schedules``, ``samplers``, ``guidance`` and ``denoisers`` are pure tensor functions (torch
only, k-diffusion style); ``process`` holds what differs per kind of model (VP or flow);
``generate`` composes them with any backbone (the protocol of ``impasto.models.backbone``)
without importing a model family. ``prompt_file`` reads prompt files with kohya's per-prompt
options (pure Python); ``grid`` tiles labelled validation grids (PIL).
"""

from impasto.sampling.denoisers import PREDICTION_TYPES, denoised_from_prediction, vp_denoiser
from impasto.sampling.generate import (
    draw_noise,
    eval_mode,
    generate,
    generate_latents,
    image_generators,
    initial_noise,
    make_grid,
    model_forward,
    noise_source,
    sdxl_alphas_cumprod,
    to_pil,
)
from impasto.sampling.grid import CellLabel, labelled_grid
from impasto.sampling.guidance import cfg, guided_output, rescale_cfg
from impasto.sampling.process import (
    SAMPLING_PROCESSES,
    OwnSampling,
    SamplingPlan,
    SamplingRequest,
    flow_plan,
    sampling_plan,
    ve_to_vp,
    vp_plan,
)
from impasto.sampling.prompt_file import (
    PromptOptions,
    SamplePrompt,
    parse_prompt_line,
    read_prompt_file,
)
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
    "SAMPLING_PROCESSES",
    "SPACINGS",
    "CellLabel",
    "Denoiser",
    "NoiseFn",
    "OwnSampling",
    "PromptOptions",
    "SamplePrompt",
    "SamplerSpec",
    "SamplingPlan",
    "SamplingRequest",
    "cfg",
    "denoised_from_prediction",
    "draw_noise",
    "eval_mode",
    "flow_plan",
    "generate",
    "generate_latents",
    "get_sampler",
    "guided_output",
    "image_generators",
    "initial_noise",
    "initial_noise_scale",
    "karras_ladder",
    "labelled_grid",
    "make_grid",
    "model_forward",
    "noise_source",
    "parse_prompt_line",
    "read_prompt_file",
    "rescale_cfg",
    "sample_ddim",
    "sample_dpmpp_2m",
    "sample_euler",
    "sample_euler_ancestral",
    "sampling_plan",
    "sampling_timesteps",
    "sdxl_alphas_cumprod",
    "sigmas_for_timesteps",
    "to_pil",
    "ve_to_vp",
    "vp_denoiser",
    "vp_plan",
]
