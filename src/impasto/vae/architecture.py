"""The tiny demo VAE: SDXL's ``AutoencoderKL`` wiring at widths that run on a CPU in milliseconds.

Same structure as SDXL's VAE (four ``DownEncoderBlock2D`` / ``UpDecoderBlock2D`` stages, three
of them downsampling: factor 8; a mid block with self-attention; 4 latent channels; a diagonal
Gaussian posterior) with 8-32 channels instead of 128-512.

Why ``norm_num_groups=4`` and not SDXL's 32 groups of 4-16 channels: the last GroupNorm before
the decoder's output convolution normalises each group over the whole image. With one channel
per group (8 groups of the 8-channel last stage) a flat white image and a flat black one become
the same after that norm, so the colour of a flat background cannot be decoded; with 2+ channels
per group it survives as a ratio between channels, and training converges many times faster.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKL

SDXL_VAE_SCALING_FACTOR = 0.13025

TINY_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,  # 3 downsamples: factor 8 like SDXL
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 16, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "latent_channels": 4,
    "sample_size": 64,
}
"""Architecture of the tiny preset's VAE (``AutoencoderKL`` keyword arguments)."""

TINY_VAE_DOWNSAMPLING = 2 ** (len(TINY_VAE_CONFIG["block_out_channels"]) - 1)


def build_tiny_vae(seed: int, scaling_factor: float = SDXL_VAE_SCALING_FACTOR) -> AutoencoderKL:
    """A randomly initialised tiny VAE; the init depends only on ``seed``.

    The global torch RNG is left as it was. ``scaling_factor`` is a placeholder until training
    measures the latents' standard deviation.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**TINY_VAE_CONFIG, scaling_factor=scaling_factor)
