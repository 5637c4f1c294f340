"""The spine's objective: SDXL schedule and epsilon noising against diffusers and the paper."""

from __future__ import annotations

import torch
from diffusers import DDPMScheduler, EulerDiscreteScheduler

from impasto.objectives import (
    PREDICTION_TARGETS,
    add_noise,
    alphas_cumprod_from_betas,
    mse_loss,
    scaled_linear_betas,
    sigmas_from_alphas_cumprod,
    uniform_timesteps,
)

SDXL = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
}


def _sdxl_alphas_cumprod() -> torch.Tensor:
    return alphas_cumprod_from_betas(scaled_linear_betas(1000, 0.00085, 0.012))


def test_sdxl_sigma_range_matches_published_values():
    sigmas = sigmas_from_alphas_cumprod(_sdxl_alphas_cumprod())
    # SDXL's k-diffusion sigma range, 0.0292 .. 14.6146 (DESIGN §5).
    assert round(sigmas[0].item(), 4) == 0.0292
    assert round(sigmas[-1].item(), 4) == 14.6146
    assert torch.all(sigmas[1:] > sigmas[:-1])


def test_schedule_matches_diffusers_schedulers():
    ours = _sdxl_alphas_cumprod()
    ddpm = DDPMScheduler(**SDXL)
    torch.testing.assert_close(ours.float(), ddpm.alphas_cumprod, rtol=1e-6, atol=1e-7)
    euler = EulerDiscreteScheduler(**SDXL)
    torch.testing.assert_close(
        sigmas_from_alphas_cumprod(ours).float().flip(0), euler.sigmas[:-1], rtol=1e-5, atol=1e-6
    )


def test_add_noise_matches_ddpm_scheduler():
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 4, 8, 8, generator=generator)
    noise = torch.randn(4, 4, 8, 8, generator=generator)
    timesteps = torch.tensor([0, 17, 500, 999])
    expected = DDPMScheduler(**SDXL).add_noise(x0, noise, timesteps)
    torch.testing.assert_close(add_noise(x0, noise, timesteps, _sdxl_alphas_cumprod()), expected)


def test_uniform_timesteps_cover_range_and_replay():
    draws = uniform_timesteps(20000, 1000, torch.Generator().manual_seed(3), torch.device("cpu"))
    again = uniform_timesteps(20000, 1000, torch.Generator().manual_seed(3), torch.device("cpu"))
    assert torch.equal(draws, again) and draws.dtype == torch.int64
    assert draws.min() == 0 and draws.max() == 999
    assert abs(draws.float().mean().item() - 499.5) < 6  # std of the mean ≈ 2.04


def test_mse_loss_is_per_sample():
    prediction = torch.zeros(2, 1, 2, 2)
    target = torch.stack([torch.ones(1, 2, 2), 2 * torch.ones(1, 2, 2)])
    assert mse_loss(prediction, target).tolist() == [1.0, 4.0]


def test_v_prediction_target_equals_diffusers_velocity():
    generator = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 4, 8, 8, generator=generator)
    noise = torch.randn(4, 4, 8, 8, generator=generator)
    timesteps = torch.tensor([0, 17, 500, 999])
    expected = DDPMScheduler(**SDXL).get_velocity(x0, noise, timesteps)
    ours = PREDICTION_TARGETS["v_prediction"](x0, noise, timesteps, _sdxl_alphas_cumprod())
    torch.testing.assert_close(ours, expected)
    assert torch.equal(PREDICTION_TARGETS["sample"](x0, noise, timesteps, None), x0)
