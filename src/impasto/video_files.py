"""Clips on disk: H.264 ``.mp4`` through PyAV (the ``video`` extra), animated ``.webp`` and
``.gif`` previews and frame grids through Pillow (issue #32; docs/video.md).

A clip here is ``[T, H, W, 3]`` uint8 RGB frames; :func:`clip_frames` converts a generated clip
``[3, T, H, W]`` in [0, 1]. Each writer takes a path or an open binary file (``impasto sample``
creates its files exclusively, never overwriting one).

- ``.mp4``: H.264 in yuv420p, the pixel format every player decodes. yuv420p keeps one chroma
  sample per 2x2 pixels, so both sides must be even, and H.264 is lossy: decoded colours drift
  by a few levels and edges blur.
- ``.webp``: lossless and looping; ``.gif``: 256 colours, looping, frame times in 10 ms steps.
  Both store identical consecutive frames once, shown for their total time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import numpy as np
from PIL import Image
from torch import Tensor

CLIP_FPS = 16.0  # frames per second of a sampled clip when the run does not say (Wan 2.1's)
# Constant quality: 12 is visually lossless for flat colours (the default, 23, smears a demo
# shape's edges at 32 px); the rate stays small either way.
MP4_CRF = 12
MAX_GRID_FRAMES = 17  # frames a grid shows at most: all of a 17-frame clip, every 5th of 81
MAX_GRID_WIDTH = 4096  # pixels; a clip's frame grid wraps into rows to stay narrower
GRID_PADDING = 2  # pixels between frames and around the grid, white
GRID_BACKGROUND = 255

Target = str | Path | BinaryIO


def import_av(purpose: str = "video data") -> ModuleType:
    """PyAV, imported on first use, or a one-line error naming ``purpose`` and how to install
    it."""
    try:
        import av
    except ImportError:
        raise ValueError(
            f"{purpose} needs PyAV: pip install 'impasto[video]' (in a checkout: "
            "pip install -e '.[video]')"
        ) from None
    return av


def clip_frames(clip: Tensor) -> np.ndarray:
    """``[3, T, H, W]`` in [0, 1] → ``[T, H, W, 3]`` uint8 (round to nearest, as ``to_pil``)."""
    pixels = (clip.detach().float().cpu() * 255).round().clamp(0, 255).byte()
    return pixels.permute(1, 2, 3, 0).contiguous().numpy()


def _target(target: Target) -> str | BinaryIO:
    return str(target) if isinstance(target, (str, Path)) else target


def write_mp4(frames: np.ndarray, target: Target, fps: float, crf: int = MP4_CRF) -> None:
    """``frames`` as H.264 (yuv420p, constant quality ``crf``) in an ``.mp4`` at ``fps``; a
    one-line error for odd sides (yuv420p needs even ones) or without PyAV."""
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(
            f"an .mp4 (H.264, yuv420p) needs even sides, got {width}x{height}; use an even size "
            "or write .webp"
        )
    av = import_av("writing .mp4 clips")
    with av.open(_target(target), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # mbtree off: with it, libx264 gave other bytes for the same tiny clip now and then
        # (decoded pixels up to 20 levels apart); without it, and on one thread, the same bytes.
        stream.options = {"crf": str(crf), "threads": "1", "x264-params": "mbtree=0"}
        for index, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            picture.pts = index
            container.mux(stream.encode(picture))
        container.mux(stream.encode())  # flush the encoder's delayed frames


def _animation(frames: np.ndarray, target: Target, fps: float, **options: object) -> None:
    images = [Image.fromarray(frame) for frame in frames]
    duration = round(1000 / fps)  # milliseconds per frame
    images[0].save(
        _target(target), save_all=True, append_images=images[1:], loop=0, duration=duration,
        **options,
    )  # fmt: skip


def write_webp(frames: np.ndarray, target: Target, fps: float) -> None:
    """``frames`` as a lossless animated WebP at ``fps``, looping."""
    _animation(frames, target, fps, format="WEBP", lossless=True)


def write_gif(frames: np.ndarray, target: Target, fps: float) -> None:
    """``frames`` as an animated GIF at ``fps`` (256 colours), looping."""
    _animation(frames, target, fps, format="GIF")


CLIP_FORMATS: dict[str, Callable[[np.ndarray, Target, float], None]] = {
    "mp4": write_mp4,
    "webp": write_webp,
    "gif": write_gif,
}
"""File format (its suffix) → its writer ``(frames [T, H, W, 3] uint8, path or file, fps)``."""


def check_clip_formats(formats: Sequence[str], setting: str) -> None:
    """Refuse, before anything is generated, an unknown format or an ``.mp4`` without PyAV;
    ``setting`` names where the formats were given."""
    for fmt in formats:
        if fmt not in CLIP_FORMATS:
            valid = ", ".join(CLIP_FORMATS)
            raise ValueError(f"{setting}: unknown clip format {fmt!r}; valid: {valid}")
    if "mp4" in formats:
        import_av(f"{setting}: an .mp4 clip")


def has_av() -> bool:
    """Whether PyAV is installed (``.mp4`` can be written)."""
    try:
        import_av()
    except ValueError:
        return False
    return True


def grid_frame_indices(num_frames: int, max_frames: int = MAX_GRID_FRAMES) -> list[int]:
    """Every frame of a clip up to ``max_frames`` of them, else ``max_frames`` evenly spaced
    from the first to the last (81 frames: every 5th)."""
    if num_frames <= max_frames:
        return list(range(num_frames))
    return [round(i * (num_frames - 1) / (max_frames - 1)) for i in range(max_frames)]


def tile_frames(
    frames: np.ndarray, num_columns: int, factor: int = 1, padding: int = GRID_PADDING
) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 frames in rows of ``num_columns``, each enlarged ``factor`` times
    (nearest: every pixel an exact square), ``padding`` white pixels apart and around →
    ``[rows·(H·f + p) + p, cols·(W·f + p) + p, 3]`` uint8."""
    if num_columns < 1 or factor < 1:
        raise ValueError(f"num_columns and factor must be >= 1, got {num_columns} and {factor}")
    num_frames, height, width = frames.shape[:3]
    height, width = height * factor, width * factor
    num_columns = min(num_columns, num_frames)
    num_rows = math.ceil(num_frames / num_columns)
    grid = np.full(
        (num_rows * (height + padding) + padding, num_columns * (width + padding) + padding, 3),
        GRID_BACKGROUND,
        dtype=np.uint8,
    )
    for index, frame in enumerate(frames):
        top = padding + (index // num_columns) * (height + padding)
        left = padding + (index % num_columns) * (width + padding)
        grid[top : top + height, left : left + width] = frame.repeat(factor, 0).repeat(factor, 1)
    return grid


def clip_grid(frames: np.ndarray, max_width: int = MAX_GRID_WIDTH) -> Image.Image:
    """A clip's frames (:func:`grid_frame_indices`) side by side, wrapped into rows to stay
    under ``max_width`` pixels where the frames allow it."""
    shown = frames[grid_frame_indices(len(frames))]
    num_columns = max(1, (max_width - GRID_PADDING) // (frames.shape[2] + GRID_PADDING))
    return Image.fromarray(tile_frames(shown, num_columns))
