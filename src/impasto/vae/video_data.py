"""The demo video VAE's data: the video demo's clips and the image demo's images, made in memory.

Every clip is a pure function of ``(seed, index, frames, side)`` (:func:`demo_clip_spec`), so
a run needs no dataset on disk and replays exactly. Each training step takes one geometry
``(frames, side)`` in turn (:func:`step_geometry`: images only for a warm-up, then
:data:`GEOMETRIES`), cuts its items to random squares, and takes as many as fit in the step's
pixel budget; images are 1-frame clips, as a video run sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from impasto.data.demo import demo_spec, render_demo_image
from impasto.data.demo_video import demo_clip_spec, render_demo_clip

CLIP_FRAMES: tuple[int, ...] = (9, 13, 17)  # the video demo's lengths (4n + 1 from 9 to 17)
SIDES: tuple[int, ...] = (32, 48, 64)
GEOMETRIES: tuple[tuple[int, int], ...] = (
    (17, 64), (9, 32), (1, 64), (13, 48), (9, 64), (17, 32),
    (1, 48), (13, 64), (9, 48), (17, 48), (1, 32), (13, 32),
)  # fmt: skip
"""``(frames, side)`` of the training batch of step ``s``: ``GEOMETRIES[s % 12]``. Every clip
geometry of :data:`CLIP_FRAMES` x :data:`SIDES` once, and images (1 frame) of each side: one
step in four trains on images."""

IMAGE_GEOMETRIES: tuple[tuple[int, int], ...] = ((1, 64), (1, 32), (1, 48))
"""``(frames, side)`` of the image warm-up's steps (see :func:`step_geometry`)."""

MAX_INDEX = 2**31 - 1  # clip indices are drawn from [0, MAX_INDEX)


@dataclass(frozen=True)
class ClipSet:
    """Same-geometry items: ``frames`` ``[N, 3, T, S, S]`` in [-1, 1] and their captions."""

    frames: Tensor
    captions: tuple[str, ...]

    @property
    def geometry(self) -> tuple[int, int]:
        """``(frames, side)``."""
        return self.frames.shape[2], self.frames.shape[-1]


def frames_to_tensor(frames: np.ndarray) -> Tensor:
    """uint8 RGB frames ``[T, H, W, 3]`` → float32 ``[3, T, H, W]`` in [-1, 1]."""
    pixels = torch.from_numpy(np.array(frames, dtype=np.uint8)).permute(3, 0, 1, 2)  # a copy
    return pixels.float() / 127.5 - 1.0


def demo_item(
    index: int, seed: int, num_frames: int, side: int, held_out: bool = False
) -> tuple[Tensor, str]:
    """Item ``index`` of geometry ``(num_frames, side)``: ``([3, T, S, S], caption)``.

    ``num_frames == 1`` is image ``index`` of the image demo (:func:`demo_spec`; it has no
    held-out combinations, so ``held_out`` is ignored); otherwise clip ``index`` of the video
    demo (:func:`demo_clip_spec`), of its held-out combinations where ``held_out``.
    """
    if num_frames == 1:
        spec = demo_spec(index, seed, side)
        frames = np.asarray(render_demo_image(spec, side))[None]
        return frames_to_tensor(frames), spec.caption
    clip_spec = demo_clip_spec(index, seed, side, num_frames, held_out)
    return frames_to_tensor(render_demo_clip(clip_spec, side)), clip_spec.caption


def batch_size_for(num_frames: int, side: int, batch_pixels: int) -> int:
    """Items of ``num_frames`` frames of ``side`` px in a budget of ``batch_pixels`` (>= 1)."""
    return max(1, batch_pixels // (num_frames * side * side))


def step_geometry(step: int, image_steps: int) -> tuple[int, int]:
    """``(frames, side)`` of step ``step``: images only (:data:`IMAGE_GEOMETRIES` in turn) for
    the first ``image_steps`` steps, then :data:`GEOMETRIES` in turn."""
    if step < image_steps:
        return IMAGE_GEOMETRIES[step % len(IMAGE_GEOMETRIES)]
    return GEOMETRIES[(step - image_steps) % len(GEOMETRIES)]


def training_batch(
    step: int,
    seed: int,
    batch_pixels: int,
    image_steps: int,
    crop: int,
    generator: torch.Generator,
) -> Tensor:
    """The frames ``[B, 3, T, C, C]`` of step ``step`` (geometry ``(T, S)``:
    :func:`step_geometry`): items at indices drawn from ``generator`` (dataset ``seed``'s
    training combinations), each cut to a ``C = min(crop, S)`` px square at an offset drawn
    from ``generator`` (``crop`` 0: whole items, ``C = S``).

    Crops put several clips in every step where whole 64 px clips would give one or two for
    the same pixels; the VAE is convolutional, so it decodes whole frames all the same.
    """
    num_frames, side = step_geometry(step, image_steps)
    crop_side = min(crop, side) if crop else side
    batch_size = batch_size_for(num_frames, crop_side, batch_pixels)
    indices = torch.randint(MAX_INDEX, (batch_size,), generator=generator).tolist()
    offsets = torch.randint(side - crop_side + 1, (batch_size, 2), generator=generator).tolist()
    items = []
    for index, (top, left) in zip(indices, offsets, strict=True):
        frames = demo_item(index, seed, num_frames, side)[0]
        items.append(frames[..., top : top + crop_side, left : left + crop_side])
    return torch.stack(items)


def clip_set(
    seed: int, num_frames: int, side: int, num_items: int, held_out: bool = False
) -> ClipSet:
    """Items ``0 .. num_items - 1`` of geometry ``(num_frames, side)`` (see :func:`demo_item`)."""
    items = [demo_item(index, seed, num_frames, side, held_out) for index in range(num_items)]
    return ClipSet(torch.stack([frames for frames, _ in items]), tuple(c for _, c in items))


def clip_sets(seed: int, num_per_geometry: int, held_out: bool = False) -> list[ClipSet]:
    """One :func:`clip_set` of ``num_per_geometry`` clips per clip geometry (9 in all); 18 per
    geometry cover every (colour, shape) pair, and with ``held_out`` every held-out
    combination."""
    return [
        clip_set(seed, num_frames, side, num_per_geometry, held_out)
        for num_frames in CLIP_FRAMES
        for side in SIDES
    ]


def image_sets(seed: int, num_per_side: int) -> list[ClipSet]:
    """One set of ``num_per_side`` image demo images (1-frame clips) per side."""
    return [clip_set(seed, 1, side, num_per_side) for side in SIDES]
