"""Image preprocessing for SDXL: resize, flip, crop, and the micro-conditioning it implies.

SDXL is conditioned on the original image size and the crop's top-left corner (Podell et al.,
"SDXL: Improving Latent Diffusion Models for High-Resolution Image Synthesis", 2023, sec. 2.2).
We follow the diffusers ``train_text_to_image_sdxl.py`` convention: ``original_size`` is
``(height, width)`` before resizing, ``crop_top_left`` is ``(top, left)`` in the resized image.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

# What a broken file can raise while PIL opens and decodes it: OSError covers
# UnidentifiedImageError and "image file is truncated"; some decoders raise SyntaxError or
# ValueError on corrupt headers, and DecompressionBombError on absurd sizes.
IMAGE_LOAD_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    Image.DecompressionBombError,
)

CropOffsets = Callable[[int, int, int, int, torch.Generator], tuple[int, int]]
"""``(height, width, crop_height, crop_width, generator) -> (top, left)`` of a crop of that size
inside a ``height x width`` image (a ``resolution`` square, or an aspect bucket)."""


def center_crop_offsets(
    height: int, width: int, crop_height: int, crop_width: int, generator: torch.Generator
) -> tuple[int, int]:
    """Top-left of the centred crop, rounded like torchvision's ``CenterCrop`` (draws nothing)."""
    top = max(0, int(round((height - crop_height) / 2.0)))
    left = max(0, int(round((width - crop_width) / 2.0)))
    return top, left


def random_crop_offsets(
    height: int, width: int, crop_height: int, crop_width: int, generator: torch.Generator
) -> tuple[int, int]:
    """Uniform top-left of a crop inside the image; draws top, then left, from ``generator``."""
    top = int(torch.randint(0, height - crop_height + 1, (1,), generator=generator))
    left = int(torch.randint(0, width - crop_width + 1, (1,), generator=generator))
    return top, left


CROP_MODES: dict[str, CropOffsets] = {
    "center": center_crop_offsets,
    "random": random_crop_offsets,
}


def get_crop_offsets(crop: str) -> CropOffsets:
    """Look up a crop mode by name in :data:`CROP_MODES`."""
    if crop not in CROP_MODES:
        valid = ", ".join(sorted(CROP_MODES))
        raise ValueError(f"data: unknown crop {crop!r}; valid crops are {valid}")
    return CROP_MODES[crop]


def resized_size(height: int, width: int, resolution: int) -> tuple[int, int]:
    """``(height, width)`` after resizing the shorter side to ``resolution``.

    The longer side is truncated, as torchvision's ``Resize(int)`` does.
    """
    if height <= width:
        return resolution, int(resolution * width / height)
    return int(resolution * height / width), resolution


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image to a float32 tensor ``[3, H, W]`` in ``[-1, 1]``.

    Same arithmetic as torchvision's ``ToTensor()`` then ``Normalize([0.5], [0.5])``, so
    values match bit for bit.
    """
    array = np.array(image.convert("RGB"), dtype=np.uint8)  # [H, W, 3], a writable copy
    pixels = torch.from_numpy(array).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
    return pixels.sub(0.5).div(0.5)


def resize_and_crop(
    image: Image.Image,
    resolution: int,
    crop: str,
    random_flip: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Resize, optionally flip, and crop an image to a ``resolution`` square.

    Steps: convert to RGB (also RGBA, L, P, CMYK...); resize the shorter side to
    ``resolution`` (PIL bilinear); flip horizontally with probability 0.5 when ``random_flip``;
    crop a ``resolution`` square, centred or at a random offset.

    The flip coin is always drawn from ``generator`` first (used only when ``random_flip``), so
    random crop offsets do not depend on the flip setting; a random crop then draws top, left.

    Args:
        image: any PIL image.
        resolution: side of the square output, in pixels.
        crop: a name in :data:`CROP_MODES` ("center" or "random").
        random_flip: whether to flip horizontally with probability 0.5.
        generator: the only source of randomness (a CPU ``torch.Generator``).

    Returns:
        ``(pixel_values, original_size, crop_top_left)``: pixels as float32 ``[3, R, R]`` in
        ``[-1, 1]``; ``(height, width)`` before resizing; ``(top, left)`` of the crop in the
        resized (and possibly flipped) image.
    """
    crop_offsets = get_crop_offsets(crop)
    if resolution <= 0:
        raise ValueError(f"data: resolution must be positive, got {resolution}")
    rgb = image.convert("RGB")
    original_size = (rgb.height, rgb.width)
    height, width = resized_size(rgb.height, rgb.width, resolution)
    resized = rgb.resize((width, height), resample=Image.Resampling.BILINEAR)
    flip = bool(torch.rand((), generator=generator) < 0.5)
    if random_flip and flip:
        resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    top, left = crop_offsets(height, width, resolution, resolution, generator)
    cropped = resized.crop((left, top, left + resolution, top + resolution))
    return pil_to_tensor(cropped), original_size, (top, left)
