"""The UniPC sampler (``impasto.sampling.unipc``, pure torch) against diffusers'
``UniPCMultistepScheduler`` driven step by step on a toy network: on a DDPM model (SDXL's
schedule, VE state) and on a rectified-flow model with Wan 2.1's scheduler config (flow sigmas
shifted by 3), and on a FLUX-style ladder that starts at t = 1."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler
from torch.testing import assert_close

from impasto.models import sdxl_scheduler
from impasto.sampling import get_sampler, initial_noise_scale, sample_ddim, vp_denoiser
from impasto.sampling.flow import flow_timesteps, get_flow_sampler
from impasto.sampling.samplers import sample_euler

WAN_SCHEDULER = {  # Wan2.1-T2V-*-Diffusers' scheduler_config.json
    "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
    "flow_shift": 3.0, "solver_order": 2, "solver_type": "bh2", "final_sigmas_type": "zero",
    "lower_order_final": True, "predict_x0": True, "timestep_spacing": "linspace",
}  # fmt: skip


def _toy_network(x_t: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """A fixed prediction (ε or velocity), nonlinear in x_t and t."""
    t = float(timestep) / 1000
    pattern = torch.linspace(-1, 1, x_t[0].numel()).view(x_t.shape[1:])
    return (0.3 + 0.6 * t) * torch.tanh(x_t) + 0.2 * torch.sin(3 * t + 2 * pattern)


def _scheduler_loop(scheduler, x: torch.Tensor) -> torch.Tensor:
    for t in scheduler.timesteps:
        x = scheduler.step(_toy_network(x, t), t, x, return_dict=False)[0]
    return x


def _flow_denoiser(x: torch.Tensor, t: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    return x - t * _toy_network(x, timestep)  # x̂0 of a velocity network (flow.flow_denoiser)


@pytest.mark.parametrize("spacing", ["linspace", "leading", "trailing"])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 8, 20])
def test_ddpm_model_equals_diffusers_unipc(spacing: str, num_steps: int) -> None:
    scheduler = UniPCMultistepScheduler.from_config(
        sdxl_scheduler().config, timestep_spacing=spacing
    )
    scheduler.set_timesteps(num_steps)
    spec = get_sampler("unipc")
    timesteps, sigmas = spec.schedule(num_steps, scheduler.alphas_cumprod, spacing, 1)
    assert_close(timesteps, scheduler.timesteps.float(), rtol=0, atol=0)
    assert_close(sigmas, scheduler.sigmas, rtol=0, atol=0)
    noise = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(3))
    reference = _scheduler_loop(scheduler, noise.clone())
    denoise = vp_denoiser(lambda x_t, t, cond: _toy_network(x_t, t), cond=None)
    x = spec.sample(denoise, noise * initial_noise_scale(sigmas[0]), sigmas, timesteps)
    assert_close(x, reference, rtol=1e-5, atol=1e-5)
    if num_steps >= 3:  # multistep: not the first-order (DDIM) walk of the same ladder
        ddim = sample_ddim(denoise, noise * initial_noise_scale(sigmas[0]), sigmas, timesteps)
        assert (ddim - reference).abs().max() > 1e-3


@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 10, 30])
def test_flow_model_equals_diffusers_unipc_with_wans_config(num_steps: int) -> None:
    scheduler = UniPCMultistepScheduler(**WAN_SCHEDULER)
    scheduler.set_timesteps(num_steps)
    noise = torch.randn(2, 4, 2, 3, 3, generator=torch.Generator().manual_seed(5))  # clips
    reference = _scheduler_loop(scheduler, noise.clone())
    sample = get_flow_sampler("unipc")
    steps = []
    x = sample(
        _flow_denoiser, noise.clone(), scheduler.sigmas, scheduler.timesteps.float(),
        callback=lambda i, x, denoised: steps.append(i),
    )  # fmt: skip
    assert_close(x, reference, rtol=1e-5, atol=1e-5)
    assert steps == list(range(num_steps))
    if num_steps >= 3:  # Euler on the same ladder is another sampler
        euler = sample_euler(_flow_denoiser, noise.clone(), scheduler.sigmas,
                             scheduler.timesteps.float())  # fmt: skip
        assert (euler - reference).abs().max() > 1e-3


def test_a_flow_ladder_from_one_starts_where_diffusers_moves_it() -> None:
    """A ladder from t = 1 (FLUX's, SD3's): diffusers' flow UniPC starts at 1 − 10⁻⁶ (log 0
    otherwise); the result is finite and equal to the scheduler given the same sigmas."""
    timesteps, ts = flow_timesteps(6, shift=3.0)
    assert ts[0] == 1.0
    scheduler = UniPCMultistepScheduler(**{**WAN_SCHEDULER, "flow_shift": 1.0})  # ts as given
    scheduler.set_timesteps(sigmas=ts[:-1].numpy())
    assert scheduler.sigmas[0] < 1.0
    noise = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    x = noise.clone()
    for i, t in enumerate(scheduler.timesteps):  # the scheduler's int times; ours: timesteps
        x = scheduler.step(_toy_network(x, timesteps[i]), t, x, return_dict=False)[0]
    ours = get_flow_sampler("unipc")(_flow_denoiser, noise.clone(), ts, timesteps)
    assert torch.isfinite(ours).all()
    assert_close(ours, x, rtol=1e-5, atol=1e-5)
