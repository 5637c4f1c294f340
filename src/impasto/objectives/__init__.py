"""Diffusion objectives as pure tensor math (torch only): schedules, noising, targets, losses."""

from impasto.objectives.noising import (
    LOSSES,
    PREDICTION_TARGETS,
    TIMESTEP_SAMPLERS,
    add_noise,
    epsilon_target,
    mse_loss,
    uniform_timesteps,
)
from impasto.objectives.schedules import (
    SCHEDULES,
    alphas_cumprod_from_betas,
    linear_betas,
    scaled_linear_betas,
    sigmas_from_alphas_cumprod,
    snr_from_alphas_cumprod,
    training_alphas_cumprod,
)

__all__ = [
    "LOSSES",
    "PREDICTION_TARGETS",
    "SCHEDULES",
    "TIMESTEP_SAMPLERS",
    "add_noise",
    "alphas_cumprod_from_betas",
    "epsilon_target",
    "linear_betas",
    "mse_loss",
    "scaled_linear_betas",
    "sigmas_from_alphas_cumprod",
    "snr_from_alphas_cumprod",
    "training_alphas_cumprod",
    "uniform_timesteps",
]
