"""Differentiable CLIP image preprocessing, in torch, so reward gradients reach the pixels.

The same three steps as NeMo-Aligner's DRaFT+ reward models
(``nemo_aligner/models/mm/stable_diffusion/image_text_rms.py``: torchvision
``Resize(224, BICUBIC, antialias=True)``, ``CenterCrop(224)``, ``Normalize(mean, std)``) and
OpenAI CLIP's own ``_transform``: resize the shortest side, crop the centre square, normalise.
Images are ``[B, 3, H, W]`` in [0, 1]; the result is ``[B, 3, crop, crop]`` float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG = "preprocessor_config.json"


@dataclass(frozen=True)
class ClipPreprocess:
    """How a CLIP model wants its pixels: shortest side → ``resize``, centre ``crop`` square,
    then ``(x - mean) / std`` per channel."""

    resize: int
    crop: int
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD


def resized_size(height: int, width: int, shortest_side: int) -> tuple[int, int]:
    """``(H', W')`` with the shorter side ``shortest_side`` and the longer one scaled and
    truncated, as torchvision's ``Resize(int)`` and transformers' ``shortest_edge`` compute."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_side * long / short)
    return (new_long, shortest_side) if width <= height else (shortest_side, new_long)


def resize_shortest_side(images: Tensor, shortest_side: int) -> Tensor:
    """Bicubic, antialiased resize of ``[B, C, H, W]`` to the shorter side ``shortest_side``
    (torchvision ``Resize(size, BICUBIC, antialias=True)`` on tensors); unchanged at that size.
    No clamping: like torchvision, bicubic may overshoot [0, 1] slightly."""
    height, width = images.shape[-2:]
    size = resized_size(height, width, shortest_side)
    if size == (height, width):
        return images
    return F.interpolate(images, size=size, mode="bicubic", align_corners=False, antialias=True)


def center_crop(images: Tensor, crop: int) -> Tensor:
    """The centre ``crop``×``crop`` of ``[B, C, H, W]``, offsets rounded as torchvision's
    ``CenterCrop`` (``round((H - crop) / 2)``); the image must be at least ``crop`` each way."""
    height, width = images.shape[-2:]
    if height < crop or width < crop:
        raise ValueError(f"cannot centre-crop {crop}x{crop} from a {height}x{width} image")
    top = int(round((height - crop) / 2.0))
    left = int(round((width - crop) / 2.0))
    return images[..., top : top + crop, left : left + crop]


def normalize(images: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """``(images - mean) / std`` per channel of ``[B, C, H, W]``."""
    mean_t = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean_t) / std_t


def clip_preprocess(images: Tensor, preprocess: ClipPreprocess) -> Tensor:
    """``[B, 3, H, W]`` in [0, 1] → CLIP pixels ``[B, 3, crop, crop]`` float32, differentiable.

    Runs in float32 whatever the input dtype (antialiased bicubic has no bf16 CPU kernel, and
    the model casts to its own dtype afterwards).
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"CLIP preprocessing takes [B, 3, H, W] images, got {tuple(images.shape)}")
    pixels = resize_shortest_side(images.float(), preprocess.resize)
    pixels = center_crop(pixels, preprocess.crop)
    return normalize(pixels, preprocess.mean, preprocess.std)


def _square_size(value: Any, key: str, file: Path) -> int:
    """An int from a processor size entry: ``224``, ``{"shortest_edge": 224}`` or
    ``{"height": 224, "width": 224}``."""
    if isinstance(value, int):
        return value
    if isinstance(value, dict) and isinstance(value.get("shortest_edge"), int):
        return value["shortest_edge"]
    if isinstance(value, dict) and isinstance(value.get("height"), int):
        if value["height"] == value.get("width"):
            return value["height"]
    raise ValueError(
        f"{file}: {key} {value!r} is not a square CLIP size; set it to an int or "
        '{"height": N, "width": N}'
    )


def read_clip_preprocess(folder: Path, image_size: int) -> ClipPreprocess:
    """The preprocessing of the CLIP model in ``folder``: its ``preprocessor_config.json``
    (``size``, ``crop_size``, ``image_mean``, ``image_std``) where present, else resize and
    crop to the vision tower's ``image_size`` with the OpenAI CLIP mean and std."""
    file = folder / PREPROCESSOR_CONFIG
    if not file.is_file():
        return ClipPreprocess(resize=image_size, crop=image_size)
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is unreadable ({error}); fix or delete it") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object; fix or delete it")
    crop = _square_size(raw.get("crop_size", image_size), "crop_size", file)
    resize = _square_size(raw.get("size", crop), "size", file)
    mean = tuple(float(v) for v in raw.get("image_mean", OPENAI_CLIP_MEAN))
    std = tuple(float(v) for v in raw.get("image_std", OPENAI_CLIP_STD))
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"{file}: image_mean and image_std need 3 values each (RGB); fix them")
    if crop != image_size:
        raise ValueError(
            f"{file}: crop_size {crop} but the vision model takes {image_size}x{image_size} "
            "images; set crop_size to its image_size"
        )
    if resize < crop:
        raise ValueError(f"{file}: size {resize} is smaller than crop_size {crop}; raise size")
    return ClipPreprocess(resize=resize, crop=crop, mean=mean, std=std)  # type: ignore[arg-type]


__all__ = [
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ClipPreprocess",
    "center_crop",
    "clip_preprocess",
    "normalize",
    "read_clip_preprocess",
    "resize_shortest_side",
    "resized_size",
]
