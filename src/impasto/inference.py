"""``impasto sample``: images from a trained checkpoint or an exported model, written as PNGs;
a video model's clips (``--frames``, ``sample.frames``) as ``.mp4`` and ``.webp`` files with a
PNG of their frames (:func:`save_clip`).

The model (:func:`open_model`) is an impasto run or checkpoint, or an exported SDXL model: a
single-file ``.safetensors`` (impasto's or another tool's) or a diffusers folder. What the
request leaves unset comes from the model: a run's ``sample`` section (steps, guidance, sampler,
negative prompt, seed, size, spacing), for an exported model diffusers' defaults and what the
file says about how it samples (:mod:`impasto.sample_source`). Each prompt may override its own
options (a prompt file, :mod:`impasto.sampling.prompt_file`). docs/sampling.md.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image
from PIL.PngImagePlugin import PngInfo
from torch import Tensor

from impasto.checkpoint.trained import (
    build_starting_backbone,
    is_run_checkpoint,
    read_checkpoint_config,
    resolve_checkpoint,
)
from impasto.config import Config
from impasto.models.backbone import Backbone
from impasto.models.parts import has_adapters, without_adapters
from impasto.objectives import training_alphas_cumprod
from impasto.sample_clips import DEFAULT_CLIP_FORMATS, ClipOutput, clip_fps, clip_frames_option
from impasto.sample_source import SamplingModel, open_model
from impasto.sampling import OwnSampling, generate, model_forward, to_pil
from impasto.sampling.anneal import Annealing, ModelForward, anneal_weights
from impasto.sampling.process import default_sampler
from impasto.sampling.prompt_file import (
    PromptOptions,
    SamplePrompt,
    grid_seeded,
    listed_prompts,
    read_prompt_file,
)
from impasto.video_files import CLIP_FORMATS, check_clip_formats, clip_frames, clip_grid


def model_sampling_options(config: Config | SamplingModel, spacing: str | None = None) -> dict:
    """The ``generate`` options fixed by how the model was trained: its prediction type, its
    schedule (for flow its shift), and the timestep spacing (default: ``sample.spacing``;
    unset, trailing for a zero-terminal-SNR schedule, so sampling starts at the terminal σ
    (Lin et al. 2023, §3.3), else SDXL's leading). ``config``: a run's config, or any object
    with its ``objective`` and ``sample`` sections (a :class:`SamplingModel`).
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
    """What ``impasto sample`` was asked; None takes the model's default (a run's ``sample``
    section; for an exported model the section's defaults and the model's size)."""

    prompts: tuple[str, ...] = ()
    prompts_file: str | None = None  # more prompts, after ``prompts``, with their own options
    num_images: int | None = None  # per prompt (image i uses seed + i); None: 1, or for a run's
    # own validation prompts its sample.images_per_prompt
    batch_size: int = 1  # images generated (and held in memory) at once
    captions: bool = False  # write each image's prompt beside it as NAME.txt
    negative_prompt: str | None = None
    seed: int | None = None
    num_steps: int | None = None
    guidance_scale: float | None = None
    guidance_rescale: float | None = None
    sampler: str | None = None
    size: int | None = None  # square side in pixels
    spacing: str | None = None  # default: see model_sampling_options
    ema: bool = False  # sample with the checkpoint's EMA weights
    anneal: str | None = None  # annealed guidance with the base model (sampling/anneal.py)
    frames: int | None = None  # clips of this many frames; None: the model's sample.frames
    formats: tuple[str, ...] = ()  # the clips' files (CLIP_FORMATS); (): DEFAULT_CLIP_FORMATS

    def all_prompts(self) -> list[SamplePrompt]:
        """The command line's prompts, then the prompt file's (read now: errors come early);
        none: the run's validation prompts (:func:`validation_request`)."""
        prompts = [SamplePrompt(text) for text in self.prompts]
        if self.prompts_file is not None:
            prompts += read_prompt_file(self.prompts_file, setting="--prompts-file")
        return prompts

    def prompt_defaults(self, model: SamplingModel) -> PromptOptions:
        """Every per-prompt option: the request's where given, else the model's."""
        sample = model.sample
        defaults = PromptOptions(
            negative_prompt=sample.negative_prompt,
            width=model.width,
            height=model.height,
            num_steps=sample.num_steps,
            seed=sample.seed,
            guidance_scale=sample.guidance_scale,
        )
        given = PromptOptions(
            negative_prompt=self.negative_prompt,
            width=self.size,
            height=self.size,
            num_steps=self.num_steps,
            seed=self.seed,
            guidance_scale=self.guidance_scale,
        )
        return given.over(defaults)

    def shared_options(self, model: SamplingModel) -> SharedOptions:
        """The options of every prompt: the request's where given, else the model's."""
        rescale = self.guidance_rescale
        return SharedOptions(
            sampler=self.sampler or model.sample.sampler or default_sampler(model.backbone),
            guidance_rescale=model.sample.guidance_rescale if rescale is None else rescale,
            spacing=self.spacing,
            num_images=1 if self.num_images is None else self.num_images,
            batch_size=self.batch_size,
            anneal=self.anneal,
            clips=self.clip_output(model),
            embedded_guidance=isinstance(model.backbone, OwnSampling)
            and not getattr(model.backbone, "classifier_free_guidance", False),
        )

    def clip_output(self, model: SamplingModel) -> ClipOutput | None:
        """How clips are made and written (``--frames``, else the model's ``sample.frames``);
        None: images. One-line errors for a frame count the model cannot encode, an image
        model asked for more than one frame, or a bad ``--format``."""
        frames, setting = self.frames, "--frames"
        if frames is None:
            frames, setting = model.sample.frames, "sample.frames"
        if frames is None:
            if self.formats:
                raise ValueError("--format sets how clips are written; add --frames N")
            return None
        generated = clip_frames_option(model.backbone, frames, setting)
        formats = self.formats or DEFAULT_CLIP_FORMATS
        check_clip_formats(formats, "--format" if self.formats else "--format (default: mp4, webp)")
        return ClipOutput(frames, generated, formats, clip_fps(model.config))


def validation_request(
    request: SampleRequest, config: Config | None, source: str | Path
) -> tuple[list[SamplePrompt], SampleRequest]:
    """A request without prompts draws the run's validation grid: its ``sample.prompts`` and
    ``sample.prompts_file``, ``sample.images_per_prompt`` images each (``--num`` overrides),
    with the grid's seeds (prompt p's image i: seed + p·n + i, n the run's images per prompt,
    unless its line sets ``--d``), so the images equal the grid's at the same step (issue
    #30)."""
    sample = None if config is None else config.sample
    prompts = [] if sample is None else listed_prompts(sample.prompts, sample.prompts_file)
    if not prompts:
        raise ValueError(
            f"no prompt to sample: {source} names no validation prompts (sample.prompts); give "
            "--prompt TEXT or --prompts-file FILE"
        )
    per_prompt = sample.images_per_prompt if request.num_images is None else request.num_images
    seed = sample.seed if request.seed is None else request.seed
    seeded = grid_seeded(prompts, seed, sample.images_per_prompt)  # whatever --num asks
    return seeded, replace(request, num_images=per_prompt)


def prompt_slug(text: str) -> str:
    """``text`` for a file name: lower-case letters and digits, the rest runs of "-", at most
    60 characters ("empty" for none)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "empty"


INDEX_DIGITS = 5  # A1111's numbering: 00000-..., 00001-...


def image_name(index: int, prompt: str, seed: int) -> str:
    """``INDEX-SLUG-HASH-seedSEED.png``: the running index keeps every run's images apart, the
    slug makes the name readable, and 8 hex digits of the prompt's sha256 tell apart prompts
    whose slugs are equal (they differ after 60 characters, or in punctuation or case)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]
    return f"{index:0{INDEX_DIGITS}d}-{prompt_slug(prompt)}-{digest}-seed{seed}.png"


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


@dataclass(frozen=True)
class SharedOptions:
    """The options of a request that apply to every prompt."""

    sampler: str
    guidance_rescale: float
    spacing: str | None  # None: model_sampling_options' default
    num_images: int  # per prompt
    batch_size: int
    anneal: str | None
    clips: ClipOutput | None = None  # None: images
    embedded_guidance: bool = False  # the guidance scale is the network's input, not CFG


def parameters_text(prompt: str, options: PromptOptions, shared: SharedOptions, seed: int) -> str:
    """The PNG's ``parameters`` text, in A1111's layout (a clip's: its frames and rate too)."""
    anneal = "" if shared.anneal is None else f", Anneal: {shared.anneal}"
    clips = shared.clips
    guidance = f"CFG scale: {options.guidance_scale}"
    if shared.embedded_guidance:  # as Forge writes a guidance-distilled model's
        guidance = f"CFG scale: 1, Distilled CFG Scale: {options.guidance_scale}"
    frames = "" if clips is None else f", Frames: {clips.num_frames}, FPS: {clips.fps:g}"
    return (
        f"{prompt}\nNegative prompt: {options.negative_prompt}\n"
        f"Steps: {options.num_steps}, Sampler: {shared.sampler}, "
        f"{guidance}, Guidance rescale: {shared.guidance_rescale}, "
        f"Seed: {seed}, Size: {options.width}x{options.height}{frames}{anneal}"
    )


def save_clip(
    clip: Tensor,
    out_dir: Path,
    index: int,
    prompt: str,
    seed: int,
    info: PngInfo,
    output: ClipOutput,
) -> tuple[list[Path], int]:
    """Write ``clip`` ``[3, T, H, W]`` in [0, 1] as ``NAME.png``, its frames side by side with
    the parameters (:func:`save_new`: it claims the name), and ``NAME.FORMAT`` for each of
    ``output.formats`` (created exclusively); returns the paths (the PNG last) and the next
    index."""
    frames = clip_frames(clip)
    grid, index = save_new(clip_grid(frames), out_dir, index, prompt, seed, info)
    paths = [grid.with_suffix(f".{fmt}") for fmt in output.formats]
    for fmt, path in zip(output.formats, paths, strict=True):
        with open(path, "xb") as handle:
            CLIP_FORMATS[fmt](frames, handle, output.fps)
    return [*paths, grid], index


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
    trained = [name for name in names.values() if config.parts.mode(name) != "frozen"]
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


def _annealing(request: SampleRequest, model: SamplingModel) -> Annealing | None:
    if request.anneal is None:
        return None
    if model.config is None:
        raise ValueError(
            f"--anneal mixes a run's model with the one it was tuned from; {model.source} is an "
            "exported model that does not name its base; anneal the run's checkpoint instead"
        )
    return Annealing(request.anneal, base_model_forward(model.config, model.backbone))


def sample_checkpoint(
    checkpoint: str | Path, request: SampleRequest, out_dir: str | Path
) -> list[Path]:
    """Generate ``request`` with the model at ``checkpoint`` (:func:`open_model`); returns the
    written paths (a clip's: its files, then its PNG; :func:`save_clip`).

    Each PNG carries its parameters in a ``parameters`` text chunk (as A1111 writes them), and
    is named :func:`image_name`: numbered on from the folder's images, never overwriting one.
    Images are written as each batch of ``request.batch_size`` is done. The same seed gives the
    same image, whatever the number of prompts, images or the batch size. ``request.captions``
    writes each prompt beside its image as ``NAME.txt`` (a caption folder to train on, e.g.
    DreamBooth's class images). ``request.anneal`` mixes in the base model
    (:func:`base_model_forward`) with that schedule.
    """
    if (request.num_images is not None and request.num_images < 1) or request.batch_size < 1:
        raise ValueError(
            f"--num and --batch-size must be >= 1, got {request.num_images} and "
            f"{request.batch_size}"
        )
    if request.frames is not None and request.frames < 1:
        raise ValueError(f"--frames must be >= 1, got {request.frames}")
    check_clip_formats(request.formats, "--format")  # before the model loads
    prompts = request.all_prompts()  # a bad prompt file or spec fails before loading
    if not prompts:  # the run's validation prompts, read before the model loads
        config = (
            read_checkpoint_config(resolve_checkpoint(checkpoint))
            if is_run_checkpoint(checkpoint)
            else None
        )
        prompts, request = validation_request(request, config, checkpoint)
    if request.anneal is not None:
        anneal_weights(request.anneal, 1)
    model = open_model(checkpoint, ema=request.ema)
    anneal = _annealing(request, model)
    shared = request.shared_options(model)
    defaults = request.prompt_defaults(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, index = [], next_index(out_dir)
    for prompt in prompts:
        prompt_options = prompt.options.over(defaults)
        for first in range(0, shared.num_images, shared.batch_size):
            count = min(shared.batch_size, shared.num_images - first)
            seed = prompt_options.seed + first
            options = replace(prompt_options, seed=seed)
            samples = generate_prompt(model, prompt.text, options, count, shared, anneal)
            for offset, sample in enumerate(samples):
                info = PngInfo()
                parameters = parameters_text(prompt.text, options, shared, seed + offset)
                info.add_text("parameters", parameters)
                paths, index = save_sample(
                    sample, out_dir, index, prompt.text, seed + offset, info, shared.clips
                )
                if request.captions:
                    write_caption(paths[-1], prompt.text)
                written += paths
    return written


def save_sample(
    sample: Tensor,
    out_dir: Path,
    index: int,
    prompt: str,
    seed: int,
    info: PngInfo,
    clips: ClipOutput | None,
) -> tuple[list[Path], int]:
    """An image ``[3, H, W]`` as a PNG (:func:`save_new`), or a clip ``[3, T, H, W]`` as its
    files (:func:`save_clip`); the paths written (the PNG last) and the next index."""
    if clips is not None:
        return save_clip(sample, out_dir, index, prompt, seed, info, clips)
    path, index = save_new(to_pil(sample[None])[0], out_dir, index, prompt, seed, info)
    return [path], index


def write_caption(image_path: Path, prompt: str) -> None:
    """``prompt`` as the caption of ``image_path``: the same name with ``.txt``, created
    exclusively (a stray caption file of that name is an error, never overwritten)."""
    with open(image_path.with_suffix(".txt"), "x", encoding="utf-8") as caption:
        caption.write(prompt + "\n")


def generate_prompt(
    model: SamplingModel,
    prompt: str,
    options: PromptOptions,
    num_images: int,
    shared: SharedOptions,
    anneal: Annealing | None,
) -> Tensor:
    """``num_images`` images of ``prompt``, ``[k, 3, H, W]`` in [0, 1], image i from seed
    ``options.seed + i``; with ``shared.clips``, clips ``[k, 3, T, H, W]``."""
    clips = shared.clips
    one_frame = clips is not None and clips.generate_frames is None  # an image model's
    frames = {} if clips is None or one_frame else {"frames": clips.generate_frames}
    samples = generate(
        model.backbone,
        [prompt] * num_images,
        negative_prompt=options.negative_prompt,
        num_steps=options.num_steps,
        guidance_scale=options.guidance_scale,
        guidance_rescale=shared.guidance_rescale,
        sampler=shared.sampler,
        seed=options.seed,
        height=options.height,
        width=options.width,
        anneal=anneal,
        **frames,
        **model_sampling_options(model, shared.spacing),
    )
    return samples[:, :, None] if one_frame else samples
