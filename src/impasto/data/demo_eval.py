"""Measure whether a generated demo image shows what its prompt asked for.

A deliberately simple, model-free classifier, independent of the generator:

- background: the median colour of the border pixels;
- foreground: pixels farther than a threshold from the background colour;
- colour: the hue of the foreground's median colour, nearest among the demo colours' hues;
- shape: how much of its (robust) bounding box the foreground fills: a square fills all of it,
  a circle π/4 ≈ 0.785, an upright triangle one half.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np

from impasto.data.demo import DEMO_COLORS

FOREGROUND_DISTANCE = 60.0  # RGB distance (0..255 scale) from the background colour
MIN_FOREGROUND_PIXELS = 12
# Fill-ratio boundaries between triangle (0.5 exactly; the trimmed box reads 0.56-0.73),
# circle (π/4; 0.77-0.90) and square (1.0; 0.90-1.0): ranges measured on 630 demo images after
# a round trip through the shipped demo VAE, the best any generator using it can draw (its
# decoder softens corners). Each boundary lies between one class's 99th and the next one's
# 1st percentile (0.717 | 0.790 and 0.873 | 0.902).
TRIANGLE_CIRCLE_BOUNDARY = 0.75
CIRCLE_SQUARE_BOUNDARY = 0.89


@dataclass(frozen=True)
class DemoReading:
    color: str | None  # None when no foreground was found
    shape: str | None
    fill_ratio: float


def _hue_degrees(rgb: np.ndarray) -> float:
    hue, _, _ = colorsys.rgb_to_hsv(*(float(c) / 255.0 for c in rgb))
    return hue * 360.0


def _nearest_color(rgb: np.ndarray) -> str:
    hue = _hue_degrees(rgb)
    distances = {
        name: min(
            abs(hue - _hue_degrees(np.array(ref))), 360 - abs(hue - _hue_degrees(np.array(ref)))
        )
        for name, ref in DEMO_COLORS.items()
    }
    return min(distances, key=distances.__getitem__)


def _shape_from_fill(fill_ratio: float) -> str:
    if fill_ratio >= CIRCLE_SQUARE_BOUNDARY:
        return "square"
    if fill_ratio >= TRIANGLE_CIRCLE_BOUNDARY:
        return "circle"
    return "triangle"


def foreground_mask(image: np.ndarray) -> np.ndarray:
    """``[H, W]`` bool: the pixels of an ``[H, W, 3]`` 0..255 RGB image farther than
    ``FOREGROUND_DISTANCE`` from the background, the median colour of its border."""
    pixels = np.asarray(image, dtype=np.float64)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = np.median(border, axis=0)
    return np.linalg.norm(pixels - background, axis=-1) > FOREGROUND_DISTANCE


def read_demo_image(image: np.ndarray) -> DemoReading:
    """Classify an ``[H, W, 3]`` uint8 (or 0..255 float) RGB image of the demo kind."""
    pixels = np.asarray(image, dtype=np.float64)
    mask = foreground_mask(pixels)
    if mask.sum() < MIN_FOREGROUND_PIXELS:
        return DemoReading(None, None, 0.0)
    color = _nearest_color(np.median(pixels[mask], axis=0))
    rows, cols = np.nonzero(mask)
    # A robust bounding box: stray pixels of a generated image must not inflate it.
    top, bottom = np.percentile(rows, [1, 99])
    left, right = np.percentile(cols, [1, 99])
    box_area = (bottom - top + 1) * (right - left + 1)
    inside = mask[int(top) : int(bottom) + 1, int(left) : int(right) + 1].sum()
    fill_ratio = float(inside / box_area)
    return DemoReading(color, _shape_from_fill(fill_ratio), fill_ratio)


def parse_demo_caption(caption: str) -> tuple[str, str]:
    """``"a red circle on a white background"`` → ``("red", "circle")``."""
    words = caption.split()
    return words[1], words[2]
