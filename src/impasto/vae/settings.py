"""Settings of a VAE run (no torch import, so the CLI can build its parser quickly)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VaeTrainSettings:
    """Hyperparameters of a VAE run; the defaults made the shipped demo VAE."""

    resolution: int = 64
    steps: int = 4000
    batch_size: int = 16
    lr: float = 2e-3
    warmup_steps: int = 100  # linear warmup, then cosine decay to 0
    loss: str = "mse"
    kl_weight: float = 1e-6
    max_grad_norm: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class VideoVaeTrainSettings:
    """Hyperparameters of a video VAE run (:mod:`impasto.vae.video_train`) on the video demo's
    clips; the defaults made the first stage of the shipped demo video VAE, a fine-tune of it
    with ``init`` the second (docs/video.md)."""

    steps: int = 2000
    batch_pixels: int = 69632  # frames x height x width per step: one 17-frame 64 px clip
    image_steps: int = 300  # the first steps train on images only, then clips and images
    crop: int = 32  # train on random squares of this side (0: whole clips)
    lr: float = 2e-3
    warmup_steps: int = 100  # linear warmup, then cosine decay to 0
    loss: str = "mse"
    kl_weight: float = 1e-6
    max_grad_norm: float = 1.0
    seed: int = 0
    init: str = ""  # a video VAE folder to start from ("": a fresh init from ``seed``)
