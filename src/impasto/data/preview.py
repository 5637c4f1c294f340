"""``impasto data preview``: a contact sheet of what the model will see (issue #17).

The first ``num`` training examples, in training order (the run's seed), each as the crop the
autoencoder encodes (after buckets, resize, flip and crop) with, under it, the caption the text
encoders get for that step (after caption dropout, tag shuffle and dropout, prefix and suffix)
and the example's size. The examples come from the run's own data pipeline
(:func:`~impasto.data.pipeline.prepare_run_data` and its
:class:`~impasto.data.pipeline.DataStream`), so each crop is bit for bit the ``pixel_values`` row
a one-process run trains on. A run that caches latents on disk trains on the encodings of these
same crops; the preview decodes the images instead (``pixels_only``: no cache is read or
filled), and shows the captions that cache holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from impasto.data.pipeline import prepare_run_data

CELL_MIN_WIDTH = 256  # smaller crops are enlarged by a whole factor (nearest) to at least this
MAX_COLUMNS = 4
FONT_SIZE = 15
MAX_CAPTION_LINES = 6
PADDING = 8
BACKGROUND = (236, 236, 236)  # not white: a white image's edges stay visible
TEXT = (20, 20, 20)
DIM_TEXT = (110, 110, 110)


@dataclass(frozen=True)
class PreviewExample:
    """One training example as the step receives it.

    Attributes:
        pixels: float32 ``[3, H, W]`` in [-1, 1]: the batch row the autoencoder encodes.
        caption: the caption the text encoders get ("" when dropped or missing).
        size: ``(height, width)`` of the example (its bucket, or the square).
        name: the image it was cut from.
    """

    pixels: torch.Tensor
    caption: str
    size: tuple[int, int]
    name: str


def preview_examples(config: Any, num: int) -> list[PreviewExample]:
    """The first ``num`` examples of ``config``'s run, in training order (fewer when the run
    has fewer), from the pipeline the trainer uses; no file is written (a demo dataset the
    config asks for is generated, as a run would)."""
    if num < 1:
        raise ValueError(f"--num: need at least 1 example, got {num}")
    if config.data.prompts is not None:
        raise ValueError(
            "data.prompts: this config trains from prompts (no images); there is nothing to preview"
        )
    # Loader workers give identical batches (every draw is seeded per example): none needed.
    data_config = config.data.model_copy(update={"num_workers": 0})
    config = config.model_copy(update={"data": data_config})
    data = prepare_run_data(config, None, None, True, None, "", pixels_only=True)
    num_batches = data.total_steps * config.train.grad_accum_steps  # one process's whole run
    examples: list[PreviewExample] = []
    for _ in range(num_batches):
        batch = next(data.stream)
        for row in range(batch.size):
            index = int(batch.indices[row])
            examples.append(
                PreviewExample(
                    pixels=batch.pixel_values[row],
                    caption=batch.captions[row],
                    size=tuple(batch.target_sizes[row].tolist()),
                    name=short_name(data.records[index].image_path),
                )
            )
        if len(examples) >= num:
            break
    return examples[:num]


def short_name(image_path: str | Path) -> str:
    """The image's file name with its folder (``3_cat/img-00002.png``): subfolders often
    hold files of the same name."""
    parts = Path(str(image_path)).parts
    return "/".join(parts[-2:])


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """``[3, H, W]`` in [-1, 1] → ``[H, W, 3]`` uint8: the inverse of
    :func:`~impasto.data.transforms.pil_to_tensor` (a decoded image comes back exactly)."""
    unit = (pixels.detach().float().cpu() * 0.5 + 0.5).clamp(0, 1)
    return unit.mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def upscale_factor(width: int) -> int:
    """The whole factor that makes a crop ``width`` wide at least :data:`CELL_MIN_WIDTH`."""
    return max(1, math.ceil(CELL_MIN_WIDTH / width))


def wrap_text(text: str, font: Any, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` pixels, broken at spaces (and inside a word
    wider than a line)."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
            continue
        while len(word) > 1 and font.getlength(word) > width:
            cut = len(word) - 1
            while cut > 1 and font.getlength(word[:cut]) > width:
                cut -= 1
            lines.append(word[:cut])
            word = word[cut:]
        lines.append(word)
    return lines


@dataclass(frozen=True)
class Sheet:
    """A contact sheet and where each example's crop lies on it: ``(left, top, right,
    bottom)``, the crop enlarged :func:`upscale_factor` times."""

    image: Image.Image
    boxes: list[tuple[int, int, int, int]]


def example_label(number: int, example: PreviewExample) -> tuple[str, str]:
    """The header line (``#3  64x48  cat.png``, height x width) and the caption text."""
    height, width = example.size
    caption = example.caption if example.caption else "(empty caption)"
    return f"#{number} · {height}x{width} · {example.name}", caption


def draw_sheet(examples: Sequence[PreviewExample], font_size: int = FONT_SIZE) -> Sheet:
    """The examples in a grid of up to :data:`MAX_COLUMNS` columns, each crop (enlarged to
    at least :data:`CELL_MIN_WIDTH` wide, nearest neighbour) above its label."""
    if not examples:
        raise ValueError("data preview: no example to draw")
    font = ImageFont.load_default(size=font_size)
    line_height = font_size + 4
    sizes = [(h * upscale_factor(w), w * upscale_factor(w)) for h, w in (e.size for e in examples)]
    cell_width = max(width for _, width in sizes)
    labels = []
    for number, example in enumerate(examples, start=1):
        header, caption = example_label(number, example)
        caption_lines = wrap_text(caption, font, cell_width)
        if len(caption_lines) > MAX_CAPTION_LINES:
            caption_lines = [*caption_lines[: MAX_CAPTION_LINES - 1], "…"]
        labels.append((wrap_text(header, font, cell_width)[:2], caption_lines))  # name may wrap
    columns = min(MAX_COLUMNS, len(examples))
    starts = range(0, len(examples), columns)
    rows = [range(start, min(start + columns, len(examples))) for start in starts]
    row_heights = [
        max(sizes[i][0] for i in row)
        + line_height * max(len(labels[i][0]) + len(labels[i][1]) for i in row)
        + 2 * PADDING
        for row in rows
    ]
    sheet = Image.new("RGB", (columns * (cell_width + 2 * PADDING), sum(row_heights)), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    boxes: list[tuple[int, int, int, int]] = []
    top = 0
    for row, row_height in zip(rows, row_heights, strict=True):
        image_height = max(sizes[i][0] for i in row)
        for column, i in enumerate(row):
            left = column * (cell_width + 2 * PADDING) + PADDING
            height, width = sizes[i]
            crop = Image.fromarray(to_uint8(examples[i].pixels))
            crop = crop.resize((width, height), Image.Resampling.NEAREST)
            box = (left, top + PADDING, left + width, top + PADDING + height)
            sheet.paste(crop, box[:2])
            boxes.append(box)
            y = top + PADDING + image_height + 2
            header, caption_lines = labels[i]
            for line in header:
                draw.text((left, y), line, font=font, fill=DIM_TEXT)
                y += line_height
            for line in caption_lines:
                draw.text(
                    (left, y), line, font=font, fill=TEXT if examples[i].caption else DIM_TEXT
                )
                y += line_height
        top += row_height
    return Sheet(sheet, boxes)


def preview_sheet(config: Any, out: str | Path, num: int = 16) -> Path:
    """Write the contact sheet of ``config``'s first ``num`` training examples to ``out``
    (PNG); returns the path."""
    examples = preview_examples(config, num)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    draw_sheet(examples).image.save(path)
    return path
