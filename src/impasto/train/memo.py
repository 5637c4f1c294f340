"""Encodings of the frozen VAE and text encoders, kept in RAM after their first computation.

``cache.latents: memory`` and ``cache.text_embeddings: memory``. Entries live on the CPU and
move to the encoders' device per batch. Each item is encoded on its
own (a batch of one), so its value depends only on its key, not on the batch it first came in:
a resumed run, which starts with an empty memo, gets bitwise the same encodings. Batches from
the on-disk cache (``disk``, :mod:`impasto.data.cache`) carry their encodings already.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from impasto.config import Config
from impasto.data import Batch
from impasto.models import PromptEmbeds, SDXLComponents, encode_prompts


class EncodingMemo:
    """Per-image VAE posteriors (mean, std) and per-caption SDXL text embeddings."""

    def __init__(self, latents: bool, text_embeddings: bool) -> None:
        self.latents = latents
        self.text_embeddings = text_embeddings
        self._posteriors: dict[int, tuple[Tensor, Tensor]] = {}
        self._prompts: dict[str, tuple[Tensor, Tensor]] = {}

    @classmethod
    def from_config(cls, config: Config) -> EncodingMemo:
        return cls(config.cache.latents == "memory", config.cache.text_embeddings == "memory")

    def posterior(self, models: SDXLComponents, batch: Batch) -> tuple[Tensor, Tensor]:
        """The VAE posterior's mean and std ``[B, C, h, w]`` of the batch's images."""
        vae = models.vae
        if batch.latent_mean is not None:  # from the disk cache: straight to the UNet
            device = models.unet.device
            return batch.latent_mean.to(device).float(), batch.latent_std.to(device).float()
        if not self.latents:
            posterior = vae.encode(batch.pixel_values.to(vae.device, vae.dtype)).latent_dist
            return posterior.mean, posterior.std
        indices = batch.indices.tolist()
        for row, index in enumerate(indices):
            if index not in self._posteriors:  # only new images go to the device
                pixels = batch.pixel_values[row : row + 1].to(vae.device, vae.dtype)
                posterior = vae.encode(pixels).latent_dist
                self._posteriors[index] = (posterior.mean[0].cpu(), posterior.std[0].cpu())
        means, stds = zip(*(self._posteriors[i] for i in indices), strict=True)
        return torch.stack(means).to(vae.device), torch.stack(stds).to(vae.device)

    def prompts(
        self,
        models: SDXLComponents,
        captions: list[str],
        autocast: Callable[[], AbstractContextManager],
        cached: tuple[Tensor, Tensor] | None = None,
    ) -> PromptEmbeds:
        """SDXL text conditioning of ``captions`` (see :func:`impasto.models.encode_prompts`);
        the batch's cached encodings (``cached``) when it has them."""
        if cached is not None:  # from the disk cache: straight to the UNet, in its dtype
            device, dtype = models.unet.device, models.unet.dtype
            return PromptEmbeds(cached[0].to(device, dtype), cached[1].to(device, dtype))
        if not self.text_embeddings:
            with autocast():
                return encode_prompts(models, captions)
        for caption in dict.fromkeys(captions):
            if caption not in self._prompts:
                with autocast():
                    encoded = encode_prompts(models, [caption])
                self._prompts[caption] = (
                    encoded.prompt_embeds[0].cpu(),
                    encoded.pooled_prompt_embeds[0].cpu(),
                )
        device = models.text_encoder_2.device
        embeds, pooled = zip(*(self._prompts[c] for c in captions), strict=True)
        return PromptEmbeds(
            prompt_embeds=torch.stack(embeds).to(device),
            pooled_prompt_embeds=torch.stack(pooled).to(device),
        )
