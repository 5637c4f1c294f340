"""Labelled image grids: validation samples tiled with a caption under each and a header line.

A validation grid is read by a person, on disk and in TensorBoard: which prompt and seed made
each image, at which step. So every cell carries its prompt (wrapped on two lines, cut with
"...") and seed, the grid a header, all in a font that scales with the cells. Images narrower
than :data:`MIN_CELL_WIDTH` (the demo model samples 64×64) are enlarged by a whole factor,
nearest-neighbour, so that every pixel stays an exact square of the original. Images of
different sizes (per-prompt sizes of a prompt file) sit at the top left of equal cells, the
largest image's size, on the background. Torch, numpy and PIL only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

MIN_CELL_WIDTH = 256  # pixels; narrower images are enlarged by a whole factor to reach it
PADDING = 4  # pixels between cells and around the grid
BACKGROUND = (255, 255, 255)
TEXT_COLOUR = (0, 0, 0)
PROMPT_LINES = 2  # lines of a cell's label given to the prompt; one more for the seed
ELLIPSIS = "..."


@dataclass(frozen=True)
class CellLabel:
    """What is written under one image."""

    prompt: str
    seed: int


@dataclass(frozen=True)
class Grid:
    """A labelled grid and, per image, the box ``(left, top, right, bottom)`` it was drawn in."""

    image: Image.Image
    boxes: list[tuple[int, int, int, int]]


def to_pixels(image: Tensor) -> np.ndarray:
    """``[3, H, W]`` in [0, 1] → ``[H, W, 3]`` uint8 (round to nearest, as ``to_pil``)."""
    pixels = (image.detach().float().cpu() * 255).round().clamp(0, 255).byte()
    return pixels.permute(1, 2, 0).numpy()


def upscale_factor(width: int, min_width: int = MIN_CELL_WIDTH) -> int:
    """The smallest whole factor that makes ``width`` at least ``min_width`` (1 if it is)."""
    return max(1, math.ceil(min_width / width))


def upscale_nearest(pixels: np.ndarray, factor: int) -> np.ndarray:
    """``[H, W, C]`` → ``[H·f, W·f, C]``, every pixel repeated f×f times (exact)."""
    return pixels.repeat(factor, axis=0).repeat(factor, axis=1)


def load_font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's default font at ``size`` px (Pillow >= 10.1 with FreeType); older Pillow gets
    its fixed bitmap font, small but legible."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: no size argument
        return ImageFont.load_default()


def _width(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont) -> float:
    return font.getlength(text)


def fit_line(text: str, font, width: int) -> str:
    """``text``, or its longest start that fits ``width`` pixels followed by "..."."""
    if _width(text, font) <= width:
        return text
    while text and _width(text + ELLIPSIS, font) > width:
        text = text[:-1]
    return text.rstrip() + ELLIPSIS


def wrap_lines(text: str, font, width: int, max_lines: int) -> list[str]:
    """``text`` wrapped at spaces into at most ``max_lines`` lines of ``width`` pixels; what
    does not fit is cut, ending in "..."."""
    lines: list[str] = []
    words = text.split()
    while words and len(lines) < max_lines:
        line = words.pop(0)
        while words and _width(f"{line} {words[0]}", font) <= width:
            line = f"{line} {words.pop(0)}"
        lines.append(line)
    if words:  # more text than lines: the last line says so
        lines[-1] = fit_line(f"{lines[-1]} {' '.join(words)}", font, width)
    return [fit_line(line, font, width) for line in lines] or [""]


def font_size(cell_width: int) -> int:
    """Label text height in pixels: 16 at the minimum cell width, growing with the cells."""
    return max(16, cell_width // 24)


def labelled_grid(
    images: list[Tensor],
    labels: list[CellLabel],
    header: str,
    num_columns: int,
    text_width: int | None = None,
) -> Grid:
    """Tile ``images`` (each ``[3, h, w]`` in [0, 1], sizes may differ), ``num_columns`` per
    row, each enlarged to :data:`MIN_CELL_WIDTH` and captioned with its label, under a line
    of ``header`` text. The text is sized for cells ``text_width`` pixels wide (default: the
    cells' width; a row of a clip's frames passes one frame's)."""
    if len(images) != len(labels) or not images:
        raise ValueError(f"need one label per image, got {len(images)} and {len(labels)}")
    if num_columns < 1:
        raise ValueError(f"num_columns must be >= 1, got {num_columns}")
    cells = [to_pixels(image) for image in images]
    cells = [upscale_nearest(cell, upscale_factor(cell.shape[1])) for cell in cells]
    cell_width = max(cell.shape[1] for cell in cells)
    cell_height = max(cell.shape[0] for cell in cells)
    size = font_size(cell_width if text_width is None else text_width)
    font, header_font = load_font(size), load_font(size * 3 // 2)
    line_height = sum(font.getmetrics()) + 2
    label_height = (PROMPT_LINES + 1) * line_height + PADDING
    header_height = sum(header_font.getmetrics()) + 2 * PADDING
    num_columns = min(num_columns, len(cells))
    num_rows = math.ceil(len(cells) / num_columns)
    slot_width, slot_height = cell_width + PADDING, cell_height + label_height + PADDING
    canvas = Image.new(
        "RGB",
        (num_columns * slot_width + PADDING, header_height + num_rows * slot_height + PADDING),
        BACKGROUND,
    )
    draw = ImageDraw.Draw(canvas)
    draw.text(
        (PADDING, PADDING), fit_line(header, header_font, canvas.width), TEXT_COLOUR, header_font
    )
    boxes = []
    for index, (cell, label) in enumerate(zip(cells, labels, strict=True)):
        left = PADDING + (index % num_columns) * slot_width
        top = header_height + PADDING + (index // num_columns) * slot_height
        canvas.paste(Image.fromarray(cell), (left, top))
        boxes.append((left, top, left + cell.shape[1], top + cell.shape[0]))
        lines = [*wrap_lines(label.prompt, font, cell_width, PROMPT_LINES), f"seed {label.seed}"]
        for number, line in enumerate(lines):
            where = (left, top + cell_height + PADDING // 2 + number * line_height)
            draw.text(where, line, TEXT_COLOUR, font)
    return Grid(canvas, boxes)
