"""diffusers reference objects shared by the sampling tests: SDXL's schedulers for each
impasto sampler, and the SDXL pipeline built from impasto's components."""

from __future__ import annotations

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
)

from impasto.models import SDXLComponents, sdxl_scheduler, to_pipeline

PROMPTS = ["a red circle on a white background", "a blue square"]
NEGATIVE = "blurry, low quality"
# Latents of the random tiny UNet reach |x| ≈ 20; sampling in VE form vs diffusers' algebra
# differs by float32 rounding only (~1e-6 relative), a wrong step is off by O(1).
LATENT_TOL = {"rtol": 1e-5, "atol": 1e-4}


def euler(spacing: str = "leading", prediction_type: str = "epsilon") -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler.from_config(
        sdxl_scheduler().config, timestep_spacing=spacing, prediction_type=prediction_type
    )


def ddim(spacing: str = "leading", prediction_type: str = "epsilon") -> DDIMScheduler:
    """DDIM with SDXL's scheduler config (no sample clipping, final ᾱ = ᾱ_0)."""
    return DDIMScheduler.from_config(
        sdxl_scheduler().config,
        timestep_spacing=spacing,
        set_alpha_to_one=False,
        clip_sample=False,
        prediction_type=prediction_type,
    )


def euler_ancestral(spacing: str = "leading", prediction_type: str = "epsilon"):
    return EulerAncestralDiscreteScheduler.from_config(
        sdxl_scheduler().config, timestep_spacing=spacing, prediction_type=prediction_type
    )


def dpmpp_2m(spacing: str = "leading", prediction_type: str = "epsilon"):
    """DPM-Solver++(2M) with its defaults (lower_order_final, final σ 0) on SDXL's schedule."""
    return DPMSolverMultistepScheduler.from_config(
        sdxl_scheduler().config,
        timestep_spacing=spacing,
        prediction_type=prediction_type,
        algorithm_type="dpmsolver++",
        solver_order=2,
    )


def dpmpp_2m_karras(spacing: str = "leading", prediction_type: str = "epsilon"):
    return DPMSolverMultistepScheduler.from_config(
        dpmpp_2m(spacing, prediction_type).config, use_karras_sigmas=True
    )


# impasto sampler name → its diffusers scheduler with SDXL's config.
SCHEDULERS = {
    "euler": euler,
    "ddim": ddim,
    "euler_ancestral": euler_ancestral,
    "dpmpp_2m": dpmpp_2m,
    "dpmpp_2m_karras": dpmpp_2m_karras,
}


def generators(num_images: int, seed: int) -> list[torch.Generator]:
    """One generator per image, seed + i: what impasto's per-image seeds correspond to."""
    return [torch.Generator().manual_seed(seed + i) for i in range(num_images)]


def pipeline(tiny: SDXLComponents, scheduler) -> StableDiffusionXLPipeline:
    pipe = to_pipeline(tiny)
    pipe.scheduler = scheduler
    pipe.watermark = None
    pipe.set_progress_bar_config(disable=True)
    return pipe
