"""Text-to-image generation with a backbone: prompts in, images in [0, 1] out.

The model is any object with the backbone protocol's sampling methods
(``sampling_condition``, ``forward``, ``latent_shape``, ``decode_latents``, ``parts``,
``modules``, ``device``, ``dtype``; see ``impasto.models.backbone``); this module imports no
model family. With an SDXL backbone and the same initial noise it reproduces diffusers'
``StableDiffusionXLPipeline`` with
``EulerDiscreteScheduler``, ``DDIMScheduler`` or ``DPMSolverMultistepScheduler``; ancestral
samplers continue each image's own generator, so they reproduce the pipeline called with
``generator=[torch.Generator().manual_seed(seed + i) for i in ...]`` (see
``tests/test_sampling.py`` and ``tests/test_samplers_more.py``).

Negative prompt: the unconditional branch of classifier-free guidance is the *encoded*
negative prompt, including the empty string. impasto trains the unconditional model by caption
dropout, which encodes dropped captions as "", so "" here is the embedding the model learned.
(diffusers' SDXL pipeline with ``force_zeros_for_empty_prompt=True`` uses all-zero embeddings
when no negative prompt is given; passing ``negative_prompt=""`` to it matches impasto.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

from impasto.objectives import alphas_cumprod_from_betas, scaled_linear_betas
from impasto.sampling.anneal import Annealing, anneal_weights, annealed_forward
from impasto.sampling.process import (
    OwnSampling,
    SamplingRequest,
    default_sampler,
    family_plan,
    sampling_plan,
)
from impasto.sampling.samplers import StepCallback


def sdxl_alphas_cumprod() -> Tensor:
    """ᾱ [1000] float64 of SDXL's ``scaled_linear`` schedule (β from 0.00085 to 0.012)."""
    return alphas_cumprod_from_betas(scaled_linear_betas(1000, 0.00085, 0.012))


def model_forward(backbone: Any) -> Callable[[Tensor, Tensor, Any], Tensor]:
    """``(x_t, timestep, conditioning) -> output`` float32 for the denoisers: the input in the
    model's dtype, the time on its device."""

    def forward(x_t: Tensor, timestep: Tensor, conditioning: Any) -> Tensor:
        x_t = x_t.to(backbone.dtype)
        return backbone.forward(x_t, timestep.to(x_t.device), conditioning).float()

    return forward


def image_generators(num_images: int, seed: int) -> list[torch.Generator]:
    """One CPU generator per image, image i's seeded with seed + i."""
    return [torch.Generator().manual_seed(seed + i) for i in range(num_images)]


def draw_noise(generators: list[torch.Generator], shape: tuple[int, ...]) -> Tensor:
    """ε ~ N(0, I) ``[len(generators), *shape]`` float32 on CPU, row i the next from generator i.

    One generator per image makes image i the same whatever the batch size; it equals
    diffusers' ``randn_tensor`` with a list of generators (one per row).
    """
    return torch.stack([torch.randn(shape, generator=generator) for generator in generators])


def initial_noise(num_images: int, shape: tuple[int, ...], seed: int) -> Tensor:
    """ε ~ N(0, I) ``[num_images, *shape]`` float32 on CPU; image i from its own seed + i.

    It equals diffusers' ``randn_tensor`` with ``generator=[torch.Generator().manual_seed(seed
    + i)]``, the pipeline's initial latents.
    """
    return draw_noise(image_generators(num_images, seed), shape)


def noise_source(
    generators: list[torch.Generator], shape: tuple[int, ...], device: torch.device
) -> Callable[[], Tensor]:
    """``noise()`` for stochastic samplers: each call draws every image's next ε on ``device``.

    Continuing the generators that drew the initial noise is what diffusers' pipeline does with
    ``generator=[...]``: its ancestral scheduler steps draw each row from that row's generator.
    """

    def noise() -> Tensor:
        return draw_noise(generators, shape).to(device)

    return noise


@contextlib.contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Put ``modules`` in eval mode, then restore every submodule's own train/eval flag."""
    flags = [(module, module.training) for root in modules for module in root.modules()]
    try:
        for root in modules:
            root.eval()
        yield
    finally:
        for module, training in flags:
            module.training = training


def embed_guidance(backbone: Any, cond: Any, guidance_scale: float) -> tuple[Any, float]:
    """``(conditioning, classifier-free guidance scale)``: a backbone that takes its guidance
    as an input (``OwnSampling.embedded_guidance``) gets ``guidance_scale`` in its
    conditioning and samples without classifier-free guidance (scale 1); others keep both."""
    if not isinstance(backbone, OwnSampling):
        return cond, guidance_scale
    embedded = backbone.embedded_guidance(cond, guidance_scale)
    return (cond, guidance_scale) if embedded is None else (embedded, 1.0)


def _negative_prompts(negative_prompt: str | list[str], num_prompts: int) -> list[str]:
    if isinstance(negative_prompt, str):
        return [negative_prompt] * num_prompts
    if len(negative_prompt) != num_prompts:
        raise ValueError(
            f"negative_prompt has {len(negative_prompt)} entries for {num_prompts} prompts; "
            "give one string or one per prompt"
        )
    return list(negative_prompt)


def generate_latents(
    backbone: Any,
    prompts: list[str],
    *,
    negative_prompt: str | list[str] = "",
    num_images_per_prompt: int = 1,
    num_steps: int = 30,
    guidance_scale: float = 5.0,
    guidance_rescale: float = 0.0,
    sampler: str | None = None,
    seed: int = 0,
    height: int = 64,
    width: int = 64,
    prediction_type: str = "epsilon",
    alphas_cumprod: Tensor | None = None,
    spacing: str = "leading",
    steps_offset: int = 1,
    flow_shift: float = 1.0,
    flow_shift_resolution: int | None = None,
    callback: StepCallback | None = None,
    anneal: Annealing | None = None,
    frames: int | None = None,
) -> Tensor:
    """Sample VP latents ``[B, C, H/f, W/f]`` float32 on the model's device (not yet unscaled);
    with ``frames``, clips of that many frames: ``[B, C, t, H/f, W/f]``.

    Arguments are documented on :func:`generate`; ``callback(i, x, denoised)`` sees the
    sampler's state after step i (VE form; for flow x_t).
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if num_images_per_prompt < 1:
        raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
    if not math.isfinite(guidance_scale):
        raise ValueError(f"guidance_scale must be finite, got {guidance_scale}")
    if not 0.0 <= guidance_rescale <= 1.0:
        raise ValueError(f"guidance_rescale must be in [0, 1], got {guidance_rescale}")
    shape = (
        backbone.latent_shape(height, width)
        if frames is None
        else (backbone.latent_shape(height, width, frames=frames))
    )
    negatives = _negative_prompts(negative_prompt, len(prompts))
    # Row j of the batch (prompt j // k, image j % k) starts from the noise of seed + j.
    prompts = [prompt for prompt in prompts for _ in range(num_images_per_prompt)]
    negatives = [negative for negative in negatives for _ in range(num_images_per_prompt)]
    alphas_cumprod = sdxl_alphas_cumprod() if alphas_cumprod is None else alphas_cumprod
    plan = sampling_plan(
        SamplingRequest(
            sampler=default_sampler(backbone) if sampler is None else sampler,
            num_steps=num_steps,
            prediction_type=prediction_type,
            alphas_cumprod=alphas_cumprod,
            spacing=spacing,
            steps_offset=steps_offset,
            flow_shift=flow_shift,
            flow_shift_resolution=flow_shift_resolution,
            height=height,
            width=width,
            frames=shape[1] if frames is not None else 1,
        )
    )
    plan = family_plan(plan, backbone, prediction_type, num_steps, height, width)
    forward = model_forward(backbone)
    if anneal is not None:
        # Each sampler step evaluates the model once, at plan.timesteps[i]: one timestep per
        # step, so their number is the n of the schedule's i/n. No network has run yet, so a
        # bad spec fails fast.
        weights = anneal_weights(anneal.spec, plan.timesteps.shape[0])
        forward = annealed_forward(anneal.base_forward, forward, plan.timesteps, weights)
    device = backbone.device
    with torch.no_grad(), eval_mode(*backbone.parts().values()):
        cond = backbone.sampling_condition(prompts, height, width)
        cond, guidance_scale = embed_guidance(backbone, cond, guidance_scale)
        uncond_and_cond = None
        if guidance_scale != 1.0:
            uncond_and_cond = backbone.sampling_condition(negatives, height, width).cat(cond)
        denoise = plan.make_denoiser(
            forward,
            cond,
            uncond_and_cond,
            guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale,
        )
        generators = image_generators(len(prompts), seed)
        x = draw_noise(generators, shape).to(device) * plan.noise_scale
        step_noise = noise_source(generators, shape, device) if plan.stochastic else None
        x = plan.sample(
            denoise, x, plan.sigmas, plan.timesteps, callback=callback, noise=step_noise
        )
        return plan.to_latents(x)


def generate(backbone: Any, prompts: list[str], **options: Any) -> Tensor:
    """Generate images: ``[B·k, 3, height, width]`` float32 on CPU in [0, 1], k per prompt
    (``frames=N``: clips ``[B·k, 3, N, height, width]``).

    ``options`` are the keyword arguments of :func:`generate_latents`.

    Rows are prompt-major (k = ``num_images_per_prompt`` consecutive rows per prompt).
    ``negative_prompt`` is one string for all prompts or one per prompt (the empty string is
    encoded, see the module docstring); ``guidance_scale`` 1 runs the conditional branch only;
    ``guidance_rescale`` is φ of Lin et al. 2023 (0 = off). ``sampler`` is a key of
    ``SAMPLERS`` (None: the family's own, ``process.default_sampler``; most
    families: Euler), ``spacing`` of ``SPACINGS``, ``prediction_type`` of ``PREDICTION_TYPES`` or
    ``"flow"`` (then ``sampler`` is a key of ``FLOW_SAMPLERS``, the t ladder is shifted by
    ``flow_shift``, scaled to the image size with ``flow_shift_resolution``, and ``spacing`` is
    unused). ``alphas_cumprod`` ``[T]`` is the training schedule (default SDXL's; for flow
    only its length T is read, the UNet getting t·T). ``anneal`` (an
    :class:`~impasto.sampling.anneal.Annealing`) samples with annealed guidance: at step i the
    model output is (1 − w_i)·base + w_i·this model (``sampling/anneal.py``). Row j starts from
    the noise of seed + j, so an image does not depend on the rest of the batch. Runs without
    gradients on the model's device; the networks' train/eval modes are restored afterwards, and
    no global RNG is used, so a trainer can call this mid-run without changing its random
    streams.
    """
    latents = generate_latents(backbone, prompts, **options)
    with eval_mode(*backbone.modules().values()):
        return backbone.decode_latents(latents)


def to_pil(images: Tensor) -> list[Image.Image]:
    """``[B, 3, H, W]`` in [0, 1] → B RGB images (round to nearest, as diffusers)."""
    pixels = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in pixels]


def make_grid(images: Tensor, nrow: int, padding: int = 2, pad_value: float = 1.0) -> Image.Image:
    """Tile ``[B, 3, H, W]`` images, ``nrow`` per row, ``padding`` pixels of ``pad_value`` apart."""
    if nrow < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    num_images, channels, height, width = images.shape
    num_cols = min(nrow, num_images)
    num_rows = math.ceil(num_images / num_cols)
    grid = torch.full(
        (channels, num_rows * (height + padding) + padding, num_cols * (width + padding) + padding),
        pad_value,
    )
    for index, image in enumerate(images.detach().float().cpu()):
        top = padding + (index // num_cols) * (height + padding)
        left = padding + (index % num_cols) * (width + padding)
        grid[:, top : top + height, left : left + width] = image
    return to_pil(grid[None])[0]
