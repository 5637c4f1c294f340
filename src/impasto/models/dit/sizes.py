"""The DiT's sizes: the DiT paper's S, B, L, XL (Peebles & Xie 2023, arXiv:2212.09748, Table 1),
NeMo's large cross-attention shapes, and ``tiny`` for CPU tests and the demo.

A size fixes depth, width and heads; the block variant, patch size and positions are options
(:mod:`impasto.models.dit.options`). NeMo's ``DiT7BConfig`` is 32 layers of width 3072 with 24
heads; NeMo does not publish its 28B shape, so ``28b`` is MovieGen's width (6144, 48 heads,
Polyak et al. 2024) at the depth where the cross-attention DiT holds 28 B parameters.

:data:`CLIP_BENCH` names the video models of ``impasto bench --model dit-NAME`` (issue #32):
a size through the video autoencoder, with the clips its step trains on.
"""

from __future__ import annotations

from dataclasses import dataclass

from impasto.models.backbone import ClipBenchModel


@dataclass(frozen=True)
class DiTSize:
    num_layers: int
    hidden_size: int
    num_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SIZES: dict[str, DiTSize] = {
    "tiny": DiTSize(num_layers=6, hidden_size=128, num_heads=4),
    "s": DiTSize(num_layers=12, hidden_size=384, num_heads=6),
    "b": DiTSize(num_layers=12, hidden_size=768, num_heads=12),
    "l": DiTSize(num_layers=24, hidden_size=1024, num_heads=16),
    "xl": DiTSize(num_layers=28, hidden_size=1152, num_heads=16),
    "7b": DiTSize(num_layers=32, hidden_size=3072, num_heads=24),
    "28b": DiTSize(num_layers=30, hidden_size=6144, num_heads=48),
}
"""``model.preset`` of the DiT family → its size."""


VIDEO_OPTIONS = {"autoencoder": "video"}  # model.dit: clips through the causal video VAE

CLIP_BENCH: dict[str, ClipBenchModel] = {
    # The video demo's clips (docs/video.md): 17, 13 and 9 frames and images at 64², through
    # the demo video VAE (4x temporal, 8x spatial): 80, 64, 48 and 16 tokens.
    "video-tiny": ClipBenchModel("tiny", VIDEO_OPTIONS, 64, (17, 13, 9, 1)),
    # NeMo's 7B DiT at its 8k context (the seed's table: "256 frames of 256px video" through
    # an 8x temporal tokenizer, 32 latent frames): one clip of 125 frames at 256² through a
    # 4x video VAE is the same 32 latent frames of 16x16 patches, 8192 tokens. Full
    # self-attention over the clip, as NeMo's cross-attention DiT.
    "7b-video": ClipBenchModel("7b", VIDEO_OPTIONS, 256, (125,), samples=1),
}
"""``impasto bench --model dit-NAME`` → its video model (docs/dit.md, benchmarking)."""
