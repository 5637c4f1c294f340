"""The samples of the packed-vs-padded bench (:mod:`impasto.bench.packed`): images in the
demo's three aspect ratios at a resolution, or square clips of several frame counts (a video
model's: images are one-frame clips), as a cache delivers them (random latents' posteriors and
text embeddings, grouped by shape as a pack of ``data.pack_tokens``), and the sequence each
layout needs for them."""

from __future__ import annotations

from collections.abc import Sequence
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
    """The step's samples: ``counts[i]`` samples of ``shapes[i]`` (height, width), each of
    ``frames[i]`` frames (1: an image) and ``tokens[i]`` tokens. ``clips``: the samples are
    clips of a video model, its images one-frame clips (``[C, 1, h, w]`` latents)."""

    shapes: tuple[tuple[int, int], ...]
    counts: tuple[int, ...]
    tokens: tuple[int, ...]
    frames: tuple[int, ...] = ()  # () : every sample one frame
    clips: bool = False

    @property
    def num_images(self) -> int:
        """Samples (images and clips)."""
        return sum(self.counts)

    @property
    def image_tokens(self) -> int:
        """The samples' tokens (without padding)."""
        return sum(c * t for c, t in zip(self.counts, self.tokens, strict=True))

    def frame_counts(self) -> tuple[int, ...]:
        return self.frames or (1,) * len(self.shapes)

    def layouts(self) -> tuple[str, ...]:
        """The layouts the bench times: padded and packed; packed alone when every sample
        has one shape (nothing to pad: the two layouts are the same sequence)."""
        return ("padded", "packed") if len(self.shapes) > 1 else ("packed",)

    def capacity(self, layout: str) -> int:
        """The sequence length (``data.pack_tokens``) of ``layout``."""
        if layout == "padded":
            return pack_length(self.num_images * max(self.tokens))
        return pack_length(self.image_tokens)


def image_mix(backbone: Backbone, resolution: int, images: int | None) -> ImageMix:
    """The demo's three aspect ratios at ``resolution``: ``images`` dealt over them in turn,
    the square first (``--batch 1``: one square image), or by default as many of each as fill
    :data:`PADDED_TOKENS` padded tokens."""
    shapes = tuple(
        tuple(max(1, round(resolution * a / SIDE_MULTIPLE)) * SIDE_MULTIPLE for a in aspect)
        for aspect in ASPECTS
    )
    tokens = tuple(backbone.sequence_length(height, width) for height, width in shapes)
    if images is None:
        counts = per_shape(None, tokens, "images", "shapes")
    elif images < 1:
        raise ValueError(f"bench: --batch {images}: give at least one image")
    else:
        counts = tuple(
            images // len(shapes) + (i < images % len(shapes)) for i in range(len(shapes))
        )
    kept = [i for i, count in enumerate(counts) if count]
    return ImageMix(
        tuple(shapes[i] for i in kept),
        tuple(counts[i] for i in kept),
        tuple(tokens[i] for i in kept),
    )


def per_shape(total: int | None, tokens: Sequence[int], what: str, kinds: str) -> tuple[int, ...]:
    """How many samples of each shape the step holds: ``total`` split evenly over the shapes
    (default: as many as fill :data:`PADDED_TOKENS` padded tokens); ValueError if it cannot."""
    shapes = len(tokens)
    if total is None:
        total = max(1, PADDED_TOKENS // max(tokens) // shapes) * shapes
    if total < 1 or total % shapes:
        raise ValueError(
            f"bench: --batch {total}: the step holds as many {what} of each of the "
            f"{shapes} {kinds}; use a multiple of {shapes}"
        )
    return (total // shapes,) * shapes


def clip_mix(
    backbone: Backbone, resolution: int, frames: tuple[int, ...], samples: int | None
) -> ImageMix:
    """Square clips of ``resolution`` pixels, one shape per count of ``frames`` (1: an image),
    ``samples`` in all (default: as many as fill :data:`PADDED_TOKENS` padded tokens), as many
    of each shape."""
    if len(set(frames)) != len(frames):
        raise ValueError(f"bench: --frames {' '.join(map(str, frames))} names a count twice; "
                         "list each once")  # fmt: skip
    tokens = []
    for count in frames:
        try:
            tokens.append(backbone.sequence_length(resolution, resolution, count))
        except ValueError as error:
            raise ValueError(
                f"bench: --frames {count} at --resolution {resolution}: {error}"
            ) from None
    counts = per_shape(samples, tokens, "clips", "frame counts")
    shapes = ((resolution, resolution),) * len(frames)
    return ImageMix(shapes, counts, tuple(tokens), tuple(frames), clips=True)


def synthetic_pack(backbone: Backbone, mix: ImageMix, seed: int = 0) -> Batch:
    """A pack as the cache delivers it: one group of random latents' posteriors and text
    embeddings per shape (the text's shapes are what ``backbone`` encodes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        text = backbone.encode_text([""])
    groups, first = [], 0
    for (height, width), count, frames in zip(
        mix.shapes, mix.counts, mix.frame_counts(), strict=True
    ):
        latent = backbone.latent_shape(height, width, frames if mix.clips else None)
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
