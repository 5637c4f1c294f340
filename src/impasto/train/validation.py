"""Validation samples during training: a grid of the config's prompts, to disk and TensorBoard."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from impasto.config import Config
from impasto.inference import model_sampling_options
from impasto.models.backbone import Backbone
from impasto.sampling import generate, make_grid


def sample_grid(config: Config, backbone: Backbone) -> Tensor:
    """``images_per_prompt`` samples of every validation prompt, ``[N, 3, H, W]`` in [0, 1]."""
    sample = config.sample
    resolution = sample.resolution or config.data.resolution
    prompts = [prompt for prompt in sample.prompts for _ in range(sample.images_per_prompt)]
    return generate(
        backbone,
        prompts,
        negative_prompt=sample.negative_prompt,
        num_steps=sample.num_steps,
        guidance_scale=sample.guidance_scale,
        sampler=sample.sampler,
        seed=sample.seed,
        height=resolution,
        width=resolution,
        **model_sampling_options(config),
    )


def grid_columns(num_prompts: int, images_per_prompt: int) -> int:
    """One row per prompt when there are several images per prompt, else a near-square grid."""
    return images_per_prompt if images_per_prompt > 1 else math.ceil(math.sqrt(num_prompts))


@dataclass(frozen=True)
class ValidationGrid:
    """One validation round: where the grid went, the grid ``[3, H, W]`` in [0, 1] and the
    images ``[N, 3, h, w]`` with their prompts (``images_per_prompt`` consecutive rows each)."""

    path: Path
    grid: Tensor
    images: Tensor
    prompts: list[str]


def write_validation_grid(
    config: Config, backbone: Backbone, run_dir: Path, step: int, save: bool = True
) -> ValidationGrid:
    """Render the grid and save it as ``RUN/samples/step-XXXXXXXX.png``.
    ``save``: write the file (rank 0 of a parallel run; every rank renders, in lockstep)."""
    sample = config.sample
    images = sample_grid(config, backbone)
    grid = make_grid(images, nrow=grid_columns(len(sample.prompts), sample.images_per_prompt))
    path = run_dir / "samples" / f"step-{step:08d}.png"
    if save:
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
    chw = torch.from_numpy(np.asarray(grid).copy()).permute(2, 0, 1).float() / 255.0
    prompts = [prompt for prompt in sample.prompts for _ in range(sample.images_per_prompt)]
    return ValidationGrid(path, chw, images, prompts)
