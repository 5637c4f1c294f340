"""Flow matching / rectified flow in the SD3 convention (Esser et al. 2024, arXiv:2403.03206).

x_t = (1 − t)·x0 + t·ε with t ∈ [0, 1], t = 1 pure noise; the model predicts the velocity
ε − x0 (so x̂0 = x_t − t·v̂); the UNet's time input is t·1000, as diffusers'
``FlowMatchEulerDiscreteScheduler`` (DESIGN §5). Shapes: x0, ε [B, C, H, W]; t float [B].
Draw t with ``FLOW_TIME_SAMPLERS``; weight the loss with ``FLOW_LOSS_WEIGHTINGS``.
"""

from __future__ import annotations

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
