"""Text-to-image generation with SDXL components: prompts in, images in [0, 1] out.

This is the one module of ``impasto.sampling`` that knows SDXL: it encodes prompts as
``impasto.models`` does for training, wraps the UNet as a denoiser and decodes with the VAE.
With the same initial noise it reproduces diffusers' ``StableDiffusionXLPipeline`` with
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
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

from impasto.config.schema import FLOW
from impasto.models import SDXLComponents, add_time_ids, encode_prompts
from impasto.objectives import alphas_cumprod_from_betas, scaled_linear_betas, shift_for_size
from impasto.sampling.denoisers import vp_denoiser
from impasto.sampling.flow import flow_denoiser, flow_timesteps, get_flow_sampler
from impasto.sampling.samplers import StepCallback, get_sampler
from impasto.sampling.schedules import initial_noise_scale


def sdxl_alphas_cumprod() -> Tensor:
    """ᾱ [1000] float64 of SDXL's ``scaled_linear`` schedule (β from 0.00085 to 0.012)."""
    return alphas_cumprod_from_betas(scaled_linear_betas(1000, 0.00085, 0.012))


@dataclass(frozen=True)
class UNetConditioning:
    """SDXL UNet conditioning for B rows: text, pooled text and size micro-conditioning."""

    prompt_embeds: Tensor  # [B, 77, D1 + D2]
    pooled_prompt_embeds: Tensor  # [B, P]
    time_ids: Tensor  # [B, 6]

    def cat(self, other: UNetConditioning) -> UNetConditioning:
        """``[self; other]`` along the batch axis."""
        return UNetConditioning(
            torch.cat([self.prompt_embeds, other.prompt_embeds]),
            torch.cat([self.pooled_prompt_embeds, other.pooled_prompt_embeds]),
            torch.cat([self.time_ids, other.time_ids]),
        )


def sdxl_conditioning(
    models: SDXLComponents, prompts: list[str], height: int, width: int
) -> UNetConditioning:
    """Encode ``prompts``; time ids with original = target = (height, width), crop (0, 0).

    The result is on the UNet's device and in its dtype.
    """
    embeds = encode_prompts(models, prompts)
    sizes = torch.tensor([[height, width]] * len(prompts))
    time_ids = add_time_ids(sizes, torch.zeros_like(sizes), sizes)
    device, dtype = models.unet.device, models.unet.dtype
    return UNetConditioning(
        prompt_embeds=embeds.prompt_embeds.to(device=device, dtype=dtype),
        pooled_prompt_embeds=embeds.pooled_prompt_embeds.to(device=device, dtype=dtype),
        time_ids=time_ids.to(device=device, dtype=dtype),
    )


def unet_forward(unet: nn.Module) -> Callable[[Tensor, Tensor, UNetConditioning], Tensor]:
    """``(x_t, timestep, UNetConditioning) -> output`` float32, for ``denoisers.vp_denoiser``."""

    def forward(x_t: Tensor, timestep: Tensor, conditioning: UNetConditioning) -> Tensor:
        output = unet(
            x_t.to(unet.dtype),
            timestep.to(x_t.device),
            encoder_hidden_states=conditioning.prompt_embeds,
            added_cond_kwargs={
                "text_embeds": conditioning.pooled_prompt_embeds,
                "time_ids": conditioning.time_ids,
            },
        ).sample
        return output.float()

    return forward


def latent_shape(models: SDXLComponents, height: int, width: int) -> tuple[int, int, int]:
    """(C, H/f, W/f) with f = 2**(number of VAE levels − 1); ValueError unless f divides H, W."""
    factor = 2 ** (len(models.vae.config.block_out_channels) - 1)
    if height <= 0 or width <= 0 or height % factor or width % factor:
        raise ValueError(
            f"height and width must be positive multiples of {factor} (the VAE's downsampling "
            f"factor), got {height}x{width}"
        )
    return int(models.unet.config.in_channels), height // factor, width // factor


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
    models: SDXLComponents,
    prompts: list[str],
    *,
    negative_prompt: str | list[str] = "",
    num_images_per_prompt: int = 1,
    num_steps: int = 30,
    guidance_scale: float = 5.0,
    guidance_rescale: float = 0.0,
    sampler: str = "euler",
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
) -> Tensor:
    """Sample VP latents ``[B, C, H/f, W/f]`` float32 on the UNet's device (not yet unscaled).

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
    shape = latent_shape(models, height, width)
    negatives = _negative_prompts(negative_prompt, len(prompts))
    # Row j of the batch (prompt j // k, image j % k) starts from the noise of seed + j.
    prompts = [prompt for prompt in prompts for _ in range(num_images_per_prompt)]
    negatives = [negative for negative in negatives for _ in range(num_images_per_prompt)]
    alphas_cumprod = sdxl_alphas_cumprod() if alphas_cumprod is None else alphas_cumprod
    flow = prediction_type == FLOW
    if flow:  # the state is x_t itself, from x_1 = ε (sampling/flow.py)
        sample = get_flow_sampler(sampler)
        shift = shift_for_size(flow_shift, height, width, flow_shift_resolution)
        timesteps, sigmas = flow_timesteps(num_steps, shift, alphas_cumprod.shape[0])
        stochastic, noise_scale = False, 1.0
        make_denoiser = flow_denoiser
    else:  # VE state x_t/sqrt(ᾱ), from the DDPM prior
        spec = get_sampler(sampler)
        sample, stochastic = spec.sample, spec.stochastic
        timesteps, sigmas = spec.schedule(num_steps, alphas_cumprod, spacing, steps_offset)
        noise_scale = initial_noise_scale(sigmas[0])
        make_denoiser = functools.partial(vp_denoiser, prediction_type=prediction_type)
    unet = models.unet
    with torch.no_grad(), eval_mode(unet, models.text_encoder, models.text_encoder_2):
        cond = sdxl_conditioning(models, prompts, height, width)
        uncond_and_cond = None
        if guidance_scale != 1.0:
            uncond_and_cond = sdxl_conditioning(models, negatives, height, width).cat(cond)
        denoise = make_denoiser(
            unet_forward(unet),
            cond,
            uncond_and_cond,
            guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale,
        )
        generators = image_generators(len(prompts), seed)
        x = draw_noise(generators, shape).to(unet.device) * noise_scale
        step_noise = noise_source(generators, shape, unet.device) if stochastic else None
        x = sample(denoise, x, sigmas, timesteps, callback=callback, noise=step_noise)
        if flow:
            return x
        # VE → VP at the final level: x/sqrt(σ² + 1), exactly x when the ladder ends at σ = 0.
        return x / (sigmas[-1] ** 2 + 1) ** 0.5


def decode_latents(vae: nn.Module, latents: Tensor) -> Tensor:
    """VAE-decode VP latents to images ``[B, 3, H, W]`` in [0, 1], float32 on CPU.

    Images are decoded one at a time: decoding is the peak-memory step at SDXL resolutions.
    """
    config = vae.config
    latents_mean = getattr(config, "latents_mean", None)
    latents_std = getattr(config, "latents_std", None)
    images = []
    with torch.no_grad(), eval_mode(vae):
        for latent in latents.to(device=vae.device, dtype=vae.dtype).split(1):
            if latents_mean is not None and latents_std is not None:
                mean = torch.tensor(latents_mean).view(1, -1, 1, 1).to(latent)
                std = torch.tensor(latents_std).view(1, -1, 1, 1).to(latent)
                latent = latent * std / config.scaling_factor + mean
            else:
                latent = latent / config.scaling_factor
            image = vae.decode(latent).sample.float()
            images.append((image / 2 + 0.5).clamp(0, 1).cpu())
    return torch.cat(images)


def generate(models: SDXLComponents, prompts: list[str], **options: Any) -> Tensor:
    """Generate images: ``[B·k, 3, height, width]`` float32 on CPU in [0, 1], k per prompt.

    ``options`` are the keyword arguments of :func:`generate_latents`.

    Rows are prompt-major (k = ``num_images_per_prompt`` consecutive rows per prompt).
    ``negative_prompt`` is one string for all prompts or one per prompt (the empty string is
    encoded, see the module docstring); ``guidance_scale`` 1 runs the conditional branch only;
    ``guidance_rescale`` is φ of Lin et al. 2023 (0 = off). ``sampler`` is a key of
    ``SAMPLERS``, ``spacing`` of ``SPACINGS``, ``prediction_type`` of ``PREDICTION_TYPES``
    or ``"flow"`` (then ``sampler`` is a key of ``FLOW_SAMPLERS``, the t ladder is shifted by
    ``flow_shift``, scaled to the image size with ``flow_shift_resolution``, and ``spacing`` is
    unused). ``alphas_cumprod`` ``[T]`` is the training schedule (default SDXL's; for flow
    only its length T is read, the UNet getting t·T). Row j starts from
    the noise of seed + j, so an image does not depend on the rest of the batch. Runs without
    gradients on the UNet's device; the models' train/eval modes are restored afterwards, and
    no global RNG is used, so a trainer can call this mid-run without changing its random
    streams.
    """
    return decode_latents(models.vae, generate_latents(models, prompts, **options))


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
