"""Noise schedules as pure functions (DDPM betas → ᾱ, σ, SNR), zero terminal SNR, Karras sigmas.

Notation (``../shared/reference/algorithms.md``): ᾱ_t = Π_{i≤t}(1−β_i), σ_t = sqrt((1−ᾱ_t)/ᾱ_t),
SNR_t = ᾱ_t/(1−ᾱ_t) = 1/σ_t². Computed in float64; callers cast where they use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

# NovelAI Diffusion V3 (Ossa et al. 2024, arXiv:2409.15997, §2.2) stands in σ ≈ 20000 for the
# infinite σ of a zero-terminal-SNR schedule.
DEFAULT_TERMINAL_SIGMA = 20000.0


def scaled_linear_betas(num_train_timesteps: int, beta_start: float, beta_end: float) -> Tensor:
    """SDXL / Stable Diffusion: β = linspace(sqrt(β_start), sqrt(β_end), T)² (Rombach et al.)."""
    return (
        torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float64)
        ** 2
    )


def linear_betas(num_train_timesteps: int, beta_start: float, beta_end: float) -> Tensor:
    """DDPM (Ho et al. 2020, arXiv:2006.11239): β = linspace(β_start, β_end, T)."""
    return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float64)


def cosine_betas(
    num_train_timesteps: int, beta_start: float, beta_end: float, max_beta: float = 0.999
) -> Tensor:
    """Nichol & Dhariwal 2021 (arXiv:2102.09672, eq. 17): ᾱ(t) = cos²((t/T + s)/(1 + s)·π/2).

    β_i = min(1 − ᾱ((i+1)/T)/ᾱ(i/T), max_beta) with s = 0.008, as diffusers' "squaredcos_cap_v2";
    ``beta_start`` and ``beta_end`` are unused (kept for the registry's signature).
    """
    steps = torch.arange(num_train_timesteps + 1, dtype=torch.float64) / num_train_timesteps
    alpha_bar = torch.cos((steps + 0.008) / 1.008 * math.pi / 2) ** 2
    return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=max_beta)


# name → betas(num_train_timesteps, beta_start, beta_end).
SCHEDULES: dict[str, Callable[[int, float, float], Tensor]] = {
    "scaled_linear": scaled_linear_betas,
    "linear": linear_betas,
    "cosine": cosine_betas,
}


def rescale_zero_terminal_snr(betas: Tensor) -> Tensor:
    """Lin et al. 2023 (arXiv:2305.08891), Algorithm 1: betas whose terminal SNR is exactly 0.

    sqrt(ᾱ) is shifted so its last value is 0 and scaled so its first is unchanged; then the
    betas are recovered from the new ᾱ. β_{T−1} becomes 1, so ᾱ_{T−1} = 0 exactly.
    """
    alphas_bar_sqrt = alphas_cumprod_from_betas(betas).sqrt()
    first, last = alphas_bar_sqrt[0].clone(), alphas_bar_sqrt[-1].clone()
    alphas_bar_sqrt = (alphas_bar_sqrt - last) * first / (first - last)
    alphas_bar = alphas_bar_sqrt**2
    alphas = torch.cat([alphas_bar[:1], alphas_bar[1:] / alphas_bar[:-1]])
    return 1 - alphas


def training_alphas_cumprod(objective) -> Tensor:
    """ᾱ of the schedule an ``objective`` config section names (any object with its fields).

    Reads ``schedule``, ``num_train_timesteps``, ``beta_start``, ``beta_end`` and, optionally,
    ``zero_terminal_snr`` (default False) and ``terminal_sigma`` (default 20000). With zero
    terminal SNR the terminal ᾱ = 0 is replaced by 1/(σ_term² + 1), so every σ is finite; this
    requires v-prediction (DESIGN §5; ε is trivially x_T at SNR = 0).
    """
    betas = SCHEDULES[objective.schedule](
        objective.num_train_timesteps, objective.beta_start, objective.beta_end
    )
    if not getattr(objective, "zero_terminal_snr", False):
        return alphas_cumprod_from_betas(betas)
    prediction_type = getattr(objective, "prediction_type", "v_prediction")
    if prediction_type != "v_prediction":
        raise ValueError(
            f"zero_terminal_snr needs prediction_type 'v_prediction', got {prediction_type!r}"
        )
    alphas_cumprod = alphas_cumprod_from_betas(rescale_zero_terminal_snr(betas))
    terminal_sigma = getattr(objective, "terminal_sigma", DEFAULT_TERMINAL_SIGMA)
    return finite_terminal_alphas_cumprod(alphas_cumprod, terminal_sigma)


def alphas_cumprod_from_betas(betas: Tensor) -> Tensor:
    """ᾱ_t = Π_{i≤t}(1 − β_i), shape [T]."""
    return torch.cumprod(1.0 - betas, dim=0)


def sigmas_from_alphas_cumprod(alphas_cumprod: Tensor) -> Tensor:
    """The VE-equivalent σ_t = sqrt((1 − ᾱ_t)/ᾱ_t), shape [T] (∞ where ᾱ_t = 0)."""
    return ((1.0 - alphas_cumprod) / alphas_cumprod).sqrt()


def alphas_cumprod_from_sigmas(sigmas: Tensor) -> Tensor:
    """The inverse of :func:`sigmas_from_alphas_cumprod`: ᾱ = 1/(σ² + 1)."""
    return 1.0 / (sigmas**2 + 1.0)


def snr_from_alphas_cumprod(alphas_cumprod: Tensor) -> Tensor:
    """SNR_t = ᾱ_t/(1 − ᾱ_t), shape [T]."""
    return alphas_cumprod / (1.0 - alphas_cumprod)


def finite_terminal_sigmas(
    alphas_cumprod: Tensor, terminal_sigma: float = DEFAULT_TERMINAL_SIGMA
) -> Tensor:
    """σ_t of :func:`sigmas_from_alphas_cumprod` with an infinite σ (ᾱ = 0) set to a finite value.

    A zero-terminal-SNR schedule has σ_{T−1} = ∞; NovelAI V3 uses σ ≈ 20000 in its place
    (diffusers' Euler uses ᾱ = 2⁻²⁴, σ ≈ 4096). Finite sigmas are left as they are.
    """
    sigmas = sigmas_from_alphas_cumprod(alphas_cumprod)
    return torch.where(torch.isinf(sigmas), torch.full_like(sigmas, terminal_sigma), sigmas)


def finite_terminal_alphas_cumprod(
    alphas_cumprod: Tensor, terminal_sigma: float = DEFAULT_TERMINAL_SIGMA
) -> Tensor:
    """ᾱ with ᾱ = 0 replaced by 1/(σ_term² + 1), the ᾱ of :func:`finite_terminal_sigmas`."""
    terminal = alphas_cumprod_from_sigmas(torch.full_like(alphas_cumprod, terminal_sigma))
    return torch.where(alphas_cumprod == 0, terminal, alphas_cumprod)


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> Tensor:
    """Karras et al. 2022 (arXiv:2206.00364, eq. 5): σ_i = (σ_max^{1/ρ} + i/(n−1)·(σ_min^{1/ρ} −
    σ_max^{1/ρ}))^ρ for i = 0 … n−1, descending float64 [n]. A sampler appends σ = 0.
    """
    ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    max_inv_rho, min_inv_rho = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def sigma_to_timestep(sigmas: Tensor, alphas_cumprod: Tensor) -> Tensor:
    """The fractional timestep of each σ: linear interpolation in log σ between training steps.

    As diffusers' ``EulerDiscreteScheduler._sigma_to_t`` (k-diffusion ``sigma_to_t``); σ outside
    the training range clamps to t = 0 or T−1. Needs finite training sigmas (use
    :func:`finite_terminal_alphas_cumprod` for a zero-terminal-SNR schedule). Float64, σ's shape.
    """
    log_sigmas = sigmas_from_alphas_cumprod(alphas_cumprod.double()).log()  # ascending, [T]
    log_sigma = sigmas.double().clamp(min=1e-10).log().to(log_sigmas.device)
    low = (torch.searchsorted(log_sigmas, log_sigma, right=True) - 1).clamp(0, len(log_sigmas) - 2)
    low_value, high_value = log_sigmas[low], log_sigmas[low + 1]
    weight = ((low_value - log_sigma) / (low_value - high_value)).clamp(0, 1)
    return low + weight


def timestep_to_sigma(timesteps: Tensor, alphas_cumprod: Tensor) -> Tensor:
    """σ at fractional timesteps in [0, T−1], interpolating log σ (k-diffusion ``t_to_sigma``).

    The exact inverse of :func:`sigma_to_timestep` inside the training range. (The samplers in
    ``impasto.sampling`` interpolate σ itself, as diffusers' Euler does; equal at integer t.)
    """
    log_sigmas = sigmas_from_alphas_cumprod(alphas_cumprod.double()).log()
    times = timesteps.double().to(log_sigmas.device)
    low = times.floor().long().clamp(0, len(log_sigmas) - 2)
    weight = times - low
    return ((1 - weight) * log_sigmas[low] + weight * log_sigmas[low + 1]).exp()
