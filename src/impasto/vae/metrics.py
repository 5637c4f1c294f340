"""Reconstruction quality of a VAE: image loading, reconstruction, PSNR, latent statistics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from diffusers import AutoencoderKL
from torch import Tensor

from impasto.data import Example, ImageCaptionDataset, ImageRecord

EVAL_BATCH_SIZE = 64


def load_images(records: Sequence[ImageRecord], resolution: int) -> Tensor:
    """All ``records`` as one float32 tensor ``[N, 3, R, R]`` in ``[-1, 1]`` (centre crop, no flip).

    Unreadable files are skipped (the dataset logs a warning for each).

    Raises:
        ValueError: no record could be read.
    """
    dataset = ImageCaptionDataset(records, resolution, crop="center", random_flip=False, seed=0)
    examples = [dataset[(0, index)] for index in range(len(dataset))]
    pixels = [example.pixel_values for example in examples if isinstance(example, Example)]
    if not pixels:
        raise ValueError(f"vae: none of the {len(records)} images could be read")
    return torch.stack(pixels)


def psnr(reference: Tensor, reconstruction: Tensor) -> float:
    """Peak signal-to-noise ratio in dB of images in ``[0, 1]``: ``10 log10(1 / MSE)``.

    The MSE is over every element of the two same-shape tensors; identical inputs give ``inf``.
    """
    if reference.shape != reconstruction.shape:
        raise ValueError(
            f"psnr: shapes differ: {tuple(reference.shape)} vs {tuple(reconstruction.shape)}"
        )
    mse = torch.mean((reference.double() - reconstruction.double()) ** 2).item()
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


@torch.no_grad()
def reconstruct(vae: AutoencoderKL, pixel_values: Tensor) -> Tensor:
    """``decode(encode(x).mode())`` clamped to ``[-1, 1]``, for images ``[B, 3, R, R]`` in [-1, 1].

    Runs in batches of :data:`EVAL_BATCH_SIZE` on the VAE's device and dtype; returns float32 on
    the input's device.
    """
    outputs = []
    for chunk in pixel_values.split(EVAL_BATCH_SIZE):
        chunk = chunk.to(vae.device, vae.dtype)
        decoded = vae.decode(vae.encode(chunk).latent_dist.mode()).sample
        outputs.append(decoded.clamp(-1.0, 1.0).to(pixel_values.device, torch.float32))
    return torch.cat(outputs)


def _to_unit(images: Tensor) -> Tensor:
    return (images + 1.0) / 2.0


def mean_psnr(vae: AutoencoderKL, pixel_values: Tensor) -> float:
    """Mean over images of the per-image PSNR of their reconstruction, in dB (images in [-1, 1])."""
    was_training = vae.training
    vae.eval()
    reconstructions = reconstruct(vae, pixel_values)
    vae.train(was_training)
    values = [
        psnr(_to_unit(reference), _to_unit(decoded))
        for reference, decoded in zip(pixel_values, reconstructions, strict=True)
    ]
    return sum(values) / len(values)


def evaluate_vae(vae: AutoencoderKL, records: Sequence[ImageRecord], resolution: int) -> float:
    """Mean per-image PSNR (dB) of ``vae``'s reconstructions of ``records`` at ``resolution``.

    Images are centre-cropped squares; reconstruction uses the posterior mode (no sampling).
    """
    return mean_psnr(vae, load_images(records, resolution))


@torch.no_grad()
def latent_std(vae: AutoencoderKL, pixel_values: Tensor) -> float:
    """Standard deviation of all posterior-mode latent values of ``pixel_values``.

    Rombach et al. (2022, "High-Resolution Image Synthesis with Latent Diffusion Models",
    sec. G) set the VAE's ``scaling_factor`` to ``1 / std`` of the latents so that the diffusion
    model sees unit-variance inputs; SD 1.x's 0.18215 and SDXL's 0.13025 were measured that way.
    """
    was_training = vae.training
    vae.eval()
    latents = [
        vae.encode(chunk.to(vae.device, vae.dtype)).latent_dist.mode().float().cpu()
        for chunk in pixel_values.split(EVAL_BATCH_SIZE)
    ]
    vae.train(was_training)
    return torch.cat(latents).std().item()
