"""Sampling discretisations of a DDPM-trained model: which timesteps to visit and their sigmas.

A model trained on T discrete timesteps (SDXL: T = 1000, ᾱ from ``scaled_linear`` betas) is
sampled on n ≪ T of them. The three spacings are those of Lin et al. 2023 ("Common Diffusion
Noise Schedules and Sample Steps are Flawed", arXiv:2305.08891, Table 2), computed exactly as
diffusers' ``EulerDiscreteScheduler.set_timesteps`` / ``DDIMScheduler.set_timesteps`` (0.42.1)
do, so results can be compared number for number; ``DPM_SPACINGS`` and :func:`karras_ladder`
are those of ``DPMSolverMultistepScheduler.set_timesteps``. Deliberate differences, all where
diffusers returns a broken ladder: for ``trailing`` diffusers' float ``np.arange`` yields
n + 1 values (the last one −1) for some n (61, 103, 121, …), here there are always exactly n;
``linspace`` with n = 1 (diffusers: only t = 0), ``leading`` timesteps past T − 1 (n = T with
offset 1) and DPM-Solver's ``leading`` with n = T (a zero step) raise ``ValueError``.

Notation as in ``impasto.objectives``: σ_t = sqrt((1 − ᾱ_t)/ᾱ_t), the VE-equivalent noise level
(Karras et al. 2022, arXiv:2206.00364), so that x_t/sqrt(ᾱ_t) = x0 + σ_t·ε.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from impasto.objectives import karras_sigmas, sigma_to_timestep, sigmas_from_alphas_cumprod

SpacingFn = Callable[[int, int, int], Tensor]  # (num_steps, num_train_timesteps, steps_offset)


def leading_timesteps(num_steps: int, num_train_timesteps: int, steps_offset: int) -> Tensor:
    """k·(T // n) + offset for k = n−1 … 0 (DDIM's and SDXL's default; never visits t = T−1)."""
    step_ratio = num_train_timesteps // num_steps
    return torch.arange(num_steps - 1, -1, -1, dtype=torch.float64) * step_ratio + steps_offset


def trailing_timesteps(num_steps: int, num_train_timesteps: int, steps_offset: int) -> Tensor:
    """round(T − k·T/n) − 1 for k = 0 … n−1: starts at t = T−1 (``steps_offset`` is unused).

    Built with ``np.arange`` like diffusers, whose float rounding decides the ties at .5.
    """
    step_ratio = num_train_timesteps / num_steps
    grid = np.arange(num_train_timesteps, 0, -step_ratio)[:num_steps]
    return torch.from_numpy(grid).round() - 1  # round half to even, as np.round


def linspace_timesteps(num_steps: int, num_train_timesteps: int, steps_offset: int) -> Tensor:
    """linspace(0, T−1, n) reversed, fractional (``steps_offset`` is unused).

    Euler interpolates σ at these fractional times; DDIM, which indexes ᾱ, rounds them. Built
    with ``np.linspace`` like diffusers, whose float rounding decides DDIM's ties at .5.
    """
    if num_steps < 2:
        raise ValueError(
            "linspace spacing needs num_steps >= 2 (one step would visit only t = 0); "
            "use trailing spacing for one-step sampling"
        )
    grid = np.linspace(0, num_train_timesteps - 1, num_steps)[::-1].copy()
    return torch.from_numpy(grid)


# name → timesteps(num_steps, num_train_timesteps, steps_offset), descending float64 [n].
SPACINGS: dict[str, SpacingFn] = {
    "leading": leading_timesteps,
    "trailing": trailing_timesteps,
    "linspace": linspace_timesteps,
}


def dpm_leading_timesteps(num_steps: int, num_train_timesteps: int, steps_offset: int) -> Tensor:
    """k·(T // (n + 1)) + offset for k = n … 1: ``leading`` on n + 1 points, the lowest dropped.

    diffusers' ``DPMSolverMultistepScheduler`` spaces n + 1 points and lets the final σ take the
    place of the lowest one, so SDXL's 30 steps run from t = 961 down to t = 33 (Euler's and
    DDIM's from 958 to 1).
    """
    if num_train_timesteps // (num_steps + 1) == 0:
        raise ValueError(
            f"DPM-Solver's leading spacing needs num_steps < {num_train_timesteps} "
            f"(T // (n + 1) is its step), got {num_steps}"
        )
    return leading_timesteps(num_steps + 1, num_train_timesteps, steps_offset)[:-1]


def dpm_linspace_timesteps(num_steps: int, num_train_timesteps: int, steps_offset: int) -> Tensor:
    """linspace(0, T−1, n + 1) reversed without its last point (t = 0), fractional.

    As diffusers' ``DPMSolverMultistepScheduler``, which then rounds them (``integer=True``).
    """
    return linspace_timesteps(num_steps + 1, num_train_timesteps, steps_offset)[:-1]


# DPM-Solver's own grids (diffusers 0.42.1); its trailing spacing is Euler's.
DPM_SPACINGS: dict[str, SpacingFn] = {
    "leading": dpm_leading_timesteps,
    "trailing": trailing_timesteps,
    "linspace": dpm_linspace_timesteps,
}


def sampling_timesteps(
    num_steps: int,
    num_train_timesteps: int,
    spacing: str = "leading",
    steps_offset: int = 1,
    *,
    integer: bool = False,
    spacings: Mapping[str, SpacingFn] = SPACINGS,
) -> Tensor:
    """The n model times to visit, descending, as float32 ``[n]`` (the UNet's time input).

    Integer-valued for ``leading`` and ``trailing``; fractional for ``linspace`` (rounded to
    float32 like diffusers' Euler ``np.linspace(..., dtype=np.float32)``, so σ is interpolated
    at the same points) unless ``integer`` (DDIM: rounded to the nearest training timestep).
    SDXL's scheduler config: ``spacing="leading"``, ``steps_offset=1``. ``spacings`` is the
    registry to read ``spacing`` from: ``SPACINGS`` (Euler, DDIM) or ``DPM_SPACINGS``.
    """
    if spacing not in spacings:
        raise ValueError(
            f"unknown timestep spacing {spacing!r}; valid spacings: {sorted(spacings)}"
        )
    if not 1 <= num_steps <= num_train_timesteps:
        raise ValueError(
            f"num_steps must be in [1, {num_train_timesteps}] (the training timesteps), "
            f"got {num_steps}"
        )
    timesteps = spacings[spacing](num_steps, num_train_timesteps, steps_offset)
    if timesteps.max() > num_train_timesteps - 1:
        raise ValueError(
            f"steps_offset={steps_offset} moves the first {spacing} timestep to "
            f"{int(timesteps.max())}, past the last training timestep {num_train_timesteps - 1}"
        )
    if integer:
        timesteps = timesteps.round()  # in float64, before the float32 cast, as diffusers
    return timesteps.to(torch.float32)


def _final_sigma_zero(sigmas_train: Tensor) -> float:
    """End at σ = 0: the last step returns the model's x0 estimate (diffusers' Euler default)."""
    return 0.0


def _final_sigma_min(sigmas_train: Tensor) -> float:
    """End at σ_0, the first training noise level: DDIM with ``set_alpha_to_one=False`` (SDXL)."""
    return float(sigmas_train[0])


# name → final σ given the training sigmas [T]; the names of diffusers' ``final_sigmas_type``.
FINAL_SIGMAS: dict[str, Callable[[Tensor], float]] = {
    "zero": _final_sigma_zero,
    "sigma_min": _final_sigma_min,
}


def sigmas_for_timesteps(
    timesteps: Tensor, alphas_cumprod: Tensor, final_sigma: str = "zero"
) -> Tensor:
    """σ at each (possibly fractional) timestep, then the final σ: float32 ``[n + 1]``.

    σ_t is computed from ᾱ in ᾱ's own dtype and linearly interpolated in t in float64
    (diffusers' ``interpolation_type="linear"``; exact at integer t). With diffusers' float32 ᾱ
    this reproduces ``EulerDiscreteScheduler.sigmas`` bit for bit; impasto's float64 ᾱ is more
    accurate (diffusers' float32 ``1 − ᾱ`` loses ~1e-5 relative at small σ).
    """
    if final_sigma not in FINAL_SIGMAS:
        raise ValueError(
            f"unknown final_sigma {final_sigma!r}; valid values: {sorted(FINAL_SIGMAS)}"
        )
    sigmas_train = sigmas_from_alphas_cumprod(alphas_cumprod).double().cpu()
    num_train_timesteps = sigmas_train.shape[0]
    times = timesteps.double().cpu()
    if times.min() < 0 or times.max() > num_train_timesteps - 1:
        raise ValueError(f"timesteps must lie in [0, {num_train_timesteps - 1}]")
    sigmas = torch.from_numpy(
        np.interp(times.numpy(), np.arange(num_train_timesteps), sigmas_train.numpy())
    )
    final = torch.tensor([FINAL_SIGMAS[final_sigma](sigmas_train)], dtype=torch.float64)
    return torch.cat([sigmas, final]).to(torch.float32)


def karras_ladder(
    num_steps: int, alphas_cumprod: Tensor, final_sigma: str = "zero", rho: float = 7.0
) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], sigmas [n + 1])`` float32: n Karras σ, then the final σ.

    Karras et al. 2022 (arXiv:2206.00364, eq. 5) with ρ = 7 between the schedule's own
    σ_min = σ_0 and σ_max = σ_{T−1}, as diffusers' ``use_karras_sigmas=True``
    (``DPMSolverMultistepScheduler.set_timesteps``, 0.42.1), which discards the spaced
    timesteps: spacing and ``steps_offset`` play no part. Each σ's model time is its log-σ
    interpolated timestep rounded to the nearest integer; the ladder keeps the unrounded σ, so
    the UNet is conditioned on a time whose σ differs slightly from the one the sampler uses
    (as diffusers, except that it skips the rounding for the cosine schedule; here it always
    rounds). σ is computed from ᾱ in ᾱ's own dtype, as :func:`sigmas_for_timesteps`.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if final_sigma not in FINAL_SIGMAS:
        raise ValueError(
            f"unknown final_sigma {final_sigma!r}; valid values: {sorted(FINAL_SIGMAS)}"
        )
    alphas_cumprod = alphas_cumprod.cpu()
    sigmas_train = sigmas_from_alphas_cumprod(alphas_cumprod).double()
    if not torch.isfinite(sigmas_train).all():
        raise ValueError(
            "the Karras ladder needs finite training sigmas; give a zero-terminal-SNR schedule "
            "a finite terminal σ (impasto.objectives.finite_terminal_alphas_cumprod)"
        )
    sigmas = karras_sigmas(float(sigmas_train[0]), float(sigmas_train[-1]), num_steps, rho)
    timesteps = sigma_to_timestep(sigmas, alphas_cumprod).round()  # half to even, as np.round
    final = torch.tensor([FINAL_SIGMAS[final_sigma](sigmas_train)], dtype=torch.float64)
    return timesteps.to(torch.float32), torch.cat([sigmas, final]).to(torch.float32)


def initial_noise_scale(sigma_max: Tensor | float) -> float:
    """Std of x_T in VE form: sqrt(σ_max² + 1), so x_T·sqrt(ᾱ_T) ~ N(0, I) (the DDPM prior).

    Starting noise x = ε·sqrt(σ_max² + 1) is exactly DDIM's (and diffusers Euler's for
    ``leading`` spacing). diffusers' Euler uses σ_max alone for ``linspace``/``trailing``
    (k-diffusion's convention, which neglects the unit data variance: 0.2% less noise at
    σ_max = 14.6); impasto uses the DDPM prior for every spacing.
    """
    return float((float(sigma_max) ** 2 + 1) ** 0.5)
