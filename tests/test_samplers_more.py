"""Tests for the euler_ancestral, dpmpp_2m and dpmpp_2m_karras samplers against diffusers."""

from __future__ import annotations

import pytest
import torch
from diffusers import EulerAncestralDiscreteScheduler
from diffusers_reference import LATENT_TOL, NEGATIVE, PROMPTS, SCHEDULERS
from torch.testing import assert_close

from impasto.config.schema import ObjectiveConfig
from impasto.models import SDXLComponents
from impasto.models.sdxl import SDXLBackbone
from impasto.objectives import sigmas_from_alphas_cumprod, training_alphas_cumprod
from impasto.sampling import (
    SAMPLERS,
    generate_latents,
    get_sampler,
    initial_noise_scale,
    sample_ddim,
    sample_euler,
    sample_euler_ancestral,
    sdxl_alphas_cumprod,
    vp_denoiser,
)

NEW_SAMPLERS = ["euler_ancestral", "dpmpp_2m", "dpmpp_2m_karras"]


# --- ladders ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", NEW_SAMPLERS)
@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("num_steps", [2, 5, 14, 15, 30, 50, 200])
def test_ladder_equals_diffusers(sampler: str, spacing: str, num_steps: int) -> None:
    scheduler = SCHEDULERS[sampler](spacing)
    scheduler.set_timesteps(num_steps)
    timesteps, sigmas = get_sampler(sampler).schedule(
        num_steps, scheduler.alphas_cumprod, spacing, steps_offset=1
    )
    # Same float32 ᾱ in, the same ladder out, bit for bit (Karras σ included).
    assert_close(timesteps, scheduler.timesteps.to(torch.float32), rtol=0, atol=0)
    assert_close(sigmas, scheduler.sigmas, rtol=0, atol=0)
    # impasto's float64 ᾱ: the same timesteps, σ within diffusers' float32 rounding.
    timesteps_64, sigmas_64 = get_sampler(sampler).schedule(
        num_steps, sdxl_alphas_cumprod(), spacing, steps_offset=1
    )
    assert_close(timesteps_64, timesteps, rtol=0, atol=0)
    assert_close(sigmas_64, scheduler.sigmas, rtol=3e-5, atol=0)


def test_dpm_ladders_differ_from_euler_where_diffusers_does() -> None:
    """DPM-Solver's leading grid has n + 1 points; its Karras ladder ignores the spacing."""
    alphas_cumprod = sdxl_alphas_cumprod()
    euler_timesteps = get_sampler("euler").schedule(30, alphas_cumprod)[0]
    dpm_timesteps = get_sampler("dpmpp_2m").schedule(30, alphas_cumprod)[0]
    assert (euler_timesteps[0], euler_timesteps[-1]) == (958, 1)
    assert (dpm_timesteps[0], dpm_timesteps[-1]) == (961, 33)
    karras = get_sampler("dpmpp_2m_karras")
    timesteps, sigmas = karras.schedule(30, alphas_cumprod, "leading", steps_offset=1)
    for spacing in ("trailing", "linspace"):
        other = karras.schedule(30, alphas_cumprod, spacing, steps_offset=0)
        assert torch.equal(other[0], timesteps) and torch.equal(other[1], sigmas)
    # σ_max = σ_999, σ_min = σ_0 of the training schedule, then 0; t rounded to integers.
    sigmas_train = sigmas_from_alphas_cumprod(alphas_cumprod)
    expected = torch.stack(
        [sigmas_train[-1], sigmas_train[0], torch.zeros((), dtype=torch.float64)]
    )
    assert_close(sigmas[[0, -2, -1]], expected.float(), rtol=1e-6, atol=0)
    assert_close(sigmas[0], torch.tensor(14.6146), rtol=1e-4, atol=0)
    assert (timesteps[0], timesteps[-1]) == (999, 0) and torch.equal(timesteps, timesteps.round())
    with pytest.raises(ValueError, match="valid spacings"):
        get_sampler("dpmpp_2m").schedule(30, alphas_cumprod, "karras")


def test_registry_flags_and_noise_requirement() -> None:
    assert [name for name, spec in sorted(SAMPLERS.items()) if spec.stochastic] == [
        "euler_ancestral"
    ]
    with pytest.raises(ValueError, match="noise"):
        sample_euler_ancestral(
            lambda x, sigma, t: x, torch.zeros(2), torch.tensor([1.0, 0.0]), torch.zeros(1)
        )


# --- sampling loops on a toy network vs the diffusers scheduler loop ---------------------------


def _toy_network(x_t: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """A fixed ε-prediction, linear in x_t with a t-dependent slope and offset."""
    t = float(timestep) / 1000
    pattern = torch.linspace(-1, 1, x_t[0].numel()).view(x_t.shape[1:])
    return (0.3 + 0.6 * t) * x_t + 0.2 * torch.sin(3 * t + 2 * pattern)


def _normal_source(generator: torch.Generator, shape: tuple[int, ...], dtype=torch.float32):
    """``noise()`` drawing the next ε of ``shape`` from ``generator``."""
    return lambda: torch.randn(shape, generator=generator, dtype=dtype)


def _diffusers_loop(scheduler, num_steps: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scheduler.set_timesteps(num_steps)
    scale = scheduler.init_noise_sigma
    if isinstance(scheduler, EulerAncestralDiscreteScheduler):
        # diffusers' Euler starts trailing and linspace at σ_max·ε; impasto starts every spacing
        # at the DDPM prior sqrt(σ_max² + 1)·ε (schedules.initial_noise_scale), as leading.
        scale = initial_noise_scale(scheduler.sigmas[0])
    x = torch.randn(2, 4, 3, 3, generator=generator) * scale
    for t in scheduler.timesteps:
        model_output = _toy_network(scheduler.scale_model_input(x, t), t)
        x = scheduler.step(model_output, t, x, generator=generator).prev_sample
    return x


def _impasto_loop(
    sampler: str, alphas_cumprod, spacing: str, num_steps: int, seed: int, sample=None
) -> torch.Tensor:
    """``sampler``'s ladder and sampler (or another ``sample`` on that ladder) on the toy net."""
    generator = torch.Generator().manual_seed(seed)
    spec = get_sampler(sampler)
    timesteps, sigmas = spec.schedule(num_steps, alphas_cumprod, spacing, steps_offset=1)
    x = torch.randn(2, 4, 3, 3, generator=generator) * initial_noise_scale(sigmas[0])
    denoise = vp_denoiser(lambda x_t, t, cond: _toy_network(x_t, t), cond=None)
    noise = _normal_source(generator, x.shape)
    result = (sample or spec.sample)(denoise, x, sigmas, timesteps, noise=noise)
    return result / (sigmas[-1] ** 2 + 1) ** 0.5


@pytest.mark.parametrize("sampler", NEW_SAMPLERS)
@pytest.mark.parametrize("spacing", ["leading", "trailing"])
@pytest.mark.parametrize("num_steps", [1, 2, 7, 20])
def test_sampling_loop_equals_diffusers_scheduler(sampler: str, spacing: str, num_steps: int):
    scheduler = SCHEDULERS[sampler](spacing)
    reference = _diffusers_loop(scheduler, num_steps, seed=3)
    result = _impasto_loop(sampler, scheduler.alphas_cumprod, spacing, num_steps, seed=3)
    assert_close(result, reference, rtol=1e-5, atol=1e-5)
    args = (sampler, scheduler.alphas_cumprod, spacing, num_steps)
    if sampler == "euler_ancestral":  # the step noise matters (one step to σ = 0 adds none)
        if num_steps > 1:
            assert (
                _impasto_loop(*args, seed=3, sample=sample_euler) - reference
            ).abs().max() > 1e-2
        return
    # First-order DPM-Solver++ is DDIM: 2M equals it on the same ladder when its only steps are
    # the first and the last (both first order), and differs from the third step on.
    first_order = _impasto_loop(*args, seed=3, sample=sample_ddim)
    if num_steps <= 2:
        assert_close(first_order, reference, rtol=1e-5, atol=1e-5)
    else:
        assert (first_order - reference).abs().max() > 1e-3


def _gaussian_denoiser(data_std: float):
    """D(x; σ) = x·s²/(s² + σ²), the exact denoiser of data ~ N(0, s²)."""

    def denoise(x: torch.Tensor, sigma: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return x * data_std**2 / (data_std**2 + sigma**2)

    return denoise


def test_dpmpp_2m_is_second_order_on_the_gaussian_ode() -> None:
    """On a ladder ending at σ > 0 (≥ 15 steps: every step but the first is second order)
    the error falls ~4x per doubling; the first-order Euler's only ~2x."""
    data_std = 0.5
    x_start = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(0)).double()
    errors: dict[str, list[float]] = {"dpmpp_2m": [], "euler": []}
    for num_steps in (20, 40, 80):
        sigmas = torch.logspace(1.1644, -1.5229, num_steps + 1, dtype=torch.float64)
        exact = x_start * ((data_std**2 + sigmas[-1] ** 2) / (data_std**2 + sigmas[0] ** 2)).sqrt()
        for name in errors:
            result = get_sampler(name).sample(
                _gaussian_denoiser(data_std), x_start, sigmas, torch.zeros(num_steps)
            )
            errors[name].append(((result - exact).abs() / exact.abs()).max().item())
    dpm, euler = errors["dpmpp_2m"], errors["euler"]
    assert dpm[2] < 0.3 * dpm[1] < 0.09 * dpm[0]
    assert euler[2] > 0.4 * euler[1]
    assert dpm[2] < 0.05 * euler[2]


def test_euler_ancestral_samples_the_gaussian_data_distribution() -> None:
    """Ancestral sampling with the exact denoiser of N(0, s²) data draws from N(0, s²), up to a
    first-order discretisation error that halves as the steps double."""
    data_std, num_samples = 0.5, 20000
    errors = []
    for num_steps in (50, 200):
        generator = torch.Generator().manual_seed(0)
        timesteps, sigmas = get_sampler("euler_ancestral").schedule(
            num_steps, sdxl_alphas_cumprod(), "trailing"
        )
        sigmas = sigmas.double()
        x = torch.randn(num_samples, generator=generator, dtype=torch.float64)
        samples = sample_euler_ancestral(
            _gaussian_denoiser(data_std),
            x * (data_std**2 + sigmas[0] ** 2).sqrt(),
            sigmas,
            timesteps,
            noise=_normal_source(generator, (num_samples,), torch.float64),
        )
        errors.append(abs(samples.std().item() - data_std))
        # Without the noise (σ_up dropped) the same steps collapse the spread.
        collapsed = sample_euler_ancestral(
            _gaussian_denoiser(data_std),
            x * (data_std**2 + sigmas[0] ** 2).sqrt(),
            sigmas,
            timesteps,
            noise=lambda: torch.zeros(num_samples, dtype=torch.float64),
        )
        assert collapsed.std().item() < 0.5 * data_std
    assert errors[1] < 0.5 * errors[0] and errors[1] < 0.05 * data_std


# --- zero terminal SNR --------------------------------------------------------------------------


def _ztsnr_alphas_cumprod() -> torch.Tensor:
    objective = ObjectiveConfig(prediction_type="v_prediction", zero_terminal_snr=True)
    return training_alphas_cumprod(objective)


@pytest.mark.parametrize("sampler", NEW_SAMPLERS)
@pytest.mark.parametrize("num_steps", [1, 2, 5, 30])
def test_zero_terminal_snr_ladder_gives_finite_samples(sampler: str, num_steps: int) -> None:
    spec = get_sampler(sampler)
    timesteps, sigmas = spec.schedule(num_steps, _ztsnr_alphas_cumprod(), "trailing")
    assert sigmas[0] == 20000 and timesteps[0] == 999 and sigmas[-1] == 0
    assert torch.isfinite(sigmas).all()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=generator) * initial_noise_scale(sigmas[0])
    result = spec.sample(
        _gaussian_denoiser(0.5),
        x,
        sigmas,
        timesteps,
        noise=_normal_source(generator, (4096,)),
    )
    assert torch.isfinite(result).all()
    if num_steps == 30:  # from σ = 20000 the samples come out with about the data's spread
        assert 0.35 < result.std().item() < 0.65


@pytest.mark.parametrize("sampler", NEW_SAMPLERS)
def test_zero_terminal_snr_generation_is_finite(tiny: SDXLComponents, sampler: str) -> None:
    latents = generate_latents(
        SDXLBackbone(tiny),
        PROMPTS[:1],
        negative_prompt=NEGATIVE,
        num_steps=4,
        sampler=sampler,
        prediction_type="v_prediction",
        alphas_cumprod=_ztsnr_alphas_cumprod(),
        spacing="trailing",
        seed=5,
    )
    assert torch.isfinite(latents).all() and latents.abs().max() > 0


def test_ancestral_same_seed_same_image_and_independent_of_batch(tiny: SDXLComponents) -> None:
    kwargs = {
        "negative_prompt": NEGATIVE,
        "num_steps": 4,
        "guidance_scale": 5.0,
        "sampler": "euler_ancestral",
    }
    batch = generate_latents(SDXLBackbone(tiny), ["a green triangle", *PROMPTS], seed=10, **kwargs)
    assert torch.equal(
        batch,
        generate_latents(SDXLBackbone(tiny), ["a green triangle", *PROMPTS], seed=10, **kwargs),
    )
    # Row j, initial and step noise alike, comes from seed + j: the second image alone, seed 11.
    alone = generate_latents(SDXLBackbone(tiny), PROMPTS[:1], seed=11, **kwargs)
    assert_close(alone[0], batch[1], **LATENT_TOL)
    repeated = generate_latents(
        SDXLBackbone(tiny), PROMPTS[:1], num_images_per_prompt=2, seed=11, **kwargs
    )
    assert_close(repeated[0], alone[0], **LATENT_TOL)
    other_seed = generate_latents(SDXLBackbone(tiny), PROMPTS[:1], seed=12, **kwargs)
    assert_close(repeated[1], other_seed[0], **LATENT_TOL)
    # The step noise matters: the ancestral image is not the deterministic Euler one.
    euler = generate_latents(
        SDXLBackbone(tiny), PROMPTS[:1], seed=11, **{**kwargs, "sampler": "euler"}
    )
    assert (euler - alone).abs().max() > 1e-2
