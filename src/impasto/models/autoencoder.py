"""A diffusers ``AutoencoderKL`` as every family uses it: the posterior of images, the map
between its samples and the denoiser's latent space, and decoding to images.

The latent map follows diffusers' conventions for each kind of VAE config:

- ``latents_mean`` / ``latents_std`` given: ``(x − mean) · scaling_factor / std``;
- ``shift_factor`` given (SD3, FLUX): ``(x − shift_factor) · scaling_factor``;
- otherwise (SDXL, the demo VAE): ``x · scaling_factor``.

A video autoencoder (Wan 2.1's ``AutoencoderKLWan``, :mod:`impasto.models.video_autoencoder`)
goes through the same functions: clips ``[B, C, T, H, W]`` give latents ``[B, z, t, h, w]``,
and images ``[B, C, H, W]`` are one-frame clips whose latents keep the image's rank.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan
from torch import Tensor

from impasto.models import video_autoencoder
from impasto.models.video_autoencoder import FrameReader


def is_video_vae(vae: torch.nn.Module) -> bool:
    """Whether ``vae`` is a causal video autoencoder (Wan 2.1's): it takes clips."""
    return isinstance(vae, AutoencoderKLWan)


def temporal_compression(vae: torch.nn.Module) -> int:
    """Frames per latent frame after the first (4 for Wan's VAE; 1 for an image VAE)."""
    return video_autoencoder.TEMPORAL_FACTOR if is_video_vae(vae) else 1


def latent_frames(vae: torch.nn.Module, frames: int) -> int:
    """Latent frames of a clip of ``frames`` frames (an image: 1)."""
    return 1 + (frames - 1) // temporal_compression(vae)


def _as_clip(vae: torch.nn.Module, pixels: Tensor) -> tuple[Tensor, bool]:
    """Images for a video VAE as one-frame clips; whether they were images."""
    image = is_video_vae(vae) and pixels.dim() == 4
    return (pixels[:, :, None] if image else pixels), image


def latent_posterior(vae: AutoencoderKL, pixels: Tensor) -> tuple[Tensor, Tensor]:
    """The posterior (mean, std) ``[B, C, h, w]`` of images in [-1, 1] (of clips ``[B, C, T,
    H, W]``: ``[B, z, t, h, w]``)."""
    if is_video_vae(vae):
        clips, image = _as_clip(vae, pixels)
        mean, std = video_autoencoder.clip_posterior(vae, clips)
        return (mean[:, :, 0], std[:, :, 0]) if image else (mean, std)
    first = next(vae.parameters())  # what vae.device and vae.dtype find, without their module walk
    posterior = vae.encode(pixels.to(first.device, first.dtype)).latent_dist
    return posterior.mean, posterior.std


def clip_posterior_chunked(
    vae: AutoencoderKL, read_frames: FrameReader, num_frames: int, chunk_frames: int = 16
) -> tuple[Tensor, Tensor]:
    """The posterior (mean, std) ``[B, z, t, h, w]`` of one clip of ``num_frames`` frames read
    ``chunk_frames`` at a time (:func:`~impasto.models.video_autoencoder.encode_clip_chunked`:
    equal to :func:`latent_posterior` of the whole clip); an image VAE takes no clips."""
    if not is_video_vae(vae):
        raise ValueError(
            f"the autoencoder ({type(vae).__name__}) encodes images, not clips; use a video "
            "autoencoder (a Wan 2.1 VAE) for data.video"
        )
    return video_autoencoder.encode_clip_chunked(vae, read_frames, num_frames, chunk_frames)


def _latent_stats(vae: AutoencoderKL, like: Tensor) -> tuple[Tensor, Tensor] | None:
    config = vae.config
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    if mean is None or std is None:
        return None
    return (
        torch.tensor(mean).view(1, -1, 1, 1).to(like),
        torch.tensor(std).view(1, -1, 1, 1).to(like),
    )


def _shift(vae: AutoencoderKL) -> float:
    return float(getattr(vae.config, "shift_factor", None) or 0.0)


def encode_latents(vae: AutoencoderKL, sample: Tensor) -> Tensor:
    """A posterior sample → the denoiser's latent space (see the module docstring)."""
    if is_video_vae(vae):
        clips, image = _as_clip(vae, sample)
        latents = video_autoencoder.encode_clip_latents(vae, clips)
        return latents[:, :, 0] if image else latents
    scale = float(vae.config.scaling_factor)
    stats = _latent_stats(vae, sample)
    if stats is not None:
        return (sample - stats[0]) * scale / stats[1]
    shift = _shift(vae)
    return (sample - shift) * scale if shift else sample * scale


def decode_images(vae: AutoencoderKL, latents: Tensor, checkpointing: bool = False) -> Tensor:
    """The inverse of :func:`encode_latents`, then the decoder; [-1, 1] → [0, 1] clamped (as
    the pipelines and NeMo-Aligner's DRaFT+), float32 on the decoder's device, gradients
    flowing to ``latents``. ``checkpointing``: diffusers' per-block gradient checkpointing
    of the decoder."""
    if is_video_vae(vae):
        return _decode_clips(vae, latents, checkpointing)
    if checkpointing != vae.decoder.gradient_checkpointing:
        if checkpointing:
            vae.enable_gradient_checkpointing()
        else:
            vae.disable_gradient_checkpointing()
    scale = float(vae.config.scaling_factor)
    latents = latents.to(device=vae.device, dtype=vae.dtype)
    stats = _latent_stats(vae, latents)
    if stats is not None:
        latents = latents * stats[1] / scale + stats[0]
    else:
        shift = _shift(vae)
        latents = latents / scale + shift if shift else latents / scale
    image = vae.decode(latents).sample.float()
    return (image / 2 + 0.5).clamp(0, 1)


def _decode_clips(vae: AutoencoderKLWan, latents: Tensor, checkpointing: bool) -> Tensor:
    """:func:`decode_images` of a video VAE: clips ``[B, 3, T, H, W]`` (images keep their
    rank)."""
    if checkpointing:
        raise ValueError(
            "draftp.checkpoint_decoder: diffusers' Wan VAE does not checkpoint its decoder; "
            "set it to false"
        )
    clips, image = _as_clip(vae, latents.to(device=vae.device, dtype=vae.dtype))
    frames = vae.decode(video_autoencoder.raw_clip_latents(vae, clips)).sample.float()
    frames = (frames / 2 + 0.5).clamp(0, 1)
    return frames[:, :, 0] if image else frames


def decode_latents(vae: AutoencoderKL, latents: Tensor) -> Tensor:
    """:func:`decode_images` without gradients, one image at a time (decoding is the
    peak-memory step at SDXL resolutions), float32 on the CPU."""
    with torch.no_grad():
        return torch.cat([decode_images(vae, latent).cpu() for latent in latents.split(1)])


def latent_format(vae: AutoencoderKL) -> tuple[int, int]:
    """(latent channels, the spatial downsampling factor)."""
    config = vae.config
    if is_video_vae(vae):
        return int(config.z_dim), int(vae.spatial_compression_ratio)
    return int(config.latent_channels), 2 ** (len(config.block_out_channels) - 1)
