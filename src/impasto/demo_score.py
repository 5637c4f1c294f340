"""Score a demo checkpoint: do its samples show the colour and shape their prompts ask for?

Generates images for every (colour, shape) pair of the demo dataset with the checkpoint's own
validation settings (``sample.num_steps``, ``guidance_scale``, ``sampler``) and reads each one
with the model-free classifier of :mod:`impasto.data.demo_eval`. Used by the demo acceptance
test and ``benchmarks/demo_accuracy.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from impasto.checkpoint.trained import load_trained
from impasto.data.demo import DEMO_COLORS, DEMO_SHAPES, demo_caption
from impasto.data.demo_eval import read_demo_image
from impasto.inference import model_sampling_options
from impasto.sampling import generate, to_pil

BACKGROUNDS = ("white", "black", "gray")
FIRST_SEED = 1000  # away from the validation grid's seeds


@dataclass(frozen=True)
class DemoScore:
    num_images: int
    color_accuracy: float
    shape_accuracy: float
    color_confusions: dict[str, int] = field(default_factory=dict)  # "asked->read": count
    shape_confusions: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "num_images": self.num_images,
            "color_accuracy": round(self.color_accuracy, 4),
            "shape_accuracy": round(self.shape_accuracy, 4),
            "color_confusions": self.color_confusions,
            "shape_confusions": self.shape_confusions,
        }


def demo_prompts() -> list[tuple[str, str, str]]:
    """(colour, shape, background) for every colour-shape pair; each shape and each colour
    meets every background (background index = colour index + shape index, mod 3)."""
    return [
        (color, shape, BACKGROUNDS[(i + j) % len(BACKGROUNDS)])
        for i, color in enumerate(DEMO_COLORS)
        for j, shape in enumerate(DEMO_SHAPES)
    ]


def score_demo_checkpoint(
    checkpoint: str | Path, images_per_prompt: int = 2, device: str = "cpu"
) -> DemoScore:
    """Colour and shape accuracy of ``images_per_prompt`` samples per demo prompt."""
    config, backbone = load_trained(checkpoint)
    backbone.to(device)
    specs = demo_prompts()
    with torch.no_grad():
        images = generate(
            backbone,
            [demo_caption(*spec) for spec in specs],
            num_images_per_prompt=images_per_prompt,
            num_steps=config.sample.num_steps,
            guidance_scale=config.sample.guidance_scale,
            sampler=config.sample.sampler,
            seed=FIRST_SEED,
            height=config.data.resolution,
            width=config.data.resolution,
            **model_sampling_options(config),
        )
    colors, shapes = Counter(), Counter()
    for index, image in enumerate(to_pil(images)):
        color, shape, _ = specs[index // images_per_prompt]
        reading = read_demo_image(np.asarray(image))
        colors[(color, reading.color)] += 1
        shapes[(shape, reading.shape)] += 1
    total = len(specs) * images_per_prompt
    return DemoScore(
        num_images=total,
        color_accuracy=sum(n for (asked, read), n in colors.items() if asked == read) / total,
        shape_accuracy=sum(n for (asked, read), n in shapes.items() if asked == read) / total,
        color_confusions=_confusions(colors),
        shape_confusions=_confusions(shapes),
    )


def _confusions(counts: Counter) -> dict[str, int]:
    return {
        f"{asked}->{read}": n
        for (asked, read), n in sorted(counts.items(), key=str)
        if asked != read
    }
