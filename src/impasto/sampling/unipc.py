"""UniPC (Zhao et al. 2023, arXiv:2302.04867): a multistep predictor (UniP) and corrector
(UniC) on the data prediction x̂0, the B(h) = e^h − 1 variant ("bh2") of order 2 with the
last step of order 1: diffusers' ``UniPCMultistepScheduler`` with its defaults
(``solver_order=2``, ``predict_x0``, ``lower_order_final``, no disabled corrector), the
scheduler ``WanPipeline`` samples Wan 2.1 with.

The update reads only each level's (α, σ), the state being x = α·x0 + σ·ε, and λ = log(α/σ):
from level s to t, with h = λ_t − λ_s and the earlier estimates' D_k = (x̂0_{s−k} − x̂0_s)/r_k,
r_k = (λ_{s−k} − λ_s)/h,

    x_t = (σ_t/σ_s)·x_s − α_t·(e^{−h} − 1)·x̂0_s − α_t·B(h)·Σ_k ρ_k·D_k

(eq. 8 with x̂0 in place of ε̂). The corrector redoes the last step once the model has seen
its result, adding the new estimate as one more D. So the same code samples a VE state
(α = 1, σ; the other samplers of ``samplers.py``) and a rectified-flow state (α = 1 − t,
σ = t; ``flow.py``), each to float rounding of diffusers' VP-form arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Denoiser = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x, level, timestep) -> x0 estimate
StepCallback = Callable[[int, Tensor, Tensor], None]  # (step index, new x, denoised)
AlphaSigma = Callable[[Tensor], tuple[Tensor, Tensor]]  # levels [n + 1] -> (α, σ)

SOLVER_ORDER = 2  # diffusers' default and Wan 2.1's scheduler config
FLOW_START_GAP = 1e-6  # diffusers moves a flow ladder's t = 1 this far down: log σ/α finite


def ve_alpha_sigma(sigmas: Tensor) -> tuple[Tensor, Tensor]:
    """(1, σ): the VE state x = x0 + σ·ε."""
    return torch.ones_like(sigmas), sigmas


def flow_alpha_sigma(ts: Tensor) -> tuple[Tensor, Tensor]:
    """(1 − t, t): the rectified-flow state x_t = (1 − t)·x0 + t·ε."""
    return 1 - ts, ts


def _coefficients(h: Tensor, rks: Tensor, order: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(h·φ₁ = e^{−h} − 1, B(h), R [order, order], b [order]) of the bh2 update (the linear
    system ρ solves, R_ij = r_j^i, b_i = i!·φ_{i+1}(h)/B(h)), computed as diffusers does."""
    hh = -h
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    b_h = torch.expm1(hh)
    factorial = 1
    rows, b = [], []
    for i in range(1, order + 1):
        rows.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return h_phi_1, b_h, torch.stack(rows), torch.stack(b)


def _update(
    x: Tensor, estimates: list[Tensor], levels: tuple[int, int], order: int,
    alphas: Tensor, sigmas: Tensor, lambdas: Tensor, estimate_t: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x at level s → level t (``levels``), ``estimates[-1 - k]`` the x̂0 at level s − k;
    with ``estimate_t`` (the x̂0 at the predicted x_t), the corrector UniC of that step."""
    s, t = levels
    m0 = estimates[-1]
    h = lambdas[t] - lambdas[s]
    rks = [(lambdas[s - k] - lambdas[s]) / h for k in range(1, order)]
    d1s = [(estimates[-1 - k] - m0) / rk for k, rk in enumerate(rks, 1)]
    h_phi_1, b_h, rows, b = _coefficients(h, torch.stack([*rks, torch.ones_like(h)]), order)
    x_t = sigmas[t] / sigmas[s] * x - alphas[t] * h_phi_1 * m0
    stacked = torch.stack(d1s, dim=1) if d1s else None  # [B, K, ...]
    if estimate_t is None:  # UniP: order 2 takes ρ = 1/2 (diffusers' simplification)
        if stacked is None:
            return x_t
        rhos = torch.full((1,), 0.5) if order == 2 else torch.linalg.solve(rows[:-1, :-1], b[:-1])
        return x_t - alphas[t] * b_h * torch.einsum("k,bkc...->bc...", rhos.to(x), stacked)
    rhos = torch.full((1,), 0.5) if order == 1 else torch.linalg.solve(rows, b)
    rhos = rhos.to(x)
    res = 0 if stacked is None else torch.einsum("k,bkc...->bc...", rhos[:-1], stacked)
    return x_t - alphas[t] * b_h * (res + rhos[-1] * (estimate_t - m0))


def unipc(
    denoise: Denoiser, x: Tensor, levels: Tensor, timesteps: Tensor, alpha_sigma: AlphaSigma,
    *, callback: StepCallback | None = None, order: int = SOLVER_ORDER,
) -> Tensor:  # fmt: skip
    """UniPC-``order`` (module docstring) down the ladder ``levels`` ``[n + 1]`` (σ, or t),
    the model's time input ``timesteps`` ``[n]``, the state's (α, σ) from ``alpha_sigma``.
    Step i's order is min(order, i + 1, n − i): warm-up, then the last steps of lower order."""
    assert levels.ndim == 1 and timesteps.shape == (levels.shape[0] - 1,), "[n + 1] and [n]"
    alphas, sigmas = alpha_sigma(levels)
    lambdas = torch.log(alphas) - torch.log(sigmas)  # +inf at a final level 0: e^{−h} = 0
    num_steps = timesteps.shape[0]
    estimates: list[Tensor] = []  # the last ``order`` x̂0, newest last
    last_x, last_order = x, 0
    for i in range(num_steps):
        denoised = denoise(x, levels[i], timesteps[i])
        if i > 0:  # UniC: the step into x_i again, now with the estimate at x_i
            x = _update(last_x, estimates, (i - 1, i), last_order, alphas, sigmas, lambdas,
                        denoised)  # fmt: skip
        estimates = [*estimates, denoised][-order:]
        last_x, last_order = x, min(order, num_steps - i, len(estimates))
        x = _update(x, estimates, (i, i + 1), last_order, alphas, sigmas, lambdas)
        if callback is not None:
            callback(i, x, denoised)
    return x


def sample_unipc(
    denoise: Denoiser, x: Tensor, sigmas: Tensor, timesteps: Tensor, *,
    callback: StepCallback | None = None, noise: Callable[[], Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """UniPC-2 on a VE state over the σ ladder (``samplers.py``'s signature; deterministic,
    ``noise`` unused): diffusers' ``UniPCMultistepScheduler`` of a DDPM model."""
    return unipc(denoise, x, sigmas, timesteps, ve_alpha_sigma, callback=callback)


def sample_flow_unipc(
    denoise: Denoiser, x: Tensor, ts: Tensor, timesteps: Tensor, *,
    callback: StepCallback | None = None, noise: Callable[[], Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """UniPC-2 on a rectified-flow state x_t over the t ladder: diffusers'
    ``UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction")``,
    which starts a ladder at t = 1 − 10⁻⁶ rather than 1 (where λ = −∞)."""
    ts = torch.cat([ts[:1].clamp(max=1 - FLOW_START_GAP), ts[1:]])
    return unipc(denoise, x, ts, timesteps, flow_alpha_sigma, callback=callback)
