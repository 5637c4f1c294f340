"""Flow matching / rectified flow in the SD3 convention (Esser et al. 2024, arXiv:2403.03206).

x_t = (1 − t)·x0 + t·ε with t ∈ [0, 1], t = 1 pure noise; the model predicts the velocity
ε − x0 (so x̂0 = x_t − t·v̂); the UNet's time input is t·1000, as diffusers'
``FlowMatchEulerDiscreteScheduler`` (DESIGN §5). Shapes: x0, ε [B, C, H, W]; t float [B].
Draw t with ``FLOW_TIME_SAMPLERS``; weight the loss with ``FLOW_LOSS_WEIGHTINGS``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from impasto.objectives.noising import _per_sample


def add_flow_noise(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """x_t = (1 − t)·x0 + t·ε (diffusers ``FlowMatchEulerDiscreteScheduler.scale_noise``)."""
    t = _per_sample(t.to(x0.device), x0)
    return (1 - t) * x0 + t * noise


def flow_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The velocity dx_t/dt = ε − x0."""
    return noise - x0


def flow_unet_timesteps(t: Tensor, num_train_timesteps: int = 1000) -> Tensor:
    """The UNet's time input, t·T (diffusers: timesteps = sigmas · num_train_timesteps)."""
    return t * num_train_timesteps


def shift_flow_times(t: Tensor, shift: float) -> Tensor:
    """t' = s·t/(1 + (s − 1)·t) (Esser et al. 2024, §5.3.2): s > 1 moves t towards noise.

    The resolution-dependent shift, s = sqrt(m/n) for m vs n pixels; SD3 uses s = 3 at 1024².
    Same as diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s)`` sigmas.
    """
    if shift <= 0:
        raise ValueError(f"flow shift must be > 0, got {shift}")
    return shift * t / (1 + (shift - 1) * t)


def flow_snr(t: Tensor) -> Tensor:
    """SNR of x_t = (1 − t)·x0 + t·ε: ((1 − t)/t)², ∞ at t = 0 and 0 at t = 1."""
    return ((1 - t) / t) ** 2


def shift_for_size(shift: float, height: int, width: int, reference: int | None) -> float:
    """The shift at an H×W image: ``shift`` at reference² pixels, times sqrt(H·W)/reference.

    Esser et al. 2024 (§5.3.2): for m instead of n pixels, shift the time by α = sqrt(m/n); shifts
    compose by multiplying (the shift scales σ/(1 − σ), i.e. SNR by 1/α²). ``reference`` None:
    ``shift`` at every size.
    """
    if reference is None:
        return shift
    return shift * (height * width) ** 0.5 / reference


def unshift_flow_times(t: Tensor, shift: float) -> Tensor:
    """The inverse of :func:`shift_flow_times`: u = t/(s − (s − 1)·t)."""
    return t / (shift - (shift - 1) * t)


def shifted_flow_density(
    density: Callable[..., Tensor], t: Tensor, shift: float, **params: float
) -> Tensor:
    """The density of t = shift_flow_times(u, s) for u ~ ``density``: π(u)·du/dt.

    du/dt = s/(s − (s − 1)·t)², so a shift > 1 moves the mass towards t = 1 (noise).
    """
    return density(unshift_flow_times(t, shift), **params) * shift / (shift - (shift - 1) * t) ** 2
