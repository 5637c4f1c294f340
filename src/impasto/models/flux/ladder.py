"""FLUX.1's sampling ladder, as ``FluxPipeline`` builds it: ``n`` times evenly spaced from 1
down to 1/n, shifted by ``exp(mu)`` where ``mu`` grows linearly with the image's tokens
(``FluxPipeline``'s ``calculate_shift``: ``base_shift`` at ``base_image_seq_len`` tokens,
``max_shift`` at ``max_image_seq_len``); a scheduler config without dynamic shifting
(FLUX.1-schnell's) shifts by its fixed ``shift``. The ladder comes from diffusers' own
``FlowMatchEulerDiscreteScheduler`` with the model's scheduler config, so it is the
pipeline's to the bit.

This is the sampling side only: training draws t from ``objective.timestep_sampling`` and
shifts it by ``objective.flow_shift`` (1, no shift, unless configured), as diffusers'
train_dreambooth_lora_flux.py does (docs/flux.md, Sampling).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor


def flux_mu(image_seq_len: int, scheduler_config: dict[str, Any]) -> float:
    """``FluxPipeline``'s ``calculate_shift``: mu linear in the image's tokens."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


def ladder(
    scheduler_config: dict[str, Any], num_steps: int, image_seq_len: int
) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], ts [n + 1])`` float32 for an image of ``image_seq_len`` tokens: the
    transformer's time input t·T, and t ending at 0 (``FluxPipeline``'s)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    if scheduler.config.use_dynamic_shifting:
        scheduler.set_timesteps(sigmas=sigmas, mu=flux_mu(image_seq_len, scheduler_config))
    else:  # a fixed-shift config (the scheduler's shift)
        scheduler.set_timesteps(sigmas=sigmas)
    return scheduler.timesteps.float(), scheduler.sigmas.float()
