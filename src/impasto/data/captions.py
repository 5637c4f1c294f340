"""Caption tools for tag-style captions ("1girl, red hair, smiling"): shuffle, dropout, weights.

Captions are split into tags at ``separator``. kohya sd-scripts' conventions: the first
``keep_tags`` tags stay first and are never dropped (a trigger word, a character name); the
rest are shuffled (``shuffle_caption``) and each dropped with probability ``tag_dropout``
(``caption_tag_dropout_rate``); ``prefix`` / ``suffix`` are added around the result. Every draw
comes from the example's own generator, and nothing is drawn when a tool is off, so enabling
one never changes another's randomness.

Tag-frequency loss weighting: an image whose tags are rare in the dataset weighs more. Image
i's raw score is the mean over its tags of 1/count(tag); its weight is that score divided by
the dataset's mean score (so the average weight is 1), clamped to [min, max]. The weight is
per sample and multiplies that sample's loss (``Batch.loss_weights``), not the batch mean.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from impasto.data.seeding import derive_seed

CAPTION_STREAM = 7_361  # separates caption-variant seeds from (seed, epoch, index) ones


def split_tags(caption: str, separator: str = ",") -> list[str]:
    """The non-empty, stripped tags of ``caption``."""
    return [tag.strip() for tag in caption.split(separator) if tag.strip()]


@dataclass(frozen=True)
class CaptionTools:
    """What to do to each caption before it is encoded (all off by default)."""

    shuffle: bool = False
    keep_tags: int = 0
    tag_dropout: float = 0.0
    prefix: str = ""
    suffix: str = ""
    separator: str = ","

    @property
    def active(self) -> bool:
        return self.shuffle or self.tag_dropout > 0 or bool(self.prefix or self.suffix)

    @property
    def random(self) -> bool:
        """Whether one caption can come out in several ways (shuffle or tag dropout)."""
        return self.shuffle or self.tag_dropout > 0

    def variant(self, caption: str, seed: int, variant: int, index: int) -> str:
        """Variant ``variant`` of record ``index``'s caption: what a text cache holds when
        captions are augmented (``cache.caption_variants``), drawn from its own stream."""
        stream = torch.Generator().manual_seed(derive_seed(seed, CAPTION_STREAM, variant, index))
        return self.apply(caption, stream)

    def apply(self, caption: str, generator: torch.Generator) -> str:
        """The augmented caption; draws (shuffle, then dropout) only for the enabled tools."""
        if not self.active:
            return caption
        tags = split_tags(caption, self.separator)
        kept, rest = tags[: self.keep_tags], tags[self.keep_tags :]
        if self.shuffle and len(rest) > 1:
            rest = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
        if self.tag_dropout > 0 and rest:
            keep = torch.rand(len(rest), generator=generator) >= self.tag_dropout
            rest = [tag for tag, kept_tag in zip(rest, keep.tolist(), strict=True) if kept_tag]
        joined = f"{self.separator} ".join(kept + rest)
        return "".join(part for part in (self.prefix, joined, self.suffix))


def tag_frequency_weights(
    captions: Sequence[str], min_weight: float, max_weight: float, separator: str = ","
) -> list[float]:
    """Per-image loss weights from how rare its tags are (module docstring), mean 1 unclamped.

    An image without tags gets weight 1.
    """
    if not 0 < min_weight <= 1 <= max_weight:
        raise ValueError(
            f"data: need 0 < tag_weight_min <= 1 <= tag_weight_max, got {min_weight}, {max_weight}"
        )
    tag_sets = [set(split_tags(caption, separator)) for caption in captions]
    counts = Counter(tag for tags in tag_sets for tag in tags)
    scores = [
        sum(1 / counts[tag] for tag in tags) / len(tags) if tags else None for tags in tag_sets
    ]
    known = [score for score in scores if score is not None]
    mean = sum(known) / len(known) if known else 1.0
    return [
        1.0 if score is None else min(max_weight, max(min_weight, score / mean)) for score in scores
    ]


def caption_tools_from(data: Any) -> CaptionTools:
    """The :class:`CaptionTools` a ``data`` config section describes."""
    return CaptionTools(
        shuffle=data.shuffle_tags,
        keep_tags=data.keep_tags,
        tag_dropout=data.tag_dropout,
        prefix=data.caption_prefix,
        suffix=data.caption_suffix,
        separator=data.tag_separator,
    )
