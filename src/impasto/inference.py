"""``impasto sample``: images from a trained checkpoint, written as PNGs with their parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from PIL.PngImagePlugin import PngInfo

from impasto.checkpoint.trained import load_trained
from impasto.config import Config
from impasto.objectives import training_alphas_cumprod
from impasto.sampling import generate, to_pil


def model_sampling_options(config: Config, spacing: str | None = None) -> dict:
    """The ``generate`` options fixed by how the model was trained: its prediction type, its
    schedule (for flow its shift), and the timestep spacing (default: ``sample.spacing``;
    unset, trailing for a zero-terminal-SNR schedule, so sampling starts at the terminal σ
    (Lin et al. 2023, §3.3), else SDXL's leading).
    """
    objective = config.objective
    spacing = spacing or config.sample.spacing
    if spacing is None:
        spacing = "trailing" if objective.zero_terminal_snr else "leading"
    return {
        "prediction_type": objective.prediction_type,
        "alphas_cumprod": training_alphas_cumprod(objective),
        "spacing": spacing,
        "flow_shift": objective.flow_shift,
        "flow_shift_resolution": objective.flow_shift_resolution,
    }


@dataclass(frozen=True)
class SampleRequest:
    prompts: tuple[str, ...]
    negative_prompt: str = ""
    num_images: int = 1  # per prompt; image i of a prompt uses seed + i
    seed: int = 0
    num_steps: int = 30
    guidance_scale: float = 5.0
    sampler: str = "euler"
    size: int | None = None  # default: the checkpoint's data.resolution
    spacing: str | None = None  # default: see model_sampling_options
    ema: bool = False  # sample with the checkpoint's EMA weights


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "empty"


def _parameters(prompt: str, request: SampleRequest, seed: int, size: int) -> str:
    return (
        f"{prompt}\nNegative prompt: {request.negative_prompt}\n"
        f"Steps: {request.num_steps}, Sampler: {request.sampler}, "
        f"CFG scale: {request.guidance_scale}, Seed: {seed}, Size: {size}x{size}"
    )


def sample_checkpoint(
    checkpoint: str | Path, request: SampleRequest, out_dir: str | Path
) -> list[Path]:
    """Generate ``request`` with the checkpoint's model; returns the written PNG paths.

    Each PNG carries its parameters in a ``parameters`` text chunk (as A1111 writes them).
    The same seed gives the same image, whatever the number of prompts or images.
    """
    config, backbone = load_trained(checkpoint, ema=request.ema)
    size = request.size or config.data.resolution  # generate() checks it against the VAE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for prompt in request.prompts:
        images = generate(
            backbone,
            [prompt] * request.num_images,
            negative_prompt=request.negative_prompt,
            num_steps=request.num_steps,
            guidance_scale=request.guidance_scale,
            sampler=request.sampler,
            seed=request.seed,
            height=size,
            width=size,
            **model_sampling_options(config, request.spacing),
        )
        for offset, image in enumerate(to_pil(images)):
            seed = request.seed + offset
            info = PngInfo()
            info.add_text("parameters", _parameters(prompt, request, seed, size))
            path = out_dir / f"{_slug(prompt)}-seed{seed}.png"
            image.save(path, pnginfo=info)
            written.append(path)
    return written
