"""Aspect-ratio bucketing for SDXL: bucket lists, assignment, crop parameters, epoch plans.

Multi-aspect training (Podell et al., "SDXL: Improving Latent Diffusion Models for
High-Resolution Image Synthesis", 2023, sec. 2.3) groups images into buckets of about 1024²
pixels with sides in multiples of 64; every batch comes from one bucket and the UNet receives
the bucket size as ``target_size``. Everything here is a pure function of its arguments; the
only randomness is an explicit ``torch.Generator``. Sizes are ``(height, width)`` throughout.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from impasto.data.folder import ImageRecord
from impasto.data.seeding import derive_seed
from impasto.data.skips import error_reason
from impasto.data.transforms import (
    IMAGE_LOAD_ERRORS,
    get_crop_offsets,
    pil_to_tensor,
    resized_size,
)

Bucket = tuple[int, int]
"""``(height, width)`` of a bucket, in pixels."""

# The 40 (height, width) training resolutions of the SDXL paper, appendix I ("Multi-aspect
# training"), ordered by aspect ratio height / width from 0.25 to 4.0 as in the paper's table.
# Cross-checked against copies of that table in neurosis (SDXLBucketList) and PixArt
# (ASPECT_RATIO_1024). The table is not symmetric: 704x1344 has no 1344x704 transpose.
# Areas range from 0.902·1024² (704x1344) to exactly 1024².
SDXL_BUCKETS: tuple[Bucket, ...] = (
    (512, 2048), (512, 1984), (512, 1920), (512, 1856), (576, 1792),
    (576, 1728), (576, 1664), (640, 1600), (640, 1536), (704, 1472),
    (704, 1408), (704, 1344), (768, 1344), (768, 1280), (832, 1216),
    (832, 1152), (896, 1152), (896, 1088), (960, 1088), (960, 1024),
    (1024, 1024), (1024, 960), (1088, 960), (1088, 896), (1152, 896),
    (1152, 832), (1216, 832), (1280, 768), (1344, 768), (1408, 704),
    (1472, 704), (1536, 640), (1600, 640), (1664, 576), (1728, 576),
    (1792, 576), (1856, 512), (1920, 512), (1984, 512), (2048, 512),
)  # fmt: skip


def generate_buckets(max_area: int, min_side: int, max_side: int, step: int) -> list[Bucket]:
    """Buckets of at most ``max_area`` pixels, kohya/OneTrainer style.

    For each width ``w`` in ``min_side, min_side + step, ..., max_side``: the largest height
    ``h`` that is a multiple of ``step``, at most ``max_side`` and with ``h * w <= max_area``;
    the pair is kept if ``h >= min_side``, together with its transpose. Duplicates are removed.

    Returns:
        ``(height, width)`` pairs sorted by aspect ratio ``height / width`` (then by height).
    """
    if step <= 0:
        raise ValueError(f"data.buckets: step must be positive, got {step}")
    if min_side <= 0 or min_side % step or max_side % step:
        raise ValueError(
            f"data.buckets: min_side ({min_side}) and max_side ({max_side}) must be positive "
            f"multiples of step ({step})"
        )
    if min_side > max_side:
        raise ValueError(f"data.buckets: min_side {min_side} is larger than max_side {max_side}")
    if max_area < min_side * min_side:
        raise ValueError(f"data.buckets: max_area {max_area} is below min_side² {min_side**2}")
    buckets: set[Bucket] = set()
    for width in range(min_side, max_side + 1, step):
        height = min(max_side, max_area // width // step * step)
        if height >= min_side:
            buckets.update({(height, width), (width, height)})
    return sorted(buckets, key=lambda bucket: (Fraction(*bucket), bucket[0]))


def aspect_distance(height: int, width: int, bucket: Bucket) -> float:
    """``|log(height / width) - log(bucket_h / bucket_w)|``, the aspect error of a bucket."""
    return abs(math.log(height * bucket[1]) - math.log(width * bucket[0]))


def assign_bucket(
    height: int, width: int, buckets: Sequence[Bucket], no_upscale: bool = False
) -> Bucket | None:
    """The bucket whose aspect ratio is closest to the image's, in log space.

    The distance is ``|log(h / w) - log(bh / bw)|``, compared exactly (as the rational
    ``max(r, 1 / r)`` with ``r = h·bw / (w·bh)``) so that ties are real ties; they go to the
    smaller bucket area, then to the smaller ``(bh, bw)``.

    Error bound: sort the buckets by log-aspect and let ``g`` be the largest gap between
    neighbours. An image whose log-aspect lies within the buckets' range gets a bucket with
    ``|log error| <= g / 2``, so its aspect ratio is off by at most a factor ``exp(g / 2)``
    (relative error ``exp(g / 2) - 1``), and the crop that follows the cover-resize keeps at
    least ``exp(-g / 2)`` of the resized image. Outside the range the error is the distance to
    the extreme bucket. For :data:`SDXL_BUCKETS`, ``g = log((576/1792) / (512/1856)) ≈ 0.153``:
    at most 7.9 % aspect error and 7.4 % of the image cropped away.

    Args:
        height, width: image size in pixels.
        buckets: candidate ``(height, width)`` buckets.
        no_upscale: only allow buckets the image fills without upscaling (``bh <= height`` and
            ``bw <= width``); the bound above then holds only within those buckets.

    Returns:
        The bucket, or ``None`` when ``no_upscale`` leaves no bucket (the caller reports it).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"data.buckets: image size must be positive, got {height}x{width}")
    if not buckets:
        raise ValueError("data.buckets: the bucket list is empty")
    if no_upscale:
        buckets = [bucket for bucket in buckets if bucket[0] <= height and bucket[1] <= width]
        if not buckets:
            return None

    def sort_key(bucket: Bucket) -> tuple[Fraction, int, Bucket]:
        image_side, bucket_side = height * bucket[1], width * bucket[0]
        ratio = Fraction(max(image_side, bucket_side), min(image_side, bucket_side))
        return ratio, bucket[0] * bucket[1], bucket

    return min(buckets, key=sort_key)


@dataclass(frozen=True)
class BucketCrop:
    """How one image becomes a bucket-sized training image, and its SDXL micro-conditioning.

    Attributes:
        original_size: ``(height, width)`` of the source image.
        resize_to: ``(height, width)`` after the cover-resize, at least the bucket in both.
        crop_top_left: ``(top, left)`` of the bucket-size crop in the resized image as it is
            fed to the model, i.e. in the flipped resized image when ``flip`` is set.
        target_size: the bucket ``(height, width)``.
        flip: whether the image is flipped horizontally.
        resample: the resize filter, "lanczos" (buckets) or "bilinear" (squares).
    """

    original_size: Bucket
    resize_to: Bucket
    crop_top_left: Bucket
    target_size: Bucket
    flip: bool
    resample: str = "lanczos"

    @property
    def add_time_ids(self) -> tuple[int, int, int, int, int, int]:
        """SDXL's ``[orig_h, orig_w, crop_top, crop_left, target_h, target_w]``."""
        return (*self.original_size, *self.crop_top_left, *self.target_size)


def cover_size(height: int, width: int, bucket: Bucket) -> Bucket:
    """``(height, width)`` of the image scaled by ``max(bh / h, bw / w)`` to cover ``bucket``.

    The side that sets the scale becomes the bucket side exactly; the other is truncated with
    ``int()`` as torchvision's ``Resize`` does, and never drops below the bucket side.
    """
    bucket_h, bucket_w = bucket
    if bucket_h * width >= bucket_w * height:  # height sets the scale
        return bucket_h, max(bucket_w, int(bucket_h * width / height))
    return max(bucket_h, int(bucket_w * height / width)), bucket_w


def bucket_transform_params(
    height: int,
    width: int,
    bucket: Bucket,
    crop: str,
    flip: bool,
    generator: torch.Generator,
) -> BucketCrop:
    """Choose the resize, crop and flip for an image of ``height x width`` in ``bucket``.

    Draws, in order: the crop position (``crop="random"``: top, then left), then the flip coin
    (only when ``flip`` is enabled). Center crop without flip draws nothing.

    Crop conditioning under a flip: SDXL's ``crop_top_left`` must describe the pixels the model
    sees. The crop is chosen at ``left`` in the unflipped resized image; mirrored, that crop
    starts at ``resize_w - left - bucket_w`` in the flipped resized image, and that is what is
    recorded. This matches diffusers' ``train_text_to_image_sdxl.py``, which flips the resized
    image and then crops it, so its offsets are measured in the flipped image; kohya's
    sd-scripts also mirrors the left offset on flip (``target_w - crop_right``), but its
    offsets are the letterbox position of the image fitted inside the bucket, not the crop,
    and ignore random crops. Some versions of the diffusers script cropped first and recorded
    ``crop_w - left`` after flipping, which describes neither image.

    Returns:
        A :class:`BucketCrop`; its ``add_time_ids`` are
        ``(original_size, crop_top_left, target_size)``.
    """
    crop_offsets = get_crop_offsets(crop)
    if height <= 0 or width <= 0:
        raise ValueError(f"data.buckets: image size must be positive, got {height}x{width}")
    if bucket[0] <= 0 or bucket[1] <= 0:
        raise ValueError(f"data.buckets: bucket sides must be positive, got {bucket}")
    resize_to = cover_size(height, width, bucket)
    top, left = crop_offsets(*resize_to, *bucket, generator)
    flipped = flip and bool(torch.rand((), generator=generator) < 0.5)
    if flipped:
        left = resize_to[1] - left - bucket[1]
    return BucketCrop(
        original_size=(height, width),
        resize_to=resize_to,
        crop_top_left=(top, left),
        target_size=tuple(bucket),
        flip=flipped,
    )


RESAMPLE = {"lanczos": Image.Resampling.LANCZOS, "bilinear": Image.Resampling.BILINEAR}


def square_transform_params(
    height: int, width: int, resolution: int, crop: str, flip: bool, generator: torch.Generator
) -> BucketCrop:
    """The parameters :func:`~impasto.data.transforms.resize_and_crop` uses, from the same
    draws (the flip coin first, always; then a random crop's top, left), without the pixels."""
    crop_offsets = get_crop_offsets(crop)
    resize_to = resized_size(height, width, resolution)
    flipped = bool(torch.rand((), generator=generator) < 0.5) and flip
    top, left = crop_offsets(*resize_to, resolution, resolution, generator)
    return BucketCrop(
        (height, width), resize_to, (top, left), (resolution, resolution), flipped, "bilinear"
    )


@dataclass(frozen=True)
class ImageTransform:
    """How a run turns each image into a training image: a ``resolution`` square
    (:func:`square_transform_params`) or its aspect bucket (:func:`bucket_transform_params`)."""

    resolution: int
    crop: str
    random_flip: bool
    bucketed: bool

    def params(
        self, height: int, width: int, bucket: Bucket | None, generator: torch.Generator
    ) -> BucketCrop:
        """This image's resize, crop and flip, drawn from ``generator``."""
        if not self.bucketed:
            return square_transform_params(
                height, width, self.resolution, self.crop, self.random_flip, generator
            )
        if bucket is None:
            raise ValueError("data: an image without a bucket has no transform; skip it")
        flip = self.random_flip
        return bucket_transform_params(height, width, bucket, self.crop, flip, generator)

    def every_params(self, height: int, width: int, bucket: Bucket | None) -> list[BucketCrop]:
        """Every outcome :meth:`params` can draw: unflipped (and flipped with random_flip).

        Only a center crop has a small set of outcomes (what a cache can hold)."""
        if self.crop != "center":
            raise ValueError("data: a random crop has too many outcomes to list; use center")
        unflipped = replace(
            self.params(height, width, bucket, torch.Generator().manual_seed(0)), flip=False
        )
        if not self.random_flip:
            return [unflipped]
        top, left = unflipped.crop_top_left
        if self.bucketed:  # offsets are mirrored (bucket_transform_params)
            left = unflipped.resize_to[1] - left - unflipped.target_size[1]
        return [unflipped, replace(unflipped, flip=True, crop_top_left=(top, left))]


def apply_bucket_transform(image: Image.Image, params: BucketCrop) -> torch.Tensor:
    """Resize (PIL Lanczos, or ``params.resample``), flip, crop: float32 ``[3, bh, bw]`` in
    ``[-1, 1]``.

    Lanczos is a windowed sinc that antialiases when downscaling, which is most images at
    SDXL sizes; SimpleTuner resizes with it too. The flip is applied to the resized image
    before cropping at ``params.crop_top_left``, so the offsets are exactly the pixels fed.
    """
    rgb = image.convert("RGB")
    if (rgb.height, rgb.width) != params.original_size:
        raise ValueError(
            f"data.buckets: image is {rgb.height}x{rgb.width} but the crop parameters were "
            f"made for {params.original_size[0]}x{params.original_size[1]}"
        )
    resized_h, resized_w = params.resize_to
    resized = rgb.resize((resized_w, resized_h), resample=RESAMPLE[params.resample])
    if params.flip:
        resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    top, left = params.crop_top_left
    bucket_h, bucket_w = params.target_size
    return pil_to_tensor(resized.crop((left, top, left + bucket_w, top + bucket_h)))


@dataclass
class BucketReport:
    """Images per bucket, and the images that could not be placed with the reason
    (``unreadable``: those among them whose header does not read; bad data, not a setting)."""

    counts: dict[Bucket, int] = field(default_factory=dict)
    unplaced: dict[str, str] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)

    def format(self) -> str:
        """A readable table: one row per bucket by aspect ratio, then the unplaced images."""
        total = sum(self.counts.values())
        lines = [f"{'bucket (h x w)':>16}  {'aspect':>6}  {'images':>7}"]
        for (height, width), count in sorted(self.counts.items(), key=lambda i: Fraction(*i[0])):
            lines.append(f"{f'{height} x {width}':>16}  {height / width:6.3f}  {count:7d}")
        lines.append(f"{'total':>16}  {'':6}  {total:7d}")
        if self.unplaced:
            lines.append(f"{len(self.unplaced)} image(s) not placed:")
            lines.extend(f"  {name}: {reason}" for name, reason in sorted(self.unplaced.items()))
        return "\n".join(lines)


def bucket_report(
    assignments: Mapping[str, Bucket | None], reasons: Mapping[str, str] | None = None
) -> BucketReport:
    """Count images per bucket; an image assigned ``None`` is listed with its reason.

    Args:
        assignments: image name (e.g. its path) to its bucket, or ``None`` if it fits none.
        reasons: why an unplaced image fits none; default "fits no bucket".
    """
    reasons = reasons or {}
    counts = Counter(bucket for bucket in assignments.values() if bucket is not None)
    unplaced = {
        name: reasons.get(name, "fits no bucket")
        for name, bucket in assignments.items()
        if bucket is None
    }
    return BucketReport(counts=dict(counts), unplaced=unplaced)


def image_size(image: ImageRecord | str | Path) -> tuple[int, int]:
    """``(height, width)`` of an image file or record, from what the source knows or the
    file's header (the pixels are not decoded)."""
    if isinstance(image, ImageRecord):
        if image.size is not None:
            return image.size
        opened = image.open_image()
    else:
        opened = Image.open(image)
    with opened:
        width, height = opened.size
    return height, width


def assign_image_buckets(
    images: Sequence[ImageRecord | str | Path], buckets: Sequence[Bucket], no_upscale: bool = False
) -> tuple[list[Bucket | None], BucketReport]:
    """Each image's bucket (reading only its header) and the report of where they went.

    An unreadable image or one that fits no bucket gets ``None``, with the reason in the report;
    the data loader then leaves it out and the report says so (nothing is dropped silently).
    """
    placed: dict[tuple[str, str], Bucket | None] = {}  # repeated records: one file, opened once
    reasons, unreadable = {}, []
    names = [str(image.image_path if isinstance(image, ImageRecord) else image) for image in images]
    keys = [(n, repr(getattr(i, "blob", None))) for i, n in zip(images, names, strict=True)]
    for image, name, key in zip(images, names, keys, strict=True):
        if key in placed:
            continue
        placed[key] = None
        try:
            height, width = image_size(image)
        except IMAGE_LOAD_ERRORS as error:
            reasons[name] = f"unreadable image: {error_reason(error)}"
            unreadable.append(name)
        else:
            placed[key] = assign_bucket(height, width, buckets, no_upscale)
            if placed[key] is None:
                reasons[name] = f"{height}x{width} is smaller than every bucket (no upscale)"
    bucket_of = [placed[key] for key in keys]
    report = bucket_report(dict(zip(names, bucket_of, strict=True)), reasons)
    report.unreadable = unreadable
    return bucket_of, report


def plan_bucket_batches(
    bucket_of: Sequence[Bucket | None], batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Full, single-bucket batches of dataset indices for one epoch, in training order.

    Under a generator seeded with ``derive_seed(seed, epoch)``, for each bucket in ``(h, w)``
    order: shuffle its indices, cut them into batches of ``batch_size``, and fill a short last
    batch with indices drawn from the bucket's earlier batches (without repeats, so a batch
    holds distinct images; a bucket smaller than ``batch_size`` has no earlier batches and
    repeats its own images). Then shuffle the list of batches. Every placed index appears at
    least once; indices whose bucket is ``None`` are left out (report them elsewhere).

    The plan is a pure function of its arguments, so ``(epoch, batch_in_epoch)`` is enough to
    resume it exactly.
    """
    if batch_size <= 0:
        raise ValueError(f"data.buckets: batch_size must be positive, got {batch_size}")
    members: dict[Bucket, list[int]] = {}
    for index, bucket in enumerate(bucket_of):
        if bucket is not None:
            members.setdefault(tuple(bucket), []).append(index)
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    batches: list[list[int]] = []
    for bucket in sorted(members):
        indices = members[bucket]
        order = torch.randperm(len(indices), generator=generator).tolist()
        batches += fill_batches([indices[i] for i in order], batch_size, generator)
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def fill_batches(
    order: Sequence[int], batch_size: int, generator: torch.Generator
) -> list[list[int]]:
    """``order`` cut into batches of ``batch_size``; a short last batch is filled with indices
    drawn from the earlier batches (distinct while they last; from ``order`` itself when there
    are no earlier batches), so every batch is full and no index is left out."""
    order = list(order)
    num_short = len(order) % batch_size
    if num_short:
        earlier = order[: len(order) - num_short] or order
        order += draw_fill(earlier, batch_size - num_short, generator)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def draw_fill(pool: Sequence[int], num: int, generator: torch.Generator) -> list[int]:
    """``num`` items of ``pool`` in random order, repeating only once ``pool`` is used up."""
    picks: list[int] = []
    while len(picks) < num:
        order = torch.randperm(len(pool), generator=generator).tolist()
        picks += [pool[i] for i in order[: num - len(picks)]]
    return picks


def buckets_from(data: Any) -> list[tuple[int, int]] | None:
    """The (height, width) buckets of a ``data`` config section's ``buckets``, or None for
    square ``resolution`` images."""
    if data.buckets == "none":
        return None
    if data.buckets == "sdxl":
        return list(SDXL_BUCKETS)
    low, high, step = data.bucket_sides()
    return generate_buckets(data.resolution**2, low, high, step)
