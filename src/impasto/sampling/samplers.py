"""ODE samplers over a decreasing noise-level ladder, in the style of k-diffusion.

Every sampler has one signature,
``sample(denoise, x, sigmas, timesteps, *, callback=None, noise=None)``:

* ``x`` ``[B, C, H, W]`` is the state in VE form, x = x0 + σ·ε (Karras et al. 2022,
  arXiv:2206.00364, eq. 1 with s(t) = 1); for a DDPM model x = x_t/sqrt(ᾱ_t). The caller draws
  the starting noise at ``sigmas[0]``.
* ``sigmas`` ``[n + 1]`` is the noise-level ladder, the last entry the final level (often 0).
* ``timesteps`` ``[n]`` is the model's own time input at each of the first n levels (a DDPM
  UNet is conditioned on t, not σ), passed through to ``denoise``.
* ``denoise(x, sigma, timestep) -> x0_hat`` is any denoiser D(x; σ) (Karras et al. eq. 2): the
  model wrapper hides input scaling, guidance and the prediction type.
* ``callback(i, x, denoised)``, if given, is called after step i with the new state.
* ``noise()`` returns fresh ε ~ N(0, I) shaped like x, on x's device; stochastic (ancestral)
  samplers require it, deterministic ones ignore it. Samplers draw no randomness of their own.

The result is the state at ``sigmas[-1]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from impasto.sampling.schedules import (
    DPM_SPACINGS,
    SPACINGS,
    SpacingFn,
    karras_ladder,
    sampling_timesteps,
    sigmas_for_timesteps,
)
from impasto.sampling.unipc import sample_unipc

Denoiser = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x, sigma, timestep) -> x0 estimate
StepCallback = Callable[[int, Tensor, Tensor], None]  # (step index, new x, denoised)
NoiseFn = Callable[[], Tensor]  # () -> ε ~ N(0, I) shaped like x
SampleFn = Callable[..., Tensor]


def _check_ladder(sigmas: Tensor, timesteps: Tensor) -> None:
    assert sigmas.ndim == 1 and timesteps.shape == (sigmas.shape[0] - 1,), (
        f"sigmas [n + 1] and timesteps [n] expected, got {tuple(sigmas.shape)} and "
        f"{tuple(timesteps.shape)}"
    )


def sample_euler(
    denoise: Denoiser,
    x: Tensor,
    sigmas: Tensor,
    timesteps: Tensor,
    *,
    callback: StepCallback | None = None,
    noise: NoiseFn | None = None,
) -> Tensor:
    """Euler's method on the probability-flow ODE dx/dσ = (x − D(x; σ))/σ.

    Karras et al. 2022 (arXiv:2206.00364), Algorithm 2 with S_churn = 0 and without the
    second-order correction, i.e. the Euler step of Algorithm 1: diffusers'
    ``EulerDiscreteScheduler`` with its default ``s_churn=0``.
    """
    _check_ladder(sigmas, timesteps)
    for i in range(timesteps.shape[0]):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = denoise(x, sigma, timesteps[i])
        derivative = (x - denoised) / sigma  # = ε̂, the slope of x in σ
        x = x + derivative * (sigma_next - sigma)
        if callback is not None:
            callback(i, x, denoised)
    return x


def sample_ddim(
    denoise: Denoiser,
    x: Tensor,
    sigmas: Tensor,
    timesteps: Tensor,
    *,
    callback: StepCallback | None = None,
    noise: NoiseFn | None = None,
) -> Tensor:
    """Deterministic DDIM (Song, Meng, Ermon 2021, arXiv:2010.02502, eq. 12 with η = 0).

    Eq. 12 is x_prev = sqrt(ᾱ_prev)·x̂0 + sqrt(1 − ᾱ_prev)·ε̂; divided by sqrt(ᾱ_prev) it reads
    x_prev = x̂0 + σ_prev·ε̂ in VE form, with ε̂ = (x − x̂0)/σ. In exact arithmetic this equals
    the Euler step (Song et al. §4.3, eq. 14); what makes "DDIM" differ from "euler" in
    ``SAMPLERS`` is diffusers' ``DDIMScheduler`` ladder: integer timesteps and a final σ_0.
    """
    _check_ladder(sigmas, timesteps)
    for i in range(timesteps.shape[0]):
        sigma, sigma_prev = sigmas[i], sigmas[i + 1]
        denoised = denoise(x, sigma, timesteps[i])
        noise_estimate = (x - denoised) / sigma
        x = denoised + sigma_prev * noise_estimate
        if callback is not None:
            callback(i, x, denoised)
    return x


def sample_euler_ancestral(
    denoise: Denoiser,
    x: Tensor,
    sigmas: Tensor,
    timesteps: Tensor,
    *,
    callback: StepCallback | None = None,
    noise: NoiseFn | None = None,
) -> Tensor:
    """Ancestral sampling with Euler steps: k-diffusion's ``sample_euler_ancestral`` with η = 1.

    Each step from σ to σ' is an Euler step of the probability-flow ODE (Karras et al. 2022,
    arXiv:2206.00364) down to σ_down, then fresh noise of std σ_up back up to σ', with
    σ_down² + σ_up² = σ'² and σ_up = σ'·sqrt(1 − σ'²/σ²): the DDPM ancestral step (Ho et al.
    2020, arXiv:2006.11239, eq. 7, whose posterior std in VE form is σ_up). diffusers'
    ``EulerAncestralDiscreteScheduler``. Two rewrites, equal in exact arithmetic, keep a
    zero-terminal-SNR first step (σ = 20000, σ' ≪ σ) accurate in float32: σ_down = σ'²/σ
    rather than sqrt(σ'² − σ_up²), whose difference can round negative (NaN); and the Euler
    step x + (x − D)/σ·(σ_down − σ) as D + (σ_down/σ)·(x − D), which returns D rather than the
    rounding error of x − (x − D) when σ_down ≈ 0.
    """
    _check_ladder(sigmas, timesteps)
    if noise is None:
        raise ValueError("euler_ancestral is stochastic: pass noise(), a source of fresh ε")
    for i in range(timesteps.shape[0]):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = denoise(x, sigma, timesteps[i])
        ratio = sigma_next / sigma
        sigma_up = sigma_next * (1 - ratio**2).clamp(min=0).sqrt()
        x = denoised + ratio**2 * (x - denoised)  # Euler to σ_down = σ'²/σ: σ_down/σ = ratio²
        if sigma_next > 0:  # the last step to σ = 0 adds no noise (k-diffusion draws none)
            x = x + noise() * sigma_up
        if callback is not None:
            callback(i, x, denoised)
    return x


# diffusers' DPMSolverMultistepScheduler(lower_order_final=True) takes its last step with the
# first-order solver when the ladder ends at σ = 0 or has fewer than this many steps.
LOWER_ORDER_FINAL_BELOW_STEPS = 15


def sample_dpmpp_2m(
    denoise: Denoiser,
    x: Tensor,
    sigmas: Tensor,
    timesteps: Tensor,
    *,
    callback: StepCallback | None = None,
    noise: NoiseFn | None = None,
) -> Tensor:
    """DPM-Solver++(2M) (Lu et al. 2022, arXiv:2211.01095, Algorithm 2) in VE form.

    With λ = −log σ (the half log-SNR) the data-prediction ODE is solved exactly for a
    constant x̂0 = D: x' = D + (σ'/σ)·(x − D), the first-order step (= DDIM). The multistep
    method replaces D by D_i + (D_i − D_{i−1})/(2r), r = h_{i−1}/h_i, h_i = log(σ_i/σ_{i+1}),
    a linear extrapolation of x̂0 in λ from the previous step's estimate (no extra evaluation).
    The first step, and the last when it ends at σ = 0 or the ladder is short, are first
    order: diffusers' ``DPMSolverMultistepScheduler(algorithm_type="dpmsolver++",
    solver_order=2)`` with its default ``lower_order_final`` (k-diffusion's
    ``sample_dpmpp_2m``).
    """
    _check_ladder(sigmas, timesteps)
    num_steps = timesteps.shape[0]
    denoised_previous = None
    for i in range(num_steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = denoise(x, sigma, timesteps[i])
        lower_order_final = i == num_steps - 1 and (
            sigma_next == 0 or num_steps < LOWER_ORDER_FINAL_BELOW_STEPS
        )
        if denoised_previous is None or lower_order_final:
            estimate = denoised
        else:
            ratio = math.log(sigmas[i - 1] / sigma) / math.log(sigma / sigma_next)  # r
            estimate = denoised + (denoised - denoised_previous) / (2 * ratio)
        x = estimate + (sigma_next / sigma) * (x - estimate)
        denoised_previous = denoised
        if callback is not None:
            callback(i, x, denoised)
    return x


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler function and the schedule conventions of its diffusers counterpart."""

    sample: SampleFn
    integer_timesteps: bool  # round fractional (linspace) timesteps: DDIM indexes ᾱ_t
    final_sigma: str  # a key of schedules.FINAL_SIGMAS
    # the registry the spacing name is read from: SPACINGS or DPM-Solver's DPM_SPACINGS
    spacings: Mapping[str, SpacingFn] = field(default_factory=lambda: SPACINGS, hash=False)
    karras: bool = False  # Karras ρ = 7 σ ladder (schedules.karras_ladder); ignores spacing
    stochastic: bool = False  # draws fresh noise each step: needs sample(..., noise=...)

    def schedule(
        self,
        num_steps: int,
        alphas_cumprod: Tensor,
        spacing: str = "leading",
        steps_offset: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """``(timesteps [n], sigmas [n + 1])``, float32, for this sampler on schedule ᾱ [T].

        The step after timesteps[i] goes to timesteps[i + 1]. diffusers' DDIM instead steps
        to t − T // n, the same point for ``leading`` spacing and for ``trailing`` when n
        divides T, but not for ``linspace`` (where its DDIM skips between grids). A Karras
        ladder ignores ``spacing`` and ``steps_offset``, as diffusers does.
        """
        if self.karras:
            return karras_ladder(num_steps, alphas_cumprod, self.final_sigma)
        timesteps = sampling_timesteps(
            num_steps,
            alphas_cumprod.shape[0],
            spacing,
            steps_offset,
            integer=self.integer_timesteps,
            spacings=self.spacings,
        )
        return timesteps, sigmas_for_timesteps(timesteps, alphas_cumprod, self.final_sigma)


# name → sampler; flow Euler joins here (DESIGN §4).
SAMPLERS: dict[str, SamplerSpec] = {
    "euler": SamplerSpec(sample_euler, integer_timesteps=False, final_sigma="zero"),
    # final σ_0 = DDIMScheduler(set_alpha_to_one=False), SDXL's scheduler config.
    "ddim": SamplerSpec(sample_ddim, integer_timesteps=True, final_sigma="sigma_min"),
    "euler_ancestral": SamplerSpec(
        sample_euler_ancestral, integer_timesteps=False, final_sigma="zero", stochastic=True
    ),
    "dpmpp_2m": SamplerSpec(
        sample_dpmpp_2m, integer_timesteps=True, final_sigma="zero", spacings=DPM_SPACINGS
    ),
    "dpmpp_2m_karras": SamplerSpec(
        sample_dpmpp_2m, integer_timesteps=True, final_sigma="zero", karras=True
    ),
    # diffusers' UniPCMultistepScheduler spaces its timesteps as DPM-Solver does
    "unipc": SamplerSpec(
        sample_unipc, integer_timesteps=True, final_sigma="zero", spacings=DPM_SPACINGS
    ),
}


def get_sampler(name: str) -> SamplerSpec:
    """The sampler registered as ``name``; an unknown name lists the valid ones."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; valid samplers: {sorted(SAMPLERS)}")
    return SAMPLERS[name]
