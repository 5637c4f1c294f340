"""FLUX's token layout: latents packed 2×2 into tokens, and the (axis, row, column) position ids
of its rotary embedding (Black Forest Labs' FLUX.1; diffusers' ``FluxPipeline`` packs the same
way, tests/test_flux.py holds the equality).

A latent ``[B, C, h, w]`` becomes ``(h/2)·(w/2)`` tokens of ``4C`` values, row-major over the
2×2 patches, each patch's values channel-major then (row, column) inside the patch. Image
token ``(i, j)`` has the id ``(0, i, j)``; every text token has the id ``(0, 0, 0)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

PATCH = 2  # latent pixels per token side


def pack_latents(latents: Tensor) -> Tensor:
    """``[B, C, h, w]`` → ``[B, (h/2)·(w/2), 4C]``."""
    batch, channels, height, width = latents.shape
    patches = latents.view(batch, channels, height // PATCH, PATCH, width // PATCH, PATCH)
    tokens = patches.permute(0, 2, 4, 1, 3, 5)  # [B, h/2, w/2, C, 2, 2]
    return tokens.reshape(batch, (height // PATCH) * (width // PATCH), channels * PATCH * PATCH)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """The inverse of :func:`pack_latents`: ``[B, (h/2)·(w/2), 4C]`` → ``[B, C, h, w]``."""
    batch, _, values = tokens.shape
    channels = values // (PATCH * PATCH)
    patches = tokens.view(batch, height // PATCH, width // PATCH, channels, PATCH, PATCH)
    return patches.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width)


def image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Position ids ``[(h/2)·(w/2), 3]`` of the tokens of an ``h × w`` latent: (0, row, col)."""
    rows, cols = height // PATCH, width // PATCH
    # built on the device: no host-to-device copy in the training step
    row = torch.arange(rows, device=device, dtype=dtype)[:, None].expand(rows, cols)
    col = torch.arange(cols, device=device, dtype=dtype)[None, :].expand(rows, cols)
    return torch.stack([torch.zeros_like(row), row, col], dim=-1).reshape(rows * cols, 3)


def text_ids(length: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Position ids ``[L, 3]`` of the text tokens: all zero (FLUX gives text no position)."""
    return torch.zeros(length, 3, device=device, dtype=dtype)


def sequence_length(height: int, width: int) -> int:
    """Image tokens of an ``h × w`` latent (what FLUX's resolution-dependent shift reads)."""
    return (height // PATCH) * (width // PATCH)
