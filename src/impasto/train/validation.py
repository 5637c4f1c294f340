"""Validation samples during training: a labelled grid of the run's prompts, to disk and
TensorBoard; with ``sample.frames``, clips: a row of each clip's frames, and an animated preview
of each (:func:`write_clip_previews`).

The prompts are ``sample.prompts``, then the lines of ``sample.prompts_file``, each with the
options its line sets (kohya's ``--n --w --h --s --d --l``; :mod:`impasto.sampling.prompt_file`).
The caller may read them once (:func:`validation_prompts`) and pass them to every round: the
ranks of a parallel run render in lockstep, so they must not read a file edited in between.
Image j of the grid (prompt-major, ``images_per_prompt`` per prompt) uses seed
``sample.seed + j`` unless its line sets ``--d``; consecutive prompts that share their options
are generated in one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from impasto.config import Config
from impasto.config.schema import SampleConfig
from impasto.faults import writing
from impasto.inference import model_sampling_options, prompt_slug
from impasto.models.backbone import Backbone
from impasto.sample_clips import clip_fps, clip_frames_option
from impasto.sampling import generate
from impasto.sampling.grid import CellLabel, labelled_grid, upscale_factor
from impasto.sampling.prompt_file import (
    PromptOptions,
    SamplePrompt,
    grid_seeded,
    listed_prompts,
)
from impasto.video_files import (
    CLIP_FORMATS,
    clip_frames,
    grid_frame_indices,
    has_av,
    tile_frames,
)

MIN_FRAME_WIDTH = 128  # pixels; a validation clip's narrower frames are enlarged to reach it


def validation_prompts(sample: SampleConfig) -> list[SamplePrompt]:
    """``sample.prompts``, then the prompts of ``sample.prompts_file``."""
    return listed_prompts(sample.prompts, sample.prompts_file)


@dataclass(frozen=True)
class PromptBatch:
    """Consecutive prompts sampled together: the same options, seeds following on."""

    prompts: tuple[str, ...]
    options: PromptOptions  # every option set; ``seed`` is the first image's


def prompt_batches(
    prompts: list[SamplePrompt], defaults: PromptOptions, images_per_prompt: int
) -> list[PromptBatch]:
    """Group ``prompts`` into batches; prompt p's first image has seed ``defaults.seed +
    p·images_per_prompt`` unless its line sets one (``generate`` gives row i seed + i)."""
    batches: list[PromptBatch] = []
    for prompt in grid_seeded(prompts, defaults.seed, images_per_prompt):
        options = prompt.options.over(defaults)
        if batches:
            last = batches[-1]
            follows = last.options.seed + len(last.prompts) * images_per_prompt == options.seed
            if follows and replace(last.options, seed=options.seed) == options:
                batches[-1] = replace(last, prompts=(*last.prompts, prompt.text))
                continue
        batches.append(PromptBatch((prompt.text,), options))
    return batches


def sample_defaults(config: Config) -> PromptOptions:
    """The options of a prompt that sets none: the run's ``sample`` section."""
    sample = config.sample
    size = sample.resolution or config.data.resolution
    return PromptOptions(
        sample.negative_prompt, size, size, sample.num_steps, sample.seed, sample.guidance_scale
    )


def sample_batches(config: Config, backbone: Backbone, batches: list[PromptBatch]) -> list[Tensor]:
    """Each batch's images ``[n·images_per_prompt, 3, H, W]`` float32 in [0, 1]; with
    ``sample.frames``, clips ``[n·images_per_prompt, 3, T, H, W]``."""
    sample = config.sample
    frames = {}
    if sample.frames is not None:
        generated = clip_frames_option(backbone, sample.frames, "sample.frames")
        frames = {} if generated is None else {"frames": generated}
    images = []
    for batch in batches:
        options = batch.options
        images.append(
            generate(
                backbone,
                list(batch.prompts),
                num_images_per_prompt=sample.images_per_prompt,
                negative_prompt=options.negative_prompt,
                num_steps=options.num_steps,
                guidance_scale=options.guidance_scale,
                guidance_rescale=sample.guidance_rescale,
                sampler=sample.sampler,
                seed=options.seed,
                height=options.height,
                width=options.width,
                **frames,
                **model_sampling_options(config),
            )
        )
    if sample.frames is not None and not frames:  # an image model's one-frame clips
        images = [batch[:, :, None] for batch in images]
    return images


MAX_GRID_COLUMNS = 8  # cells per row of a validation grid: 8 cells of 256 px fit a screen


def grid_columns(num_prompts: int, images_per_prompt: int) -> int:
    """Columns of a validation grid: a prompt's images (its seeds) side by side in one row,
    and as many prompts per row as make the grid about square (9 prompts: 3x3; with 2 images
    each, 3 prompts per row: 6x3), at most :data:`MAX_GRID_COLUMNS` cells unless one prompt's
    images need more (issue #30: a tall column of 9 rows was unreadable)."""
    per_row = math.ceil(math.sqrt(num_prompts / images_per_prompt))
    per_row = max(1, min(per_row, MAX_GRID_COLUMNS // images_per_prompt, num_prompts))
    return per_row * images_per_prompt


@dataclass(frozen=True)
class ValidationGrid:
    """One validation round: where the grid goes, the labelled grid ``[3, H, W]`` in [0, 1],
    the images as generated (``[N, 3, h, w]``; a list of ``[3, h_i, w_i]`` when a prompt file
    gives prompts different sizes; clips ``[N, 3, T, h, w]``), the prompt of each image
    (``images_per_prompt`` consecutive images per prompt), the grid as drawn (what the PNG file
    holds) and, for clips, their frame rate."""

    path: Path
    grid: Tensor
    images: Tensor | list[Tensor]
    prompts: list[str]
    drawn: Image.Image
    clip_fps: float | None = None  # None: images

    def save(self) -> None:
        """Write the PNG file, and each clip's previews (rank 0 of a parallel run)."""
        with writing(self.path, "samples.write"):  # a full disk fails PIL's close(), unnamed
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.drawn.save(self.path)
        if self.clip_fps is not None:
            write_clip_previews(self.path.with_suffix(""), self.images, self.prompts, self.clip_fps)


def write_clip_previews(
    folder: Path, clips: Tensor | list[Tensor], prompts: list[str], fps: float
) -> list[Path]:
    """Each clip ``[3, T, H, W]`` as ``folder/INDEX-SLUG.webp`` (lossless, looping) and, when
    PyAV is installed, ``.mp4``, INDEX its place in the grid; returns the paths."""
    formats = ["webp", *(["mp4"] if has_av() else [])]
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for index, (clip, prompt) in enumerate(zip(clips, prompts, strict=True)):
        frames = clip_frames(clip)
        for fmt in formats:
            path = folder / f"{index:03d}-{prompt_slug(prompt)}.{fmt}"
            with writing(path, "samples.write"):
                CLIP_FORMATS[fmt](frames, path, fps)
            written.append(path)
    return written


def clip_row(clip: Tensor) -> Tensor:
    """A clip ``[3, T, H, W]`` in [0, 1] as one image ``[3, h, w]`` of its frames side by side
    (:func:`~impasto.video_files.grid_frame_indices`), enlarged to :data:`MIN_FRAME_WIDTH`."""
    frames = clip_frames(clip)[grid_frame_indices(clip.shape[1])]
    factor = upscale_factor(frames.shape[2], MIN_FRAME_WIDTH)
    row = tile_frames(frames, len(frames), factor)
    return torch.from_numpy(row).permute(2, 0, 1).float() / 255.0


def labelled_clip_grid(clips: list[Tensor], labels: list[CellLabel], header: str) -> Image.Image:
    """The validation grid of clips ``[3, T, H, W]``: one row per clip (:func:`clip_row`), its
    label under it in text sized for one frame."""
    widths = [clip.shape[-1] * upscale_factor(clip.shape[-1], MIN_FRAME_WIDTH) for clip in clips]
    rows = [clip_row(clip) for clip in clips]
    return labelled_grid(rows, labels, header, 1, text_width=max(widths)).image


def write_validation_grid(
    config: Config,
    backbone: Backbone,
    run_dir: Path,
    step: int,
    save: bool = True,
    prompts: list[SamplePrompt] | None = None,
) -> ValidationGrid:
    """Render the grid (:func:`render_validation_grid`) and, if ``save``, write it."""
    validation = render_validation_grid(config, backbone, run_dir, step, prompts)
    if save:
        validation.save()
    return validation


def render_validation_grid(
    config: Config,
    backbone: Backbone,
    run_dir: Path,
    step: int,
    prompts: list[SamplePrompt] | None = None,
) -> ValidationGrid:
    """Render the grid of ``RUN/samples/step-XXXXXXXX.png`` (every rank of a parallel run, in
    lockstep). ``prompts``: :func:`validation_prompts` read once by the caller; None reads
    them now."""
    per_prompt = config.sample.images_per_prompt
    if prompts is None:
        prompts = validation_prompts(config.sample)
    batches = prompt_batches(prompts, sample_defaults(config), per_prompt)
    images = [image for batch in sample_batches(config, backbone, batches) for image in batch]
    labels = [
        CellLabel(text, batch.options.seed + row)
        for batch in batches
        for row, text in enumerate(t for t in batch.prompts for _ in range(per_prompt))
    ]
    header = f"{run_dir.name}  step {step}"
    if config.sample.frames is None:
        columns = grid_columns(len(prompts), per_prompt)
        grid = labelled_grid(images, labels, header, columns).image
    else:
        grid = labelled_clip_grid(images, labels, header)
    chw = torch.from_numpy(np.asarray(grid).copy()).permute(2, 0, 1).float() / 255.0
    same_size = len({tuple(image.shape) for image in images}) == 1
    return ValidationGrid(
        run_dir / "samples" / f"step-{step:08d}.png",
        chw,
        torch.stack(images) if same_size else images,
        [label.prompt for label in labels],
        grid,
        None if config.sample.frames is None else clip_fps(config),
    )
