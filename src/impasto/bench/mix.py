"""The images of the packed-vs-padded bench (:mod:`impasto.bench.packed`): the demo's three
aspect ratios at a resolution, as a cache delivers them (random latents' posteriors and text
embeddings, grouped by shape as a pack of ``data.pack_tokens``), and the sequence each layout
needs for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impasto.data import Batch
from impasto.models.backbone import Backbone

PACK_MULTIPLE = 128  # data.pack_tokens is a multiple of 128 (FlexAttention's block)
ASPECTS = ((1.0, 1.0), (0.75, 1.25), (1.25, 0.75))  # the demo's 64x64, 48x80, 80x48
SIDE_MULTIPLE = 16  # sides rounded to it: the demo VAE's factor 8 × patch size 2
PADDED_TOKENS = 3072  # default images: as many as fill this many padded tokens


def pack_length(tokens: int) -> int:
    """The pack that holds ``tokens``: rounded up to a multiple of :data:`PACK_MULTIPLE`."""
    return -(-tokens // PACK_MULTIPLE) * PACK_MULTIPLE


@dataclass(frozen=True)
class ImageMix:
    """The step's images: ``counts[i]`` images of ``shapes[i]`` (height, width), each of
    ``tokens[i]`` tokens."""

    shapes: tuple[tuple[int, int], ...]
    counts: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def num_images(self) -> int:
        return sum(self.counts)

    @property
    def image_tokens(self) -> int:
        return sum(c * t for c, t in zip(self.counts, self.tokens, strict=True))

    def capacity(self, layout: str) -> int:
        """The sequence length (``data.pack_tokens``) of ``layout``."""
        if layout == "padded":
            return pack_length(self.num_images * max(self.tokens))
        return pack_length(self.image_tokens)


def image_mix(backbone: Backbone, resolution: int, images: int | None) -> ImageMix:
    """The demo's three aspect ratios at ``resolution``, ``images`` in all (default: as many
    as fill :data:`PADDED_TOKENS` padded tokens), as many of each shape."""
    shapes = tuple(
        tuple(max(1, round(resolution * a / SIDE_MULTIPLE)) * SIDE_MULTIPLE for a in aspect)
        for aspect in ASPECTS
    )
    tokens = tuple(backbone.sequence_length(height, width) for height, width in shapes)
    if images is None:
        images = max(1, PADDED_TOKENS // max(tokens) // len(shapes)) * len(shapes)
    if images < 1 or images % len(shapes):
        raise ValueError(
            f"bench: --batch {images}: the step holds as many images of each of the "
            f"{len(shapes)} shapes; use a multiple of {len(shapes)}"
        )
    return ImageMix(shapes, (images // len(shapes),) * len(shapes), tokens)


def synthetic_pack(backbone: Backbone, mix: ImageMix, seed: int = 0) -> Batch:
    """A pack as the cache delivers it: one group of random latents' posteriors and text
    embeddings per shape (the text's shapes are what ``backbone`` encodes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        text = backbone.encode_text([""])
    groups, first = [], 0
    for (height, width), count in zip(mix.shapes, mix.counts, strict=True):
        latent = backbone.latent_shape(height, width)
        sizes = torch.tensor([[height, width]] * count)
        groups.append(Batch(
            pixel_values=None, captions=[""] * count, original_sizes=sizes,
            crop_top_lefts=torch.zeros(count, 2, dtype=torch.long), target_sizes=sizes,
            indices=torch.arange(first, first + count),
            latent_mean=torch.randn(count, *latent, generator=generator),
            latent_std=torch.full((count, *latent), 0.01),
            prompt_embeds=torch.randn(count, *text.prompt_embeds.shape[1:], generator=generator),
            pooled_prompt_embeds=torch.randn(
                count, *text.pooled_prompt_embeds.shape[1:], generator=generator
            ),
        ))  # fmt: skip
        first += count
    return Batch(
        pixel_values=None,
        captions=[""] * first,
        original_sizes=torch.cat([group.original_sizes for group in groups]),
        crop_top_lefts=torch.zeros(first, 2, dtype=torch.long),
        target_sizes=torch.cat([group.target_sizes for group in groups]),
        indices=torch.arange(first),
        groups=tuple(groups),
    )
