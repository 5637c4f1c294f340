"""ODE samplers over a decreasing noise-level ladder, in the style of k-diffusion.

Every sampler has one signature, ``sample(denoise, x, sigmas, timesteps, *, callback=None)``:

* ``x`` ``[B, C, H, W]`` is the state in VE form, x = x0 + σ·ε (Karras et al. 2022,
  arXiv:2206.00364, eq. 1 with s(t) = 1); for a DDPM model x = x_t/sqrt(ᾱ_t). The caller draws
  the starting noise at ``sigmas[0]``.
* ``sigmas`` ``[n + 1]`` is the noise-level ladder, the last entry the final level (often 0).
* ``timesteps`` ``[n]`` is the model's own time input at each of the first n levels (a DDPM
  UNet is conditioned on t, not σ), passed through to ``denoise``.
* ``denoise(x, sigma, timestep) -> x0_hat`` is any denoiser D(x; σ) (Karras et al. eq. 2): the
  model wrapper hides input scaling, guidance and the prediction type.
* ``callback(i, x, denoised)``, if given, is called after step i with the new state.

The result is the state at ``sigmas[-1]``. Samplers use no randomness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from impasto.sampling.schedules import sampling_timesteps, sigmas_for_timesteps

Denoiser = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x, sigma, timestep) -> x0 estimate
StepCallback = Callable[[int, Tensor, Tensor], None]  # (step index, new x, denoised)
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


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler function and the schedule conventions of its diffusers counterpart."""

    sample: SampleFn
    integer_timesteps: bool  # round fractional (linspace) timesteps: DDIM indexes ᾱ_t
    final_sigma: str  # a key of schedules.FINAL_SIGMAS

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
        divides T, but not for ``linspace`` (where its DDIM skips between grids).
        """
        timesteps = sampling_timesteps(
            num_steps,
            alphas_cumprod.shape[0],
            spacing,
            steps_offset,
            integer=self.integer_timesteps,
        )
        return timesteps, sigmas_for_timesteps(timesteps, alphas_cumprod, self.final_sigma)


# name → sampler; DPM++ 2M and flow Euler join here (DESIGN §4).
SAMPLERS: dict[str, SamplerSpec] = {
    "euler": SamplerSpec(sample_euler, integer_timesteps=False, final_sigma="zero"),
    # final σ_0 = DDIMScheduler(set_alpha_to_one=False), SDXL's scheduler config.
    "ddim": SamplerSpec(sample_ddim, integer_timesteps=True, final_sigma="sigma_min"),
}


def get_sampler(name: str) -> SamplerSpec:
    """The sampler registered as ``name``; an unknown name lists the valid ones."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; valid samplers: {sorted(SAMPLERS)}")
    return SAMPLERS[name]
