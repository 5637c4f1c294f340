"""Sampling a rectified-flow model (SD3 convention): the time ladder and the denoiser.

The state is x_t = (1 − t)·x0 + t·ε itself, from pure noise at t = 1 to t = 0; the network
predicts the velocity v = ε − x0 from x_t and t·T. As a denoiser, x̂0 = x_t − t·v̂, so the Euler
sampler of ``samplers.py`` applied to this state with the t ladder in place of σ steps
x ← x + (t_next − t)·(x − x̂0)/t = x + (t_next − t)·v̂: exactly diffusers'
``FlowMatchEulerDiscreteScheduler.step``. (The VE form of the other samplers,
x/(1 − t) = x0 + σ·ε with σ = t/(1 − t), is infinite at t = 1, where flow sampling starts.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from impasto.objectives import shift_flow_times
from impasto.sampling.guidance import guided_output
from impasto.sampling.samplers import Denoiser, SampleFn, sample_euler
from impasto.sampling.unipc import sample_flow_unipc

Conditioning = TypeVar("Conditioning")

# name → sampler of a flow model; the same signature as ``samplers.SAMPLERS``' functions.
# UniPC: diffusers' UniPCMultistepScheduler(use_flow_sigmas=True, flow_prediction).
FLOW_SAMPLERS: dict[str, SampleFn] = {"euler": sample_euler, "unipc": sample_flow_unipc}


def get_flow_sampler(name: str) -> SampleFn:
    """The flow sampler registered as ``name``; any other name is a one-line error."""
    if name not in FLOW_SAMPLERS:
        raise ValueError(
            f"sampler {name!r} cannot sample a flow model (it works in the VE form, infinite "
            f"at t = 1); flow samplers: {sorted(FLOW_SAMPLERS)}"
        )
    return FLOW_SAMPLERS[name]


def flow_timesteps(
    num_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000
) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], ts [n + 1])`` float32: the UNet's time input t·T, and t ending at 0.

    As diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s).set_timesteps(n)`` (and SAI's SD3
    reference code): n points evenly spaced from 1 down to t_min, then shifted, where t_min is
    the *shifted* smallest training time s(1/T), so the last point is s(s(1/T)).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    training = torch.linspace(1, num_train_timesteps, num_train_timesteps) / num_train_timesteps
    t_min = shift_flow_times(training, shift)[0].item()  # float32 arithmetic, as diffusers
    grid = np.linspace(num_train_timesteps, t_min * num_train_timesteps, num_steps)
    ts = shift_flow_times(torch.from_numpy(grid / num_train_timesteps), shift).float()
    timesteps = ts * num_train_timesteps
    return timesteps, torch.cat([ts, torch.zeros(1)])


def flow_denoiser(
    model: Callable[[Tensor, Tensor, Conditioning], Tensor],
    cond: Conditioning,
    uncond_and_cond: Conditioning | None = None,
    *,
    guidance_scale: float = 1.0,
    guidance_rescale: float = 0.0,
) -> Denoiser:
    """D(x_t; t, timestep) = x_t − t·v̂ for a velocity network ``model(x_t, t·T, cond) -> v̂``.

    Guidance (``guidance.guided_output``) is applied to v̂, as diffusers' SD3 pipeline does.
    """

    def denoise(x: Tensor, t: Tensor, timestep: Tensor) -> Tensor:
        velocity = guided_output(
            model, x, timestep, cond, uncond_and_cond, guidance_scale, guidance_rescale
        )
        return x - t * velocity

    return denoise
