"""A tiny synthetic dataset of coloured shapes, for smoke tests and first runs.

Each image is one filled shape in a saturated colour on a plain background, captioned e.g.
"a red circle on a white background". The dataset is a pure function of ``(seed, index)``:
image ``i`` is the same whatever ``num_images`` is, and identical bytes on every machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from impasto.data.seeding import derive_seed

RGB = tuple[int, int, int]

DEMO_COLORS: dict[str, RGB] = {
    "red": (230, 25, 25),
    "yellow": (250, 220, 0),
    "green": (20, 170, 40),
    "cyan": (0, 200, 220),
    "blue": (25, 60, 230),
    "purple": (150, 40, 210),
}
"""Foreground colours: saturated, far apart from each other and from every background.

Neighbouring hues are 45-81 degrees apart. (An orange at 31 degrees, between red and yellow,
was dropped: the CPU demo model mixed the three up, and so does a person at 64 pixels.)"""

DEMO_BACKGROUNDS: dict[str, RGB] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}
"""Background colours; no foreground colour is among them."""

DEMO_SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

MIN_SHAPE_FRACTION = 0.3
MAX_SHAPE_FRACTION = 0.7
MIN_DEMO_SIZE = 16
DEMO_GENERATOR = 1
"""The version of the images drawn, in the stamp of the demo data a run writes
(:mod:`impasto.data.demo_stamp`): raise it when the same settings would draw other images."""


@dataclass(frozen=True)
class DemoSpec:
    """Everything that defines one demo image.

    ``box`` is ``(left, top, side)`` of the shape's bounding square, in pixels, fully inside
    the image.
    """

    color: str
    shape: str
    background: str
    box: tuple[int, int, int]

    @property
    def caption(self) -> str:
        return demo_caption(self.color, self.shape, self.background)


def demo_caption(color: str, shape: str, background: str) -> str:
    """The caption of a demo image, e.g. "a red circle on a white background"."""
    article = "an" if color[0] in "aeiou" else "a"
    return f"{article} {color} {shape} on a {background} background"


def _combination(index: int, seed: int) -> tuple[str, str, str]:
    """Balanced ``(color, shape, background)`` of image ``index``.

    Images come in blocks of ``len(colors) * len(shapes)``: each block shows every
    (colour, shape) pair once, in a seeded order. Pair ``p`` gets background
    ``(offset[p] + block) % num_backgrounds`` with seeded, balanced offsets, so over
    ``num_backgrounds`` blocks every (colour, shape, background) triple appears exactly once.
    """
    colors, backgrounds = list(DEMO_COLORS), list(DEMO_BACKGROUNDS)
    num_pairs = len(colors) * len(DEMO_SHAPES)
    block, slot = divmod(index, num_pairs)
    pair = int(np.random.default_rng(derive_seed(seed, block)).permutation(num_pairs)[slot])
    offsets = np.resize(np.arange(len(backgrounds)), num_pairs)  # each background equally often
    offsets = np.random.default_rng(derive_seed(seed, -1)).permutation(offsets)
    color_index, shape_index = divmod(pair, len(DEMO_SHAPES))
    background = backgrounds[(int(offsets[pair]) + block) % len(backgrounds)]
    return colors[color_index], DEMO_SHAPES[shape_index], background


def demo_spec(index: int, seed: int = 0, size: int = 64, width: int | None = None) -> DemoSpec:
    """The :class:`DemoSpec` of image ``index`` of the demo dataset for ``seed``, on a canvas
    ``size`` high and ``width`` wide (default: a square).

    The shape's side is uniform in 30-70% of the shorter side and its position uniform such
    that it lies fully inside the image.
    """
    width = size if width is None else width
    color, shape, background = _combination(index, seed)
    rng = np.random.default_rng(derive_seed(seed, index))
    shorter = min(size, width)
    low = max(4, int(round(MIN_SHAPE_FRACTION * shorter)))
    high = max(low, int(round(MAX_SHAPE_FRACTION * shorter)))
    side = int(rng.integers(low, high + 1))
    left = int(rng.integers(0, width - side + 1))
    top = int(rng.integers(0, size - side + 1))
    return DemoSpec(color=color, shape=shape, background=background, box=(left, top, side))


def _draw_circle(draw: ImageDraw.ImageDraw, left: int, top: int, side: int, fill: RGB) -> None:
    draw.ellipse((left, top, left + side - 1, top + side - 1), fill=fill)


def _draw_square(draw: ImageDraw.ImageDraw, left: int, top: int, side: int, fill: RGB) -> None:
    draw.rectangle((left, top, left + side - 1, top + side - 1), fill=fill)


def _draw_triangle(draw: ImageDraw.ImageDraw, left: int, top: int, side: int, fill: RGB) -> None:
    # Apex at top centre, base along the bottom edge of the bounding square.
    right, bottom = left + side - 1, top + side - 1
    draw.polygon([(left + (side - 1) / 2, top), (right, bottom), (left, bottom)], fill=fill)


SHAPE_DRAWERS: dict[str, Callable[[ImageDraw.ImageDraw, int, int, int, RGB], None]] = {
    "circle": _draw_circle,
    "square": _draw_square,
    "triangle": _draw_triangle,
}
assert set(SHAPE_DRAWERS) == set(DEMO_SHAPES)
assert not set(DEMO_COLORS.values()) & set(DEMO_BACKGROUNDS.values())


def render_demo_image(spec: DemoSpec, size: int, width: int | None = None) -> Image.Image:
    """Draw ``spec`` as an RGB image ``size`` high and ``width`` wide (default: a square), no
    anti-aliasing: two colours only."""
    width = size if width is None else width
    image = Image.new("RGB", (width, size), DEMO_BACKGROUNDS[spec.background])
    left, top, side = spec.box
    SHAPE_DRAWERS[spec.shape](ImageDraw.Draw(image), left, top, side, DEMO_COLORS[spec.color])
    return image


def write_demo_dataset(
    out_dir: Path,
    num_images: int = 16,
    size: int = 64,
    seed: int = 0,
    sizes: Sequence[tuple[int, int]] | None = None,
) -> int:
    """Write ``img-00000.png`` + ``img-00000.txt`` ... into ``out_dir``.

    Args:
        out_dir: a folder that does not exist yet, or is empty; it is never overwritten.
        num_images: how many images to write; 21 cover every (colour, shape) pair, 63 every
            (colour, shape, background) triple.
        size: image side in pixels.
        seed: dataset seed; the same seed gives byte-identical files.
        sizes: (height, width) of the images in turn (image i: ``sizes[i % len(sizes)]``),
            for a dataset of several aspect ratios; default: ``size`` squares.

    Returns:
        The number of images written.
    """
    out_dir = Path(out_dir)
    if num_images <= 0:
        raise ValueError(f"demo: num_images must be positive, got {num_images}")
    sizes = list(sizes or [(size, size)])
    for height, width in sizes:
        if min(height, width) < MIN_DEMO_SIZE:
            raise ValueError(
                f"demo: sides must be at least {MIN_DEMO_SIZE} pixels, got {height}x{width}"
            )
    make_empty_dir(out_dir)
    for index in range(num_images):
        height, width = sizes[index % len(sizes)]
        spec = demo_spec(index, seed, height, width)
        stem = out_dir / f"img-{index:05d}"
        render_demo_image(spec, height, width).save(stem.with_suffix(".png"), format="PNG")
        stem.with_suffix(".txt").write_text(spec.caption + "\n", encoding="utf-8")
    return num_images


def make_empty_dir(out_dir: Path) -> None:
    """Create ``out_dir`` for a generated dataset; refuse a file or a non-empty folder, so a
    dataset is never overwritten or mixed with another."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"demo: {out_dir} is a file; pick a folder path for the demo dataset")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ValueError(
            f"demo: {out_dir} already exists and is not empty; pick another folder or delete it"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
