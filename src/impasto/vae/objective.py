"""The VAE training objective: reconstruction + a tiny KL term, as Stable Diffusion's VAE.

Rombach et al. (2022, "High-Resolution Image Synthesis with Latent Diffusion Models", sec. 3.1
and appendix G) train the KL-regularised autoencoder with a pixel loss, LPIPS, a patch GAN and
``1e-6`` times the KL divergence to a unit Gaussian, both summed per image. The demo VAE keeps
the pixel loss and the KL term (no LPIPS, no GAN: the demo images are flat shapes), and uses
per-element means, so the KL weight is divided by the number of pixel values per image to give
the same balance as the sum-per-image convention. The default pixel loss is MSE, not SD's L1: on
the demo shapes L1 trailed MSE by 2.4 dB of PSNR after 750 steps (docs/demo-vae.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import Tensor

PixelLoss = Callable[[Tensor, Tensor], Tensor]
"""``(reconstruction, target) -> scalar``, both ``[B, 3, R, R]`` in ``[-1, 1]``."""


def l1_loss(reconstruction: Tensor, target: Tensor) -> Tensor:
    """Mean absolute error (the pixel loss of SD's VAE)."""
    return (reconstruction - target).abs().mean()


def mse_loss(reconstruction: Tensor, target: Tensor) -> Tensor:
    """Mean squared error (what PSNR measures)."""
    return (reconstruction - target).square().mean()


PIXEL_LOSSES: dict[str, PixelLoss] = {"l1": l1_loss, "mse": mse_loss}


def get_pixel_loss(name: str) -> PixelLoss:
    """Look up a pixel loss by name in :data:`PIXEL_LOSSES`."""
    if name not in PIXEL_LOSSES:
        raise ValueError(f"vae: unknown loss {name!r}; valid losses: {sorted(PIXEL_LOSSES)}")
    return PIXEL_LOSSES[name]


@dataclass(frozen=True)
class VaeLossOutput:
    """The loss of one batch and its parts (scalars, with autograd graph on ``loss``)."""

    loss: Tensor
    reconstruction: Tensor
    kl: Tensor  # KL divergence to N(0, I) per image, in nats, summed over latent elements


def posterior_kl(posterior: DiagonalGaussianDistribution) -> Tensor:
    """KL divergence of the posterior to N(0, I) per item ``[B]``, summed over every latent
    element: image latents ``[B, C, h, w]`` or video latents ``[B, z, t, h, w]``.

    diffusers' ``posterior.kl()`` sums over dims 1-3 only, which on video latents leaves the
    width unsummed; on images this is the same expression over the same dims.
    """
    terms = torch.pow(posterior.mean, 2) + posterior.var - 1.0 - posterior.logvar
    return 0.5 * torch.sum(terms, dim=list(range(1, terms.dim())))


def vae_loss(
    reconstruction: Tensor,
    target: Tensor,
    posterior: DiagonalGaussianDistribution,
    pixel_loss: PixelLoss,
    kl_weight: float,
) -> VaeLossOutput:
    """``pixel_loss + kl_weight * KL / (3 R R)`` (clips: ``KL / (3 T R R)``).

    Args:
        reconstruction: decoded images ``[B, 3, R, R]`` (or clips ``[B, 3, T, R, R]``).
        target: the input images ``[B, 3, R, R]`` (or clips) in ``[-1, 1]``.
        posterior: the encoder's diagonal Gaussian over latents ``[B, C, R/f, R/f]`` (or
            ``[B, z, t, R/f, R/f]``).
        pixel_loss: e.g. :func:`l1_loss`.
        kl_weight: weight of the per-image KL sum relative to a per-image sum of the pixel loss
            (SD: 1e-6).
    """
    reconstruction_term = pixel_loss(reconstruction, target)
    kl = posterior_kl(posterior).mean()
    loss = reconstruction_term + kl_weight * kl / target[0].numel()
    return VaeLossOutput(loss=loss, reconstruction=reconstruction_term, kl=kl)
