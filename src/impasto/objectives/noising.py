"""Forward noising and prediction targets of the DDPM (VP) objectives.

Pure functions: tensors in, tensors out. Shapes: latents x0 and noise ε are [B, C, H, W];
timesteps are int64 [B] indices into ᾱ.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def _per_sample(values: Tensor, like: Tensor) -> Tensor:
    """Gather-free broadcast of a [B] vector against a [B, ...] tensor."""
    return values.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


def add_noise(x0: Tensor, noise: Tensor, timesteps: Tensor, alphas_cumprod: Tensor) -> Tensor:
    """x_t = sqrt(ᾱ_t)·x0 + sqrt(1 − ᾱ_t)·ε (Ho et al. 2020, eq. 4)."""
    alpha_bar = alphas_cumprod.to(x0.device)[timesteps]
    return _per_sample(alpha_bar.sqrt(), x0) * x0 + _per_sample((1 - alpha_bar).sqrt(), x0) * noise


def epsilon_target(x0: Tensor, noise: Tensor, timesteps: Tensor, alphas_cumprod: Tensor) -> Tensor:
    """ε-prediction (SDXL base): the model predicts the added noise."""
    return noise


def v_prediction_target(
    x0: Tensor, noise: Tensor, timesteps: Tensor, alphas_cumprod: Tensor
) -> Tensor:
    """v = sqrt(ᾱ_t)·ε − sqrt(1 − ᾱ_t)·x0 (Salimans & Ho 2022, arXiv:2202.00512, §4).

    In x0 terms its squared error weighs SNR + 1 where ε's weighs SNR, so the high-noise steps
    that decide an image's layout and colours still carry gradient (and SNR = 0 is allowed).
    """
    alpha_bar = alphas_cumprod.to(x0.device)[timesteps]
    return _per_sample(alpha_bar.sqrt(), x0) * noise - _per_sample((1 - alpha_bar).sqrt(), x0) * x0


def sample_target(x0: Tensor, noise: Tensor, timesteps: Tensor, alphas_cumprod: Tensor) -> Tensor:
    """x0-prediction (diffusers' ``"sample"``): the model predicts the clean latents."""
    return x0


# name → target(x0, noise, timesteps, alphas_cumprod). Flow matching has its own noising and
# target (``flow.py``): pairing ``add_noise`` with a flow target would train the wrong path.
PREDICTION_TARGETS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "epsilon": epsilon_target,
    "v_prediction": v_prediction_target,
    "sample": sample_target,
}
