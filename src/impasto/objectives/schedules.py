"""Noise schedules as pure functions (DDPM betas → ᾱ, σ, SNR).

Notation (``../shared/reference/algorithms.md``): ᾱ_t = Π_{i≤t}(1−β_i), σ_t = sqrt((1−ᾱ_t)/ᾱ_t),
SNR_t = ᾱ_t/(1−ᾱ_t) = 1/σ_t². Computed in float64; callers cast where they use them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def scaled_linear_betas(num_train_timesteps: int, beta_start: float, beta_end: float) -> Tensor:
    """SDXL / Stable Diffusion: β = linspace(sqrt(β_start), sqrt(β_end), T)² (Rombach et al.)."""
    return (
        torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float64)
        ** 2
    )


def linear_betas(num_train_timesteps: int, beta_start: float, beta_end: float) -> Tensor:
    """DDPM (Ho et al. 2020, arXiv:2006.11239): β = linspace(β_start, β_end, T)."""
    return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float64)


# name → betas(num_train_timesteps, beta_start, beta_end); issue #4 adds cosine and ZTSNR.
SCHEDULES: dict[str, Callable[[int, float, float], Tensor]] = {
    "scaled_linear": scaled_linear_betas,
    "linear": linear_betas,
}


def training_alphas_cumprod(objective) -> Tensor:
    """ᾱ of the schedule an ``objective`` config section names (any object with its fields)."""
    betas = SCHEDULES[objective.schedule](
        objective.num_train_timesteps, objective.beta_start, objective.beta_end
    )
    return alphas_cumprod_from_betas(betas)


def alphas_cumprod_from_betas(betas: Tensor) -> Tensor:
    """ᾱ_t = Π_{i≤t}(1 − β_i), shape [T]."""
    return torch.cumprod(1.0 - betas, dim=0)


def sigmas_from_alphas_cumprod(alphas_cumprod: Tensor) -> Tensor:
    """The VE-equivalent σ_t = sqrt((1 − ᾱ_t)/ᾱ_t), shape [T]."""
    return ((1.0 - alphas_cumprod) / alphas_cumprod).sqrt()


def snr_from_alphas_cumprod(alphas_cumprod: Tensor) -> Tensor:
    """SNR_t = ᾱ_t/(1 − ᾱ_t), shape [T]."""
    return alphas_cumprod / (1.0 - alphas_cumprod)
