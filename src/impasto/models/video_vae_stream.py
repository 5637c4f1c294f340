"""Wan's causal VAE run on a clip a few frames at a time, with diffusers' spatial tiles.

diffusers' ``AutoencoderKLWan`` already encodes in temporal steps (the first frame alone,
then 4 frames at a time) and decodes one latent frame at a time, carrying each causal
convolution's last frames in a feature cache, but only over a whole tensor held in memory.
:class:`CausalStream` takes those steps one call at a time, so a caller can read (or write) a
long clip in chunks. It calls the same modules in the same order on the same tensors, with its
own caches (one per spatial tile), so the result equals ``vae.encode`` / ``vae.decode`` of the
whole clip; the vae's own cache attributes are never touched.

Tiling follows ``vae.use_tiling`` and diffusers' tile geometry (``tile_sample_min_*``,
``tile_sample_stride_*``) and blend (``vae.blend_v`` / ``vae.blend_h``). The blend is the same
for every frame, so blending each step's tiles and concatenating over time equals blending the
whole clip's tiles, as ``tiled_encode`` / ``tiled_decode`` do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
from torch import Tensor, nn

ENCODE_STEP_FRAMES = 4  # diffusers' AutoencoderKLWan._encode: frame 0 alone, then 4 at a time

FeatureCache = list[Any]  # one entry per WanCausalConv3d: its last frames, "Rep" or None
Step = Callable[[Tensor, FeatureCache, bool], Tensor]


@dataclass(frozen=True)
class TileGrid:
    """diffusers' spatial tiles, (height, width) pairs: tiles of ``size`` start every
    ``stride`` in the input; each output tile blends ``blend`` rows/columns with its upper and
    left neighbours, then keeps its first ``keep``."""

    size: tuple[int, int]
    stride: tuple[int, int]
    blend: tuple[int, int]
    keep: tuple[int, int]


def encode_grid(vae: AutoencoderKLWan, height: int, width: int) -> TileGrid | None:
    """The tiles ``vae.tiled_encode`` uses for frames of ``height`` × ``width``; None where
    ``vae.encode`` does not tile."""
    size = (vae.tile_sample_min_height, vae.tile_sample_min_width)
    if not vae.use_tiling or (height <= size[0] and width <= size[1]):
        return None
    factor = vae.spatial_compression_ratio
    stride = (vae.tile_sample_stride_height, vae.tile_sample_stride_width)
    keep = (stride[0] // factor, stride[1] // factor)
    blend = (size[0] // factor - keep[0], size[1] // factor - keep[1])
    return TileGrid(size, stride, blend, keep)


def decode_grid(vae: AutoencoderKLWan, height: int, width: int) -> TileGrid | None:
    """The tiles ``vae.tiled_decode`` uses for latents of ``height`` × ``width``; None where
    ``vae.decode`` does not tile."""
    factor = vae.spatial_compression_ratio
    sample_size = (vae.tile_sample_min_height, vae.tile_sample_min_width)
    size = (sample_size[0] // factor, sample_size[1] // factor)
    if not vae.use_tiling or (height <= size[0] and width <= size[1]):
        return None
    keep = (vae.tile_sample_stride_height, vae.tile_sample_stride_width)
    stride = (keep[0] // factor, keep[1] // factor)
    blend = (sample_size[0] - keep[0], sample_size[1] - keep[1])
    return TileGrid(size, stride, blend, keep)


def encode_step(vae: AutoencoderKLWan) -> Step:
    """Frames ``[B, C, 1 or 4, H, W]`` → moments ``[B, 2z, 1, h, w]`` (mean, then log-variance)."""

    def step(frames: Tensor, cache: FeatureCache, first: bool) -> Tensor:
        # a fresh index list per call: the encoder counts its convolutions in it
        return vae.quant_conv(vae.encoder(frames, feat_cache=cache, feat_idx=[0]))

    return step


def decode_step(vae: AutoencoderKLWan) -> Step:
    """Raw latents ``[B, z, 1, h, w]`` → frames ``[B, C, 1 (first) or 4, H, W]``, unclamped."""

    def step(latents: Tensor, cache: FeatureCache, first: bool) -> Tensor:
        hidden = vae.post_quant_conv(latents)
        return vae.decoder(hidden, feat_cache=cache, feat_idx=[0], first_chunk=first)

    return step


class CausalStream:
    """``step`` applied to successive temporal steps of one clip, each spatial tile carrying
    its own feature cache from step to step (so a stream serves one clip, then is dropped).
    Build one with :meth:`encoder` or :meth:`decoder`."""

    def __init__(self, vae: AutoencoderKLWan, module: nn.Module, step: Step,
                 grid: TileGrid | None, out_size: tuple[int, int]) -> None:  # fmt: skip
        self.vae, self.step, self.grid, self.out_size = vae, step, grid, out_size
        self.num_convs = sum(isinstance(m, WanCausalConv3d) for m in module.modules())
        self.caches: dict[tuple[int, int], FeatureCache] = {}
        self.first = True

    @classmethod
    def encoder(cls, vae: AutoencoderKLWan, height: int, width: int) -> CausalStream:
        """Frames of ``height`` × ``width``, 1 then 4 per call → moments, 1 latent frame each."""
        factor = vae.spatial_compression_ratio
        grid = encode_grid(vae, height, width)
        return cls(vae, vae.encoder, encode_step(vae), grid, (height // factor, width // factor))

    @classmethod
    def decoder(cls, vae: AutoencoderKLWan, height: int, width: int) -> CausalStream:
        """Raw latents of ``height`` × ``width``, 1 latent frame per call → 1, then 4 frames."""
        factor = vae.spatial_compression_ratio
        grid = decode_grid(vae, height, width)
        return cls(vae, vae.decoder, decode_step(vae), grid, (height * factor, width * factor))

    def _cache(self, origin: tuple[int, int]) -> FeatureCache:
        return self.caches.setdefault(origin, [None] * self.num_convs)

    def __call__(self, x: Tensor) -> Tensor:
        """One temporal step ``[B, C, t, H, W]`` → its output, tiles blended and cropped."""
        first, self.first = self.first, False
        if self.grid is None:
            return self.step(x, self._cache((0, 0)), first)
        (size_h, size_w), (stride_h, stride_w) = self.grid.size, self.grid.stride
        rows = [
            [self.step(x[..., i : i + size_h, j : j + size_w], self._cache((i, j)), first)
             for j in range(0, x.shape[-1], stride_w)]
            for i in range(0, x.shape[-2], stride_h)
        ]  # fmt: skip
        return self._blend(rows)[..., : self.out_size[0], : self.out_size[1]]

    def _blend(self, rows: list[list[Tensor]]) -> Tensor:
        # As tiled_encode / tiled_decode: blend_v and blend_h write into the lower/right tile,
        # which later rows and columns then read blended.
        (blend_h, blend_w), (keep_h, keep_w) = self.grid.blend, self.grid.keep
        result_rows = []
        for i, row in enumerate(rows):
            result_row = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = self.vae.blend_v(rows[i - 1][j], tile, blend_h)
                if j > 0:
                    tile = self.vae.blend_h(row[j - 1], tile, blend_w)
                result_row.append(tile[..., :keep_h, :keep_w])
            result_rows.append(torch.cat(result_row, dim=-1))
        return torch.cat(result_rows, dim=-2)
