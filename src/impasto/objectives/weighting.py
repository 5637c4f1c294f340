"""Per-sample loss weights, float32 [B], to multiply the per-sample losses by.

The SNR-based weightings are published as weights w_ε on the ε-prediction loss. Each objective's
squared error is a multiple of the x0 error: ||ε − ε̂||² = SNR·||x0 − x̂0||², ||v − v̂||² =
(SNR + 1)·||x0 − x̂0||² (Salimans & Ho 2022, arXiv:2202.00512), ||x0 − x̂0||² itself, and for flow
matching (x_t = (1 − t)·x0 + t·ε, target ε − x0, SNR = ((1 − t)/t)²) ||v − v̂||² = ||x0 − x̂0||²/t².
The same weighting of the x0 error on another objective is therefore w_ε·SNR/λ, λ being that
multiple. For min-SNR-γ this gives DESIGN §5: ε min(SNR, γ)/SNR, v min(SNR, γ)/(SNR + 1),
x0 min(SNR, γ). Written so that SNR = 0 (zero terminal SNR) and SNR = ∞ give no NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from impasto.objectives.timesteps import cosmap_density

# prediction type → SNR/λ, the factor from an ε-loss weight to that objective's loss weight.
_FROM_EPSILON: dict[str, Callable[[Tensor], Tensor]] = {
    "epsilon": torch.ones_like,
    "v_prediction": lambda snr: 1 / (1 + 1 / snr),  # SNR/(SNR + 1)
    "sample": lambda snr: snr,
    "flow": lambda snr: 1 / (1 + snr.rsqrt()) ** 2,  # SNR·t² = (1 − t)²
}


def _from_epsilon_weights(epsilon_weights: Tensor, snr: Tensor, prediction_type: str) -> Tensor:
    if prediction_type not in _FROM_EPSILON:
        valid = ", ".join(sorted(_FROM_EPSILON))
        raise ValueError(f"unknown prediction type {prediction_type!r}; valid: {valid}")
    factor = _FROM_EPSILON[prediction_type](snr)
    # factor = 0 (SNR = 0 for v, x0, flow): the loss carries no x0 error to weigh, and the
    # weight's limit is 0 even where w_ε is infinite (debiased, 1/sqrt(SNR)).
    weights = torch.where(factor == 0, torch.zeros_like(factor), epsilon_weights * factor)
    return weights.float()


def no_weighting(snr: Tensor, prediction_type: str) -> Tensor:
    """w = 1."""
    return torch.ones_like(snr, dtype=torch.float32)


def min_snr_weights(snr: Tensor, prediction_type: str, *, gamma: float = 5.0) -> Tensor:
    """Min-SNR-γ (Hang et al. 2023, arXiv:2303.09556): min(SNR, γ) on the x0 error, γ = 5.

    w_ε = min(SNR, γ)/SNR = min(1, γ/SNR), which is 1 at SNR = 0; the v weight there is 0.
    """
    if gamma <= 0:
        raise ValueError(f"min_snr gamma must be > 0, got {gamma}")
    return _from_epsilon_weights((gamma / snr).clamp(max=1), snr, prediction_type)


def debiased_weights(snr: Tensor, prediction_type: str) -> Tensor:
    """Debiased estimation (Yu et al. 2023, arXiv:2310.08442): w_ε = 1/sqrt(min(SNR, 1000)).

    The clamp at 1000 is kohya's (``apply_debiased_estimation``). Other objectives get the same
    x0 weighting, e.g. v: sqrt(SNR)/(SNR + 1) below the clamp (kohya's v form is 1/(SNR + 1)).
    ε at SNR = 0 is infinite: use a finite terminal σ (zero terminal SNR needs v anyway).
    """
    return _from_epsilon_weights(snr.clamp(max=1000).rsqrt(), snr, prediction_type)


def p2_weights(snr: Tensor, prediction_type: str, *, gamma: float = 1.0) -> Tensor:
    """P2 weighting (Choi et al. 2022, arXiv:2204.00227): w_ε = 1/(k + SNR)^γ, k = 1."""
    return _from_epsilon_weights((1 + snr) ** -gamma, snr, prediction_type)


# name → weights(snr [B], prediction_type, **params) -> float32 [B]. prediction_type is a
# PREDICTION_TARGETS name or "flow" (then snr = flow_snr(t)).
LOSS_WEIGHTINGS: dict[str, Callable[..., Tensor]] = {
    "none": no_weighting,
    "min_snr": min_snr_weights,
    "debiased": debiased_weights,
    "p2": p2_weights,
}


def sigma_sqrt_weights(t: Tensor) -> Tensor:
    """SD3's "sigma_sqrt" (diffusers ``compute_loss_weighting_for_sd3``): w = t⁻², t = flow σ."""
    return (t**-2.0).float()


def cosmap_weights(t: Tensor) -> Tensor:
    """SD3's "cosmap": w = 2/(π(1 − 2t + 2t²)), the density of cosmap-sampled t."""
    return cosmap_density(t).float()


def no_flow_weighting(t: Tensor) -> Tensor:
    """w = 1."""
    return torch.ones_like(t, dtype=torch.float32)


# name → weights(t [B]) -> float32 [B], the SD3 weightings of flow-matching losses by t.
FLOW_LOSS_WEIGHTINGS: dict[str, Callable[[Tensor], Tensor]] = {
    "none": no_flow_weighting,
    "sigma_sqrt": sigma_sqrt_weights,
    "cosmap": cosmap_weights,
}
