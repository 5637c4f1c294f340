"""Training-time distributions: integer timesteps (DDPM objectives) and continuous t (flow).

Each sampler has a matching probability vector over the T timesteps (integer) or density in t
(continuous), so what training draws can be printed and tested. Randomness only comes from the
explicit generator: numbers are drawn on ``generator.device`` and then moved to ``device``, so a
run replays on any device. Samplers return int64 [B] timesteps or float32 [B] t in (0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def _timestep_window(
    num_train_timesteps: int, min_timestep: int, max_timestep: int | None
) -> tuple[int, int]:
    high = num_train_timesteps if max_timestep is None else max_timestep
    if not 0 <= min_timestep < high <= num_train_timesteps:
        raise ValueError(
            f"need 0 <= min_timestep < max_timestep <= {num_train_timesteps} (max exclusive), "
            f"got min_timestep={min_timestep}, max_timestep={max_timestep}"
        )
    return min_timestep, high


def uniform_timesteps(
    batch_size: int,
    num_train_timesteps: int,
    generator: torch.Generator,
    device: torch.device,
    *,
    min_timestep: int = 0,
    max_timestep: int | None = None,
) -> Tensor:
    """t ~ U{min, …, max − 1}: the DDPM / SDXL training distribution. Returns int64 [B].

    ``max_timestep`` is exclusive and defaults to T (kohya's ``--min_timestep/--max_timestep``).
    """
    low, high = _timestep_window(num_train_timesteps, min_timestep, max_timestep)
    timesteps = torch.randint(
        low, high, (batch_size,), generator=generator, device=generator.device
    )
    return timesteps.to(device)


def uniform_timestep_probabilities(
    num_train_timesteps: int, *, min_timestep: int = 0, max_timestep: int | None = None
) -> Tensor:
    """P(t) of :func:`uniform_timesteps`, float64 [T]."""
    low, high = _timestep_window(num_train_timesteps, min_timestep, max_timestep)
    probabilities = torch.zeros(num_train_timesteps, dtype=torch.float64)
    probabilities[low:high] = 1.0 / (high - low)
    return probabilities


def _portion_count(num_train_timesteps: int, portion: float) -> int:
    count = int(portion * num_train_timesteps)  # int() as diffusers and maxdiffusion
    if not 0 < portion <= 1 or count == 0:
        raise ValueError(
            f"timestep bias portion must be in (0, 1] and cover at least one of the "
            f"{num_train_timesteps} timesteps, got {portion}"
        )
    return count


def _bias_none(num_train_timesteps: int, begin: int, end: int, portion: float) -> Tensor:
    return torch.zeros(num_train_timesteps, dtype=torch.bool)


def _bias_earlier(num_train_timesteps: int, begin: int, end: int, portion: float) -> Tensor:
    return torch.arange(num_train_timesteps) < _portion_count(num_train_timesteps, portion)


def _bias_later(num_train_timesteps: int, begin: int, end: int, portion: float) -> Tensor:
    count = _portion_count(num_train_timesteps, portion)
    return torch.arange(num_train_timesteps) >= num_train_timesteps - count


def _bias_range(num_train_timesteps: int, begin: int, end: int, portion: float) -> Tensor:
    if not 0 <= begin < end <= num_train_timesteps:
        raise ValueError(
            f"timestep bias range needs 0 <= begin < end <= {num_train_timesteps} "
            f"(end exclusive), got begin={begin}, end={end}"
        )
    steps = torch.arange(num_train_timesteps)
    return (steps >= begin) & (steps < end)


# strategy → which timesteps the multiplier applies to, bool [T] (from T, begin, end, portion).
# "earlier" is the first portion·T steps, as diffusers (maxdiffusion: the first (1 − portion)·T).
TIMESTEP_BIAS_STRATEGIES: dict[str, Callable[[int, int, int, float], Tensor]] = {
    "none": _bias_none,
    "earlier": _bias_earlier,
    "later": _bias_later,
    "range": _bias_range,
}


def timestep_bias_probabilities(
    num_train_timesteps: int,
    *,
    strategy: str = "none",
    multiplier: float = 1.0,
    begin: int = 0,
    end: int | None = None,
    portion: float = 0.25,
) -> Tensor:
    """P(t) ∝ multiplier on the biased timesteps, 1 elsewhere: float64 [T].

    diffusers' ``generate_timestep_weights`` (SDXL training example): ``portion`` is used by
    earlier/later only, ``begin``/``end`` (end exclusive, default T) by range only. A
    multiplier ≤ 0 raises (diffusers returns the error instead of raising it).
    """
    if strategy not in TIMESTEP_BIAS_STRATEGIES:
        raise ValueError(
            f"unknown timestep bias strategy {strategy!r}; valid: "
            f"{', '.join(sorted(TIMESTEP_BIAS_STRATEGIES))}"
        )
    if multiplier <= 0:
        raise ValueError(f"timestep bias multiplier must be > 0, got {multiplier}")
    end = num_train_timesteps if end is None else end
    biased = TIMESTEP_BIAS_STRATEGIES[strategy](num_train_timesteps, begin, end, portion)
    weights = torch.where(biased, multiplier, 1.0).to(torch.float64)
    return weights / weights.sum()


def timestep_bias_timesteps(
    batch_size: int,
    num_train_timesteps: int,
    generator: torch.Generator,
    device: torch.device,
    **bias: float | int | str | None,
) -> Tensor:
    """t ~ Categorical(:func:`timestep_bias_probabilities`), int64 [B]; ``bias`` is its keywords."""
    probabilities = timestep_bias_probabilities(num_train_timesteps, **bias)
    timesteps = torch.multinomial(
        probabilities.to(generator.device), batch_size, replacement=True, generator=generator
    )
    return timesteps.to(device)


# name → sampler(batch_size, num_train_timesteps, generator, device, **params) -> int64 [B].
TIMESTEP_SAMPLERS: dict[str, Callable[..., Tensor]] = {
    "uniform": uniform_timesteps,
    "timestep_bias": timestep_bias_timesteps,
}

# name → probabilities(num_train_timesteps, **params) -> float64 [T], the same params.
TIMESTEP_PROBABILITIES: dict[str, Callable[..., Tensor]] = {
    "uniform": uniform_timestep_probabilities,
    "timestep_bias": timestep_bias_probabilities,
}


def _uniform(batch_size: int, generator: torch.Generator) -> Tensor:
    """u ~ U[0, 1) on the generator's device, float32 [B]."""
    return torch.rand((batch_size,), generator=generator, device=generator.device)


def uniform_flow_times(batch_size: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """t ~ U(0, 1] (1 − u, so the clean end t = 0, SNR = ∞, is never drawn)."""
    return (1 - _uniform(batch_size, generator)).to(device)


def uniform_flow_density(t: Tensor) -> Tensor:
    """π(t) = 1 on (0, 1]."""
    return torch.ones_like(t)


def logit_normal_flow_times(
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    *,
    mean: float = 0.0,
    std: float = 1.0,
) -> Tensor:
    """t = sigmoid(n), n ~ N(mean, std²) (Esser et al. 2024, arXiv:2403.03206, eq. 19).

    SD3's best setting is mean 0, std 1 ("rf/lognorm(0.00, 1.00)"); draws the same numbers as
    diffusers' ``compute_density_for_timestep_sampling("logit_normal", ...)``.
    """
    normal = torch.randn((batch_size,), generator=generator, device=generator.device)
    return torch.sigmoid(mean + std * normal).to(device)


def logit_normal_density(t: Tensor, *, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """π(t) = 1/(std·sqrt(2π)) · 1/(t(1 − t)) · exp(−(logit(t) − mean)²/(2 std²)), 0 at t = 0, 1."""
    inside = (t > 0) & (t < 1)
    safe = torch.where(inside, t, torch.full_like(t, 0.5))
    logit = torch.log(safe / (1 - safe))
    density = torch.exp(-((logit - mean) ** 2) / (2 * std**2)) / (
        std * math.sqrt(2 * math.pi) * safe * (1 - safe)
    )
    return torch.where(inside, density, torch.zeros_like(t))


def check_mode_scale(scale: float) -> None:
    # f_mode is a monotone map of [0, 1] onto itself only for scale in [−1, 2/(π − 2)].
    if not -1.0 <= scale <= 2 / (math.pi - 2):
        raise ValueError(f"mode scale must be in [-1, {2 / (math.pi - 2):.4f}], got {scale}")


def _mode_map(u: Tensor, scale: float) -> Tensor:
    """f_mode(u; s) = 1 − u − s·(cos²(πu/2) − 1 + u) (Esser et al. 2024, eq. 20), decreasing."""
    return 1 - u - scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


def mode_flow_times(
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    *,
    scale: float = 1.29,
) -> Tensor:
    """t = f_mode(u; scale), u ~ U[0, 1): more mass at mid t for scale > 0.

    The default 1.29 is diffusers' scripts' ``mode_scale``; draws the same numbers as diffusers'
    ``compute_density_for_timestep_sampling("mode", ...)``.
    """
    check_mode_scale(scale)
    return _mode_map(_uniform(batch_size, generator), scale).to(device)


def mode_density(t: Tensor, *, scale: float = 1.29) -> Tensor:
    """π(t) = |d f_mode⁻¹(t)/dt| = 1/|f_mode'(u)| at u = f_mode⁻¹(t) (found by bisection)."""
    check_mode_scale(scale)
    target = t.double()
    low, high = torch.zeros_like(target), torch.ones_like(target)
    for _ in range(60):  # 2⁻⁶⁰: below float64 resolution on [0, 1]
        middle = (low + high) / 2
        root_is_right = _mode_map(middle, scale) > target
        low = torch.where(root_is_right, middle, low)
        high = torch.where(root_is_right, high, middle)
    u = (low + high) / 2
    slope = 1 + scale - scale * math.pi / 2 * torch.sin(math.pi * u)  # −f_mode'(u) ≥ 0
    return (1 / slope).to(t.dtype)


def cosmap_flow_times(batch_size: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """t = 1 − 1/(tan(πu/2) + 1) (Esser et al. 2024, eq. 21), u ~ U(0, 1].

    1 − u instead of u (the density is symmetric about ½) so t = 0 is never drawn.
    """
    u = 1 - _uniform(batch_size, generator)
    return (1 - 1 / (torch.tan(math.pi * u / 2) + 1)).clamp(0, 1).to(device)


def cosmap_density(t: Tensor) -> Tensor:
    """π(t) = 2/(π(1 − 2t + 2t²)), SD3's "cosmap" (also its loss weight of that name)."""
    return 2 / (math.pi * (1 - 2 * t + 2 * t**2))


# name → sampler(batch_size, generator, device, **params) -> float32 t [B] in (0, 1], t = 1 noise.
FLOW_TIME_SAMPLERS: dict[str, Callable[..., Tensor]] = {
    "uniform": uniform_flow_times,
    "logit_normal": logit_normal_flow_times,
    "mode": mode_flow_times,
    "cosmap": cosmap_flow_times,
}

# name → density(t, **params), the same params as the sampler of that name.
FLOW_TIME_DENSITIES: dict[str, Callable[..., Tensor]] = {
    "uniform": uniform_flow_density,
    "logit_normal": logit_normal_density,
    "mode": mode_density,
    "cosmap": cosmap_density,
}
