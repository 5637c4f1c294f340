"""Turn a DDPM-trained network into a denoiser D(x; σ) for the samplers.

The samplers work in VE form x = x0 + σ·ε; a DDPM network was trained on the VP input
x_t = sqrt(ᾱ)·x0 + sqrt(1 − ᾱ)·ε. With ᾱ = 1/(σ² + 1) the two are related by
x_t = x/sqrt(σ² + 1) (diffusers' ``EulerDiscreteScheduler.scale_model_input``; feeding x
unscaled is a known bug in peer code, DESIGN §5). The network's output is read as x̂0 through
the prediction-type registry, the same names as ``impasto.objectives.PREDICTION_TARGETS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import Tensor

from impasto.sampling.guidance import guided_output
from impasto.sampling.samplers import Denoiser

Conditioning = TypeVar("Conditioning")


def denoised_from_epsilon(model_output: Tensor, x_t: Tensor, alpha_bar: Tensor) -> Tensor:
    """x̂0 = (x_t − sqrt(1 − ᾱ)·ε̂)/sqrt(ᾱ), inverting x_t's definition (Ho et al. 2020, eq. 4)."""
    return (x_t - (1 - alpha_bar).sqrt() * model_output) / alpha_bar.sqrt()


def denoised_from_v(model_output: Tensor, x_t: Tensor, alpha_bar: Tensor) -> Tensor:
    """x̂0 = sqrt(ᾱ)·x_t − sqrt(1 − ᾱ)·v̂ (Salimans & Ho 2022, arXiv:2202.00512, §4)."""
    return alpha_bar.sqrt() * x_t - (1 - alpha_bar).sqrt() * model_output


def denoised_from_sample(model_output: Tensor, x_t: Tensor, alpha_bar: Tensor) -> Tensor:
    """x̂0 is the network output itself."""
    return model_output


# name → x̂0(model_output, x_t, alpha_bar); issue #4 adds flow.
PREDICTION_TYPES: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "epsilon": denoised_from_epsilon,
    "v_prediction": denoised_from_v,
    "sample": denoised_from_sample,
}


def denoised_from_prediction(
    prediction_type: str, model_output: Tensor, x_t: Tensor, alpha_bar: Tensor
) -> Tensor:
    """x̂0 from the network output at VP input ``x_t`` ``[B, C, H, W]`` and ᾱ (0-d or [B, 1, 1, 1]).

    ᾱ may be float64 for accuracy; a 0-d ᾱ does not promote the float32 result.
    """
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(
            f"unknown prediction type {prediction_type!r}; valid types: {sorted(PREDICTION_TYPES)}"
        )
    return PREDICTION_TYPES[prediction_type](model_output, x_t, alpha_bar)


def vp_denoiser(
    model: Callable[[Tensor, Tensor, Conditioning], Tensor],
    cond: Conditioning,
    uncond_and_cond: Conditioning | None = None,
    *,
    guidance_scale: float = 1.0,
    guidance_rescale: float = 0.0,
    prediction_type: str = "epsilon",
) -> Denoiser:
    """D(x; σ, t) for a VP (DDPM) network ``model(x_t, timestep, conditioning) -> output``.

    Guidance (``guidance.guided_output``) is applied to the network output, as diffusers does;
    for the affine prediction types this equals guiding x̂0.
    """
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(
            f"unknown prediction type {prediction_type!r}; valid types: {sorted(PREDICTION_TYPES)}"
        )

    def denoise(x: Tensor, sigma: Tensor, timestep: Tensor) -> Tensor:
        x_t = x / (sigma**2 + 1) ** 0.5
        alpha_bar = 1 / (sigma.double() ** 2 + 1)
        output = guided_output(
            model, x_t, timestep, cond, uncond_and_cond, guidance_scale, guidance_rescale
        )
        return denoised_from_prediction(prediction_type, output, x_t, alpha_bar)

    return denoise
