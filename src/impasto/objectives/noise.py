"""Noise tricks applied to the training noise ε [B, C, H, W]; each returns a new tensor.

Random numbers are drawn on ``generator.device`` and moved to ε's device. Random strengths are
drawn per sample (kohya draws one per batch), so a sample's noise does not depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _strengths(
    strength: float, batch_size: int, generator: torch.Generator, random_strength: bool
) -> Tensor:
    """[B] strengths: ``strength`` or, with ``random_strength``, strength·U(0, 1) per sample."""
    if random_strength:
        return strength * torch.rand((batch_size,), generator=generator, device=generator.device)
    return torch.full((batch_size,), float(strength), device=generator.device)


def offset_noise(
    noise: Tensor, strength: float, generator: torch.Generator, *, random_strength: bool = False
) -> Tensor:
    """ε + k·n with n ~ N(0, I) of shape [B, C, 1, 1] (Guttenberg 2023, "Diffusion with Offset
    Noise"): a per-channel constant lets the model change an image's mean colour. kohya
    recommends k ≈ 0.1; the offset noise is also the ε-target.
    """
    batch_size, channels = noise.shape[:2]
    ones = (1,) * (noise.dim() - 2)  # [B, C, 1, 1] for images, [B, C, 1, 1, 1] for clips
    shape = (batch_size, channels, *ones)
    offset = torch.randn(shape, generator=generator, device=generator.device)
    scale = _strengths(strength, batch_size, generator, random_strength).view(-1, 1, *ones)
    return noise + (scale * offset).to(noise.device, noise.dtype)


def pyramid_noise(
    noise: Tensor, generator: torch.Generator, *, iterations: int = 6, discount: float = 0.3
) -> Tensor:
    """Multi-resolution ("pyramid") noise: J. Whitaker, "Multi-Resolution Noise for Diffusion
    Model Training" (W&B report, 2023), as kohya's ``pyramid_noise_like``.

    Adds discount^i · upsample(N(0, I) at size / r^i) for i = 0 … iterations − 1, r ~ U(2, 4)
    drawn per level, stopping once a side reaches 1; then rescales each sample to unit std
    (kohya: the whole batch). Defaults are kohya's: 6 to 10 iterations, discount 0.3.
    """
    batch_size, channels, height, width = noise.shape
    total = noise.float()
    for level in range(iterations):
        ratio = 2 + 2 * float(torch.rand((), generator=generator, device=generator.device))
        level_height = max(1, int(height / ratio**level))
        level_width = max(1, int(width / ratio**level))
        coarse = torch.randn(
            (batch_size, channels, level_height, level_width),
            generator=generator,
            device=generator.device,
        ).to(noise.device)
        upsampled = F.interpolate(coarse, size=(height, width), mode="bilinear")
        total = total + upsampled * discount**level
        if level_height == 1 or level_width == 1:
            break
    std = total.flatten(1).std(dim=1).view(-1, 1, 1, 1)
    return (total / std).to(noise.dtype)


def perturb_noise(
    noise: Tensor, gamma: float, generator: torch.Generator, *, random_strength: bool = False
) -> Tensor:
    """Input perturbation (Ning et al. 2023, arXiv:2301.11706): ε' = ε + γ·ξ, ξ ~ N(0, I).

    ε' is only for x_t; the target keeps the clean ε (DESIGN §5). γ ≈ 0.1 is recommended;
    ``random_strength`` uses γ·U(0, 1) per sample (kohya's ``--ip_noise_gamma_random_strength``).
    """
    perturbation = torch.randn(noise.shape, generator=generator, device=generator.device)
    scale = _strengths(gamma, noise.shape[0], generator, random_strength)
    scale = scale.view(-1, *([1] * (noise.ndim - 1)))
    return noise + (scale * perturbation).to(noise.device, noise.dtype)
