"""Encodings of the frozen autoencoder and text encoders, kept in RAM after their first use.

``cache.latents: memory`` and ``cache.text_embeddings: memory``. Entries live on the CPU and
move to the encoders' device per batch. Each item is encoded on its own (a batch of one), so
its value depends only on its key, not on the batch it first came in: a resumed run, which
starts with an empty memo, gets bitwise the same encodings. Batches from the on-disk cache
(``disk``, :mod:`impasto.data.cache`) carry their encodings already.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from impasto.data import Batch
from impasto.models.backbone import Backbone, split_rows, stack_rows


def memo_keys(batch: Batch) -> list[tuple[int, int]]:
    """Each row's posterior key: its record, and a clip's first frame (a video's clip may
    start elsewhere each epoch: ``data.video.placement: random``)."""
    indices = batch.indices.tolist()
    starts = [-1] * len(indices) if batch.clip_starts is None else batch.clip_starts.tolist()
    return list(zip(indices, starts, strict=True))


class EncodingMemo:
    """Per-image (per-clip) latent posteriors (mean, std) and per-caption text encodings."""

    def __init__(self, latents: bool, text_embeddings: bool) -> None:
        self.latents = latents
        self.text_embeddings = text_embeddings
        self._posteriors: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self._texts: dict[str, Any] = {}

    @property
    def texts(self) -> dict[str, Any]:
        """Caption → its encoding's row (CPU): filled ahead of a text-encoder release too
        (:mod:`impasto.train.text_release`)."""
        return self._texts

    @classmethod
    def from_config(cls, config: Any) -> EncodingMemo:
        return cls(config.cache.latents == "memory", config.cache.text_embeddings == "memory")

    def encoded(self, index: int, start: int) -> bool:
        """Whether the posterior of record ``index`` (a clip from frame ``start``, -1 for an
        image) is memoised: the dataset need not read its pixels again."""
        return (index, start) in self._posteriors

    def posterior(self, backbone: Backbone, batch: Batch) -> tuple[Tensor, Tensor]:
        """The posterior's mean and std ``[B, C, h, w]`` of the batch's images."""
        if batch.latent_mean is not None:  # from the disk cache: straight to the denoiser
            device = backbone.device
            return batch.latent_mean.to(device).float(), batch.latent_std.to(device).float()
        if not self.latents:
            return backbone.latent_posterior(batch.pixel_values)
        keys = memo_keys(batch)
        for row, key in enumerate(keys):
            if key not in self._posteriors:  # only new images go to the device
                mean, std = backbone.latent_posterior(batch.pixel_values[row : row + 1])
                self._posteriors[key] = (mean[0].cpu(), std[0].cpu())
        means, stds = zip(*(self._posteriors[key] for key in keys), strict=True)
        device = backbone.device  # one device holds every network of a training process
        return torch.stack(means).to(device), torch.stack(stds).to(device)

    def text(
        self,
        backbone: Backbone,
        captions: list[str],
        autocast: Callable[[], AbstractContextManager],
    ) -> Any:
        """The text encoding of ``captions`` (``Backbone.encode_text``), memoised per caption
        with ``cache.text_embeddings: memory``."""
        if not self.text_embeddings:
            with autocast():
                return backbone.encode_text(captions)
        for caption in dict.fromkeys(captions):
            if caption not in self._texts:
                with autocast():
                    self._texts[caption] = split_rows(backbone.encode_text([caption]))[0]
        return stack_rows([self._texts[caption] for caption in captions], backbone.device)


def share_encodings(setup: Any, config: Any, data: Any, prompts: list[Any]) -> None:
    """Before the first step (``setup``: the trainer's ``StepSetup``, ``data``: its
    ``RunData``, ``prompts``: the validation prompts): release the frozen text encoders once the
    run's texts are encoded (:mod:`impasto.train.text_release`), and skip reading pixels whose
    latents the memo holds (:func:`skip_memoised_pixels`)."""
    from impasto.train.text_release import release_text_encoders

    release_text_encoders(setup, config, data, prompts)
    skip_memoised_pixels(setup, config, data)


def skip_memoised_pixels(setup: Any, config: Any, data: Any) -> None:
    """With ``cache.latents: memory`` and the loader in the training process
    (``data.num_workers: 0``), the dataset reads no pixels of an image or clip whose latents
    the memo holds (after the first epoch: none). Decoding a demo clip's 9 frames every epoch
    took 22 % of the video demo's step. A loader worker holds a copy of the dataset, which
    could not see the memo fill: it reads every image, as before."""
    memo = getattr(setup.method, "memo", None)
    loader = getattr(data.stream, "loader", None)
    if memo is None or not memo.latents or loader is None or config.data.num_workers:
        return
    loader.dataset.memoised = memo.encoded
