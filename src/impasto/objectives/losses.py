"""Per-sample losses [B] in fp32, an optional loss mask, and the Huber threshold schedules.

Every loss has the signature ``loss(prediction, target, *, huber_c=None, mask=None) -> [B]``:
prediction and target [B, C, H, W]; ``huber_c`` a float or [B] (the Huber losses need it, the
others ignore it); ``mask`` [B, 1, H, W] in [0, 1], the loss then being the mean over the mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from impasto.objectives.noising import _per_sample


def _reduce(elementwise: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over all non-batch dims, or over the mask (weighted by it, broadcast over C)."""
    if mask is None:
        return elementwise.flatten(1).mean(dim=1)
    batch_size, _, height, width = elementwise.shape
    if mask.shape != (batch_size, 1, height, width):
        raise ValueError(
            f"loss mask must have shape {(batch_size, 1, height, width)}, got {tuple(mask.shape)}"
        )
    weights = mask.to(elementwise.dtype).expand_as(elementwise)
    total = (elementwise * weights).flatten(1).sum(dim=1)
    # An all-zero mask gives 0 (and a zero gradient), not 0/0.
    return total / weights.flatten(1).sum(dim=1).clamp(min=torch.finfo(weights.dtype).eps)


def _error(prediction: Tensor, target: Tensor) -> Tensor:
    return prediction.float() - target.float()


def _threshold(huber_c: Tensor | float | None, like: Tensor) -> Tensor:
    if huber_c is None:
        raise ValueError("the Huber losses need huber_c (see HUBER_C_SCHEDULES)")
    values = torch.as_tensor(huber_c, dtype=torch.float32, device=like.device)
    return _per_sample(values.expand(like.shape[0]), like)


def mse_loss(
    prediction: Tensor,
    target: Tensor,
    *,
    huber_c: Tensor | float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-sample mean squared error (L2) over all non-batch dims, in fp32. Returns [B]."""
    return _reduce(_error(prediction, target) ** 2, mask)


def l1_loss(
    prediction: Tensor,
    target: Tensor,
    *,
    huber_c: Tensor | float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-sample mean absolute error, in fp32. Returns [B]."""
    return _reduce(_error(prediction, target).abs(), mask)


def huber_loss(
    prediction: Tensor,
    target: Tensor,
    *,
    huber_c: Tensor | float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Huber (1964) with threshold c, scaled by 2 to equal the squared error below c.

    d² where |d| ≤ c, else 2c|d| − c² (= 2 × ``torch.nn.functional.huber_loss(delta=c)``).
    """
    error = _error(prediction, target)
    c = _threshold(huber_c, error)
    elementwise = torch.where(error.abs() <= c, error**2, 2 * c * error.abs() - c**2)
    return _reduce(elementwise, mask)


def pseudo_huber_loss(
    prediction: Tensor,
    target: Tensor,
    *,
    huber_c: Tensor | float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Pseudo-Huber 2c·(sqrt(d² + c²) − c): ≈ d² for |d| ≪ c, ≈ 2c|d| for |d| ≫ c.

    Khrapov et al. 2024, "Improving Diffusion Models's Data-Corruption Resistance using
    Scheduled Pseudo-Huber Loss" (arXiv:2403.16728); kohya's ``--loss_type huber``.
    """
    error = _error(prediction, target)
    c = _threshold(huber_c, error)
    return _reduce(2 * c * (torch.sqrt(error**2 + c**2) - c), mask)


# name → per-sample loss(prediction, target, *, huber_c=None, mask=None) -> [B]. "mse" is L2.
LOSSES: dict[str, Callable[..., Tensor]] = {
    "mse": mse_loss,
    "l1": l1_loss,
    "huber": huber_loss,
    "pseudo_huber": pseudo_huber_loss,
}


def constant_huber_c(fraction: Tensor, sigma: Tensor, huber_c: float) -> Tensor:
    """c(t) = c."""
    return torch.full(fraction.shape, float(huber_c), device=fraction.device)


def exponential_huber_c(fraction: Tensor, sigma: Tensor, huber_c: float) -> Tensor:
    """c(t) = exp(−αt), α = −ln(c)/T, i.e. c^{t/T}: 1 at t = 0 (near L2), c at t = T (kohya)."""
    return float(huber_c) ** fraction.float()


def snr_huber_c(fraction: Tensor, sigma: Tensor, huber_c: float) -> Tensor:
    """c(t) = (1 − c)/(1 + σ_t)² + c: 1 at σ = 0, c as σ → ∞ (kohya's default schedule)."""
    return ((1 - huber_c) / (1 + sigma) ** 2 + huber_c).float()


# name → huber_c(fraction [B], sigma [B], huber_c) -> float32 [B], kohya's --huber_schedule
# (Khrapov et al. 2024; kohya's default c is 0.1). ``fraction`` is t/T in [0, 1] (flow: t), and
# ``sigma`` the noise level 1/sqrt(SNR) at t (flow: t/(1 − t)), so one schedule serves both.
HUBER_C_SCHEDULES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "constant": constant_huber_c,
    "exponential": exponential_huber_c,
    "snr": snr_huber_c,
}
