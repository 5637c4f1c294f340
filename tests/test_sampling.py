"""Tests for impasto.sampling: ladders and samplers vs diffusers, CFG, and generation."""

from __future__ import annotations

import pytest
import torch
from diffusers_reference import (
    LATENT_TOL,
    NEGATIVE,
    PROMPTS,
    SCHEDULERS,
    generators,
    pipeline,
)
from diffusers_reference import ddim as _ddim
from diffusers_reference import euler as _euler
from torch.testing import assert_close

from impasto.models import SDXLComponents
from impasto.models.sdxl import SDXLBackbone
from impasto.objectives import PREDICTION_TARGETS, add_noise
from impasto.sampling import (
    SAMPLERS,
    cfg,
    denoised_from_prediction,
    generate,
    generate_latents,
    get_sampler,
    guided_output,
    initial_noise,
    make_grid,
    rescale_cfg,
    sample_ddim,
    sample_euler,
    sampling_timesteps,
    sdxl_alphas_cumprod,
    sigmas_for_timesteps,
    to_pil,
)

# --- schedules ------------------------------------------------------------------------------


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("num_steps", [2, 5, 27, 30, 48, 50, 999])
def test_euler_ladder_equals_diffusers(spacing: str, num_steps: int) -> None:
    scheduler = _euler(spacing)
    scheduler.set_timesteps(num_steps)
    timesteps, sigmas = get_sampler("euler").schedule(
        num_steps, scheduler.alphas_cumprod, spacing, steps_offset=1
    )
    # Same ᾱ in, bit-identical ladder out (fractional timesteps for linspace).
    assert torch.equal(timesteps, scheduler.timesteps)
    assert torch.equal(sigmas, scheduler.sigmas)
    # impasto's float64 ᾱ differs from diffusers' float32 cumprod by ~1e-5 relative at small σ.
    sigmas_64 = sigmas_for_timesteps(timesteps, sdxl_alphas_cumprod(), final_sigma="zero")
    assert_close(sigmas_64, scheduler.sigmas, rtol=3e-5, atol=0)


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("num_steps", [2, 5, 27, 30, 50, 999])
def test_ddim_timesteps_equal_diffusers(spacing: str, num_steps: int) -> None:
    scheduler = _ddim(spacing)
    scheduler.set_timesteps(num_steps)
    timesteps = sampling_timesteps(num_steps, 1000, spacing, steps_offset=1, integer=True)
    assert torch.equal(timesteps.long(), scheduler.timesteps)


@pytest.mark.parametrize("num_steps", [1, 7, 30, 50])
def test_ddim_ladder_steps_to_diffusers_previous_timestep(num_steps: int) -> None:
    """σ_{i+1} is σ at diffusers' t − T//n, and σ at ᾱ_0 (set_alpha_to_one=False) at the end."""
    scheduler = _ddim("leading")
    scheduler.set_timesteps(num_steps)
    timesteps, sigmas = get_sampler("ddim").schedule(num_steps, scheduler.alphas_cumprod)
    previous = scheduler.timesteps - 1000 // num_steps
    alphas_prev = torch.stack(
        [scheduler.alphas_cumprod[t] if t >= 0 else scheduler.final_alpha_cumprod for t in previous]
    )
    assert_close(sigmas[1:], ((1 - alphas_prev) / alphas_prev).sqrt(), rtol=1e-6, atol=0)
    assert torch.equal(timesteps.long(), scheduler.timesteps)


def test_sdxl_schedule_endpoints_and_trailing_count() -> None:
    sigmas = sigmas_for_timesteps(sampling_timesteps(2, 1000, "trailing"), sdxl_alphas_cumprod())
    assert_close(sigmas[0], torch.tensor(14.6146), rtol=1e-4, atol=0)  # σ_max (DESIGN §5)
    assert sigmas[-1] == 0
    ddim_sigmas = get_sampler("ddim").schedule(30, sdxl_alphas_cumprod())[1]
    assert_close(ddim_sigmas[-1], torch.tensor(0.0292), rtol=2e-3, atol=0)  # σ_min
    # diffusers' np.arange gives 62 timesteps (the last −1) for 61 trailing steps; we give 61.
    timesteps = sampling_timesteps(61, 1000, "trailing")
    assert timesteps.shape == (61,) and timesteps.min() >= 0


def test_schedule_errors_list_valid_names() -> None:
    with pytest.raises(ValueError, match="valid spacings: \\['leading', 'linspace', 'trailing'\\]"):
        sampling_timesteps(10, 1000, "karras")
    with pytest.raises(ValueError, match="num_steps"):
        sampling_timesteps(0, 1000)
    with pytest.raises(ValueError, match="trailing"):
        sampling_timesteps(1, 1000, "linspace")
    with pytest.raises(ValueError, match="valid samplers: \\['ddim', 'dpmpp_2m', "):
        get_sampler("heun")
    assert sorted(SAMPLERS) == [
        "ddim", "dpmpp_2m", "dpmpp_2m_karras", "euler", "euler_ancestral", "unipc"
    ]  # fmt: skip


# --- samplers, predictions, guidance (pure functions) ----------------------------------------


def _geometric_ladder(num_steps: int) -> torch.Tensor:
    """num_steps log-spaced σ from 14.6 to 0.03, then 0 (float64)."""
    sigmas = torch.logspace(1.1644, -1.5229, num_steps, dtype=torch.float64)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)])


@pytest.mark.parametrize("sample", [sample_euler, sample_ddim])
def test_samplers_land_exactly_on_a_point_mass(sample) -> None:
    """Data = one point x0*: D(x; σ) = x0*, and every step gives x0* + σ_next·ε exactly."""
    generator = torch.Generator().manual_seed(0)
    target, noise = torch.randn(2, 3, 4, 2, 2, generator=generator, dtype=torch.float64)
    sigmas = _geometric_ladder(7)
    states = []
    result = sample(
        lambda x, sigma, timestep: target,
        target + sigmas[0] * noise,
        sigmas,
        torch.zeros(7),
        callback=lambda i, x, denoised: states.append(x),
    )
    assert_close(result, target)
    assert_close(torch.stack(states), target + sigmas[1:, None, None, None, None] * noise)


@pytest.mark.parametrize("sample", [sample_euler, sample_ddim])
def test_samplers_converge_to_the_gaussian_probability_flow_ode(sample) -> None:
    """Data N(0, s²): D(x; σ) = x·s²/(s² + σ²); the ODE maps x at σ_T to x·s/sqrt(s² + σ_T²).

    First-order methods: doubling the steps about halves the error.
    """
    data_std = 0.5
    x_start = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(0)).double()

    def denoise(x: torch.Tensor, sigma: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return x * data_std**2 / (data_std**2 + sigma**2)

    errors = []
    for num_steps in (50, 100, 200):
        sigmas = _geometric_ladder(num_steps)
        exact = x_start * data_std / (data_std**2 + sigmas[0] ** 2).sqrt()
        result = sample(denoise, x_start, sigmas, torch.zeros(num_steps))
        errors.append(((result - exact).abs() / exact.abs()).max().item())
    assert errors[2] < 0.6 * errors[1] < 0.36 * errors[0]
    assert errors[2] < 0.01


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_denoised_from_prediction_inverts_the_training_target(prediction_type: str) -> None:
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 2, 4, 4, 4, generator=generator)
    alphas_cumprod = sdxl_alphas_cumprod()
    for t in (0, 500, 999):
        timesteps = torch.tensor([t, t])
        x_t = add_noise(x0, noise, timesteps, alphas_cumprod)
        output = PREDICTION_TARGETS[prediction_type](x0, noise, timesteps, alphas_cumprod)
        assert_close(denoised_from_prediction(prediction_type, output, x_t, alphas_cumprod[t]), x0)
    with pytest.raises(ValueError, match="valid types: \\['epsilon', 'sample', 'v_prediction'\\]"):
        denoised_from_prediction("x0", noise, x0, alphas_cumprod[0])


def test_cfg_and_rescale() -> None:
    generator = torch.Generator().manual_seed(0)
    uncond, cond = torch.randn(2, 3, 4, 5, 5, generator=generator)
    assert_close(cfg(uncond, cond, 1.0), cond)
    assert torch.equal(cfg(uncond, cond, 0.0), uncond)
    assert_close(cfg(uncond, cond, 7.0), uncond + 7.0 * (cond - uncond))
    guided = cfg(uncond, cond, 7.0)
    assert torch.equal(rescale_cfg(guided, cond, 0.0), guided)
    fully_rescaled = rescale_cfg(guided, cond, 1.0)
    assert_close(fully_rescaled.std(dim=(1, 2, 3)), cond.std(dim=(1, 2, 3)))
    assert_close(rescale_cfg(guided, cond, 0.7), 0.7 * fully_rescaled + 0.3 * guided)


def test_guided_output_batches_uncond_then_cond_in_one_forward() -> None:
    calls: list[tuple[int, str]] = []

    def model(x: torch.Tensor, timestep: torch.Tensor, conditioning: str) -> torch.Tensor:
        calls.append((x.shape[0], conditioning))
        offsets = {"c": 1.0, "u": 0.0}
        return x + torch.tensor([offsets[c] for c in conditioning]).view(-1, 1)

    x, t = torch.zeros(2, 3), torch.tensor(10.0)
    assert torch.equal(guided_output(model, x, t, "cc", "uucc", 1.0), x + 1)
    assert calls == [(2, "cc")]  # scale 1: conditional branch only
    assert torch.equal(guided_output(model, x, t, "cc", "uucc", 3.0), x + 3)
    assert calls[1:] == [(4, "uucc")]


# --- generation vs diffusers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampler", "guidance_rescale", "prediction_type"),
    [
        ("euler", 0.0, "epsilon"),
        ("ddim", 0.0, "epsilon"),
        ("euler", 0.7, "epsilon"),
        ("euler", 0.0, "v_prediction"),
        ("ddim", 0.7, "v_prediction"),
        ("dpmpp_2m_karras", 0.0, "epsilon"),
        ("dpmpp_2m", 0.0, "epsilon"),
        ("euler_ancestral", 0.0, "epsilon"),
        ("dpmpp_2m_karras", 0.7, "v_prediction"),
        ("euler_ancestral", 0.7, "v_prediction"),
    ],
)
def test_generate_equals_diffusers_sdxl_pipeline(
    tiny: SDXLComponents, sampler: str, guidance_rescale: float, prediction_type: str
) -> None:
    kwargs = {
        "num_steps": 6,
        "guidance_scale": 4.5,
        "guidance_rescale": guidance_rescale,
        "prediction_type": prediction_type,
    }
    latents = generate_latents(
        SDXLBackbone(tiny), PROMPTS, negative_prompt=NEGATIVE, sampler=sampler, seed=7, **kwargs
    )
    pipe = pipeline(tiny, SCHEDULERS[sampler](prediction_type=prediction_type))
    # The pipeline draws the initial latents, then each ancestral step's noise, from row i's
    # own generator: impasto's per-image seeds continue the same way.
    reference = pipe(
        PROMPTS,
        negative_prompt=[NEGATIVE] * len(PROMPTS),
        num_inference_steps=6,
        guidance_scale=4.5,
        guidance_rescale=guidance_rescale,
        height=64,
        width=64,
        generator=generators(len(PROMPTS), 7),
        output_type="latent",
    ).images
    assert_close(latents, reference, **LATENT_TOL)

    if prediction_type != "epsilon":
        return  # decoding is the same for every prediction type
    images = generate(
        SDXLBackbone(tiny), PROMPTS, negative_prompt=NEGATIVE, sampler=sampler, seed=7, **kwargs
    )
    reference_images = pipe.image_processor.postprocess(
        tiny.vae.decode(reference / tiny.vae_scaling_factor).sample, output_type="pt"
    )
    assert images.shape == (2, 3, 64, 64) and images.dtype == torch.float32
    assert_close(images, reference_images, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spacing", ["trailing", "linspace"])
def test_euler_trailing_and_linspace_equal_diffusers_up_to_its_prior(
    tiny: SDXLComponents, spacing: str
) -> None:
    """diffusers' Euler starts these at σ_max·ε, impasto at sqrt(σ_max² + 1)·ε (DDPM prior)."""
    latents = generate_latents(
        SDXLBackbone(tiny),
        PROMPTS[:1],
        negative_prompt=NEGATIVE,
        num_steps=5,
        spacing=spacing,
        seed=1,
    )
    scheduler = _euler(spacing)
    scheduler.set_timesteps(5)
    sigma_max = scheduler.sigmas[0]
    noise = initial_noise(1, SDXLBackbone(tiny).latent_shape(64, 64), seed=1)
    reference = pipeline(tiny, scheduler)(
        PROMPTS[:1],
        negative_prompt=NEGATIVE,
        num_inference_steps=5,
        guidance_scale=5.0,
        height=64,
        width=64,
        latents=noise * (sigma_max**2 + 1) ** 0.5 / sigma_max,
        output_type="latent",
    ).images
    assert_close(latents, reference, **LATENT_TOL)


def test_guidance_scale_one_is_the_conditional_model(tiny: SDXLComponents) -> None:
    kwargs = {"num_steps": 4, "guidance_scale": 1.0, "seed": 3}
    latents = generate_latents(
        SDXLBackbone(tiny), PROMPTS, negative_prompt="anything at all", **kwargs
    )
    assert torch.equal(
        latents, generate_latents(SDXLBackbone(tiny), PROMPTS, negative_prompt="", **kwargs)
    )
    reference = pipeline(tiny, _euler())(
        PROMPTS,
        num_inference_steps=4,
        guidance_scale=1.0,
        height=64,
        width=64,
        latents=initial_noise(2, SDXLBackbone(tiny).latent_shape(64, 64), seed=3),
        output_type="latent",
    ).images
    assert_close(latents, reference, **LATENT_TOL)
    guided = generate_latents(SDXLBackbone(tiny), PROMPTS, **{**kwargs, "guidance_scale": 5.0})
    assert (guided - latents).abs().max() > 1e-2


# --- determinism, batching, model state ------------------------------------------------------


def test_same_seed_same_image_and_independent_of_batch(tiny: SDXLComponents) -> None:
    kwargs = {"negative_prompt": NEGATIVE, "num_steps": 3, "guidance_scale": 5.0}
    batch = generate(SDXLBackbone(tiny), ["a green triangle", *PROMPTS], seed=10, **kwargs)
    assert torch.equal(
        batch, generate(SDXLBackbone(tiny), ["a green triangle", *PROMPTS], seed=10, **kwargs)
    )
    # Row j uses seed + j: the batch's second image alone, from seed 11.
    alone = generate(SDXLBackbone(tiny), PROMPTS[:1], seed=11, **kwargs)
    assert_close(alone[0], batch[1], rtol=0, atol=1e-5)
    repeated = generate(SDXLBackbone(tiny), PROMPTS[:1], num_images_per_prompt=2, seed=11, **kwargs)
    assert_close(repeated[0], alone[0], rtol=0, atol=1e-5)
    other_seed = generate(SDXLBackbone(tiny), PROMPTS[:1], seed=12, **kwargs)
    assert_close(repeated[1], other_seed[0], rtol=0, atol=1e-5)
    assert (other_seed - alone).abs().max() > 1e-3


def test_generate_restores_modes_and_leaves_global_rng(tiny: SDXLComponents) -> None:
    tiny.unet.train()
    tiny.unet.conv_in.eval()  # a mixed state must come back exactly
    modes = {name: module.training for name, module in tiny.unet.named_modules()}
    rng_state = torch.get_rng_state()
    try:
        generate(SDXLBackbone(tiny), PROMPTS[:1], num_steps=2, sampler="ddim")
        assert {name: module.training for name, module in tiny.unet.named_modules()} == modes
        assert not tiny.vae.training and not tiny.text_encoder.training
        assert torch.equal(torch.get_rng_state(), rng_state)
    finally:
        tiny.unet.eval()


def test_generate_rejects_bad_arguments(tiny: SDXLComponents) -> None:
    with pytest.raises(ValueError, match="multiples of 8"):
        generate(SDXLBackbone(tiny), PROMPTS, height=60)
    with pytest.raises(ValueError, match="negative_prompt has 1 entries for 2 prompts"):
        generate(SDXLBackbone(tiny), PROMPTS, negative_prompt=["x"])
    with pytest.raises(ValueError, match="valid samplers"):
        generate(SDXLBackbone(tiny), PROMPTS, sampler="dpm")
    with pytest.raises(ValueError, match="valid types"):
        generate(SDXLBackbone(tiny), PROMPTS, prediction_type="x0", num_steps=1)
    with pytest.raises(ValueError, match="list of strings"):
        generate(SDXLBackbone(tiny), "a red circle")


# --- images -----------------------------------------------------------------------------------


def test_to_pil_and_make_grid() -> None:
    images = torch.zeros(3, 3, 4, 6)
    images[0, 0] = 1.0  # red
    images[1, 1] = 0.5  # green 128 (0.5·255 = 127.5 rounds to even)
    images[2, 2] = 1.0  # blue
    pils = to_pil(images)
    assert [pil.size for pil in pils] == [(6, 4)] * 3 and pils[0].mode == "RGB"
    assert pils[0].getpixel((0, 0)) == (255, 0, 0)
    assert pils[1].getpixel((5, 3)) == (0, 128, 0)
    grid = make_grid(images, nrow=2, padding=1, pad_value=1.0)
    assert grid.size == (2 * 7 + 1, 2 * 5 + 1)
    assert grid.getpixel((0, 0)) == (255, 255, 255)  # padding
    assert grid.getpixel((1, 1)) == (255, 0, 0)  # image 0, top left
    assert grid.getpixel((8, 1)) == (0, 128, 0)  # image 1, top right
    assert grid.getpixel((1, 6)) == (0, 0, 255)  # image 2, second row
    assert grid.getpixel((8, 6)) == (255, 255, 255)  # empty cell
