"""``impasto sample``: images from a trained checkpoint, written as PNGs with their parameters."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from impasto.checkpoint.trained import build_starting_backbone, load_trained
from impasto.config import Config
from impasto.models.backbone import Backbone
from impasto.models.parts import has_adapters, without_adapters
from impasto.objectives import training_alphas_cumprod
from impasto.sampling import generate, model_forward, to_pil
from impasto.sampling.anneal import Annealing, ModelForward, anneal_weights


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
    anneal: str | None = None  # annealed guidance with the base model (sampling/anneal.py)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "empty"


INDEX_DIGITS = 5  # A1111's numbering: 00000-..., 00001-...


def image_name(index: int, prompt: str, seed: int) -> str:
    """``INDEX-SLUG-HASH-seedSEED.png``: the running index keeps every run's images apart, the
    slug makes the name readable, and 8 hex digits of the prompt's sha256 tell apart prompts
    whose slugs are equal (they differ after 60 characters, or in punctuation or case)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]
    return f"{index:0{INDEX_DIGITS}d}-{_slug(prompt)}-{digest}-seed{seed}.png"


def next_index(out_dir: Path) -> int:
    """One past the highest running index of the images already in ``out_dir``."""
    indices = [int(p.name[:INDEX_DIGITS]) for p in out_dir.glob("[0-9]" * INDEX_DIGITS + "-*")]
    return max(indices, default=-1) + 1


def save_new(image: Image.Image, out_dir: Path, index: int, prompt: str, seed: int,
             info: PngInfo) -> tuple[Path, int]:  # fmt: skip
    """Write ``image`` under the first free index from ``index`` on (created exclusively, so a
    file is never overwritten, even by another ``impasto sample`` writing to the same folder);
    returns its path and the next index."""
    while True:
        path = out_dir / image_name(index, prompt, seed)
        try:
            with open(path, "xb") as handle:
                image.save(handle, format="PNG", pnginfo=info)
            return path, index + 1
        except FileExistsError:
            index += 1


def _parameters(prompt: str, request: SampleRequest, seed: int, size: int) -> str:
    anneal = "" if request.anneal is None else f", Anneal: {request.anneal}"
    return (
        f"{prompt}\nNegative prompt: {request.negative_prompt}\n"
        f"Steps: {request.num_steps}, Sampler: {request.sampler}, "
        f"CFG scale: {request.guidance_scale}, Seed: {seed}, Size: {size}x{size}{anneal}"
    )


def base_model_forward(config: Config, backbone: Backbone) -> ModelForward:
    """The forward of the model a checkpoint's denoiser was fine-tuned from, for annealing.

    An adapter run: the same backbone with the denoiser's adapters disabled. A full fine-tune:
    the run's starting model rebuilt from ``model.*`` (``build_starting_backbone``: the preset
    or diffusers weights, or the merged model of the impasto run it continued), frozen, in eval
    mode, on the backbone's device. Both models read the same text encoding, so a checkpoint
    that also trains a text encoder is a one-line error, as is one whose denoiser did not train.
    """
    names = {id(module): name for name, module in backbone.parts().items()}
    denoiser = backbone.denoiser()
    denoiser_name = names[id(denoiser)]
    trained = [name for name in names.values() if getattr(config.parts, name) != "frozen"]
    if trained != [denoiser_name]:
        raise ValueError(
            f"--anneal mixes two {denoiser_name}s under one text encoding, but this checkpoint "
            f"trains {', '.join(trained)}; anneal a run that trains parts.{denoiser_name} only"
        )
    if has_adapters(denoiser):
        return without_adapters(model_forward(backbone), denoiser)
    base = build_starting_backbone(config).denoiser()  # its other networks are this one's
    base = base.to(backbone.device).requires_grad_(False).eval()
    return model_forward(backbone.with_denoiser(base))


def sample_checkpoint(
    checkpoint: str | Path, request: SampleRequest, out_dir: str | Path
) -> list[Path]:
    """Generate ``request`` with the checkpoint's model; returns the written PNG paths.

    Each PNG carries its parameters in a ``parameters`` text chunk (as A1111 writes them), and
    is named :func:`image_name`: numbered on from the folder's images, never overwriting one.
    The same seed gives the same image, whatever the number of prompts or images.
    ``request.anneal`` mixes in the base model (:func:`base_model_forward`) with that schedule.
    """
    if request.anneal is not None:
        anneal_weights(request.anneal, request.num_steps)  # a bad spec fails before loading
    config, backbone = load_trained(checkpoint, ema=request.ema)
    anneal = None
    if request.anneal is not None:
        anneal = Annealing(request.anneal, base_model_forward(config, backbone))
    size = request.size or config.data.resolution  # generate() checks it against the VAE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, index = [], next_index(out_dir)
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
            anneal=anneal,
            **model_sampling_options(config, request.spacing),
        )
        for offset, image in enumerate(to_pil(images)):
            seed = request.seed + offset
            info = PngInfo()
            info.add_text("parameters", _parameters(prompt, request, seed, size))
            path, index = save_new(image, out_dir, index, prompt, seed, info)
            written.append(path)
    return written
