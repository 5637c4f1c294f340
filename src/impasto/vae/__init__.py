"""The tiny demo VAE: architecture, training, reconstruction metrics and weight files.

``train_vae(data_dir, out_file, ...)`` trains the tiny preset's ``AutoencoderKL`` on an image
folder (``impasto train-vae`` on the command line); ``load_demo_vae()`` loads the one shipped in
the package, trained on the demo shapes (see docs/demo-vae.md). ``train_video_vae(out_dir,
...)`` trains the demo video VAE, a tiny Wan 2.1 ``AutoencoderKLWan``, on the video demo's
clips (``python -m impasto.vae.video``); ``load_demo_video_vae()`` loads the shipped one (see
docs/video.md).

Names are imported on first use (PEP 562), so ``import impasto.vae.cli`` (which the ``impasto``
parser does) does not pull in torch and diffusers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "TINY_VAE_CONFIG": "impasto.vae.architecture",
    "build_tiny_vae": "impasto.vae.architecture",
    "load_demo_vae": "impasto.models.vae_files",
    "load_demo_video_vae": "impasto.models.video_autoencoder",
    "load_vae_file": "impasto.models.vae_files",
    "read_vae_metadata": "impasto.models.vae_files",
    "save_vae_file": "impasto.models.vae_files",
    "evaluate_vae": "impasto.vae.metrics",
    "latent_std": "impasto.vae.metrics",
    "load_images": "impasto.vae.metrics",
    "mean_psnr": "impasto.vae.metrics",
    "psnr": "impasto.vae.metrics",
    "reconstruct": "impasto.vae.metrics",
    "PIXEL_LOSSES": "impasto.vae.objective",
    "VaeLossOutput": "impasto.vae.objective",
    "vae_loss": "impasto.vae.objective",
    "VaeTrainSettings": "impasto.vae.settings",
    "VaeReport": "impasto.vae.train",
    "lr_at": "impasto.vae.train",
    "train_vae": "impasto.vae.train",
    "TINY_VIDEO_VAE_CONFIG": "impasto.vae.video_architecture",
    "build_tiny_video_vae": "impasto.vae.video_architecture",
    "evaluate_video_vae": "impasto.vae.video_metrics",
    "latent_channel_stats": "impasto.vae.video_metrics",
    "reconstruct_clips": "impasto.vae.video_metrics",
    "VideoVaeTrainSettings": "impasto.vae.settings",
    "VideoVaeReport": "impasto.vae.video_train",
    "train_video_vae": "impasto.vae.video_train",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'impasto.vae' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
