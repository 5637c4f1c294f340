"""The objectives (issue #4): schedules, noising, targets, samplers, weightings, noise, losses.

Checked against diffusers where it has the same thing, against published or hand-computed
values, and statistically with fixed seeds (tolerances from the standard error).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDPMScheduler, EulerDiscreteScheduler
from diffusers.schedulers.scheduling_ddpm import (
    rescale_zero_terminal_snr as diffusers_rescale_zero_terminal_snr,
)
from diffusers.training_utils import (
    compute_snr,
)

from impasto.objectives import (
    DEFAULT_TERMINAL_SIGMA,
    HUBER_C_SCHEDULES,
    LOSS_WEIGHTINGS,
    LOSSES,
    PREDICTION_TARGETS,
    SCHEDULES,
    TIMESTEP_PROBABILITIES,
    TIMESTEP_SAMPLERS,
    add_noise,
    alphas_cumprod_from_betas,
    alphas_cumprod_from_sigmas,
    finite_terminal_alphas_cumprod,
    finite_terminal_sigmas,
    flow_snr,
    karras_sigmas,
    mse_loss,
    offset_noise,
    perturb_noise,
    pyramid_noise,
    rescale_zero_terminal_snr,
    scaled_linear_betas,
    sigma_to_timestep,
    sigmas_from_alphas_cumprod,
    snr_from_alphas_cumprod,
    timestep_bias_probabilities,
    timestep_to_sigma,
    training_alphas_cumprod,
    uniform_timestep_probabilities,
    uniform_timesteps,
)
from impasto.objectives.weighting import min_snr_weights

CPU = torch.device("cpu")

SDXL = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
}


def _sdxl_betas() -> torch.Tensor:
    return scaled_linear_betas(1000, 0.00085, 0.012)


def _sdxl_alphas_cumprod() -> torch.Tensor:
    return alphas_cumprod_from_betas(_sdxl_betas())


def test_sdxl_sigma_range_matches_published_values():
    sigmas = sigmas_from_alphas_cumprod(_sdxl_alphas_cumprod())
    # SDXL's k-diffusion sigma range, 0.0292 .. 14.6146 (DESIGN §5).
    assert round(sigmas[0].item(), 4) == 0.0292
    assert round(sigmas[-1].item(), 4) == 14.6146
    assert torch.all(sigmas[1:] > sigmas[:-1])


def test_schedule_matches_diffusers_schedulers():
    ours = _sdxl_alphas_cumprod()
    ddpm = DDPMScheduler(**SDXL)
    torch.testing.assert_close(ours.float(), ddpm.alphas_cumprod, rtol=1e-6, atol=1e-7)
    euler = EulerDiscreteScheduler(**SDXL)
    torch.testing.assert_close(
        sigmas_from_alphas_cumprod(ours).float().flip(0), euler.sigmas[:-1], rtol=1e-5, atol=1e-6
    )


def _x0_noise(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 4, 8, 8, generator=generator), torch.randn(
        4, 4, 8, 8, generator=generator
    )


def test_add_noise_matches_ddpm_scheduler():
    x0, noise = _x0_noise(0)
    timesteps = torch.tensor([0, 17, 500, 999])
    expected = DDPMScheduler(**SDXL).add_noise(x0, noise, timesteps)
    torch.testing.assert_close(add_noise(x0, noise, timesteps, _sdxl_alphas_cumprod()), expected)


def test_uniform_timesteps_cover_range_and_replay():
    draws = uniform_timesteps(20000, 1000, torch.Generator().manual_seed(3), torch.device("cpu"))
    again = uniform_timesteps(20000, 1000, torch.Generator().manual_seed(3), torch.device("cpu"))
    assert torch.equal(draws, again) and draws.dtype == torch.int64
    assert draws.min() == 0 and draws.max() == 999
    assert abs(draws.float().mean().item() - 499.5) < 6  # std of the mean ≈ 2.04


def test_mse_loss_is_per_sample():
    prediction = torch.zeros(2, 1, 2, 2)
    target = torch.stack([torch.ones(1, 2, 2), 2 * torch.ones(1, 2, 2)])
    assert mse_loss(prediction, target).tolist() == [1.0, 4.0]


def test_v_prediction_target_equals_diffusers_velocity():
    x0, noise = _x0_noise(1)
    timesteps = torch.tensor([0, 17, 500, 999])
    expected = DDPMScheduler(**SDXL).get_velocity(x0, noise, timesteps)
    ours = PREDICTION_TARGETS["v_prediction"](x0, noise, timesteps, _sdxl_alphas_cumprod())
    torch.testing.assert_close(ours, expected)
    assert torch.equal(PREDICTION_TARGETS["sample"](x0, noise, timesteps, None), x0)


# --- issue #4: schedules, zero terminal SNR, Karras sigmas, timestep <-> sigma ---------------


def test_cosine_schedule_matches_diffusers_squaredcos_cap_v2():
    ddpm = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    betas = SCHEDULES["cosine"](1000, 0.00085, 0.012)
    torch.testing.assert_close(betas.float(), ddpm.betas, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        alphas_cumprod_from_betas(betas).float(), ddpm.alphas_cumprod, rtol=1e-5, atol=1e-6
    )
    assert betas[-1].item() == 0.999  # capped: ᾱ(1) = cos²(π/2) ≈ 0 would give β = 1


def test_zero_terminal_snr_matches_diffusers_and_algorithm_1():
    betas = scaled_linear_betas(1000, 0.00085, 0.012)
    rescaled = rescale_zero_terminal_snr(betas)
    torch.testing.assert_close(rescaled, diffusers_rescale_zero_terminal_snr(betas.clone()))
    alphas_cumprod = alphas_cumprod_from_betas(rescaled)
    assert alphas_cumprod[-1].item() == 0.0  # terminal SNR exactly 0 (Lin et al. 2023)
    assert snr_from_alphas_cumprod(alphas_cumprod)[-1].item() == 0.0
    # The first ᾱ is unchanged and the rescaled sqrt(ᾱ) is an affine map of the old one.
    old = alphas_cumprod_from_betas(betas)
    torch.testing.assert_close(alphas_cumprod[0], old[0], rtol=1e-14, atol=0)
    first, last = old[0].sqrt(), old[-1].sqrt()
    expected = (old.sqrt() - last) * first / (first - last)
    torch.testing.assert_close(alphas_cumprod.sqrt(), expected, rtol=1e-10, atol=1e-12)


def test_finite_terminal_sigma_matches_euler_zero_snr_and_novelai_default():
    zsnr = alphas_cumprod_from_betas(rescale_zero_terminal_snr(_sdxl_betas()))
    # diffusers' Euler replaces ᾱ = 0 by 2⁻²⁴, i.e. σ = sqrt((1 − 2⁻²⁴)/2⁻²⁴) ≈ 4096.
    euler = EulerDiscreteScheduler(**SDXL, rescale_betas_zero_snr=True)
    euler_sigma = ((1 - 2**-24) / 2**-24) ** 0.5
    ours = finite_terminal_sigmas(zsnr, euler_sigma).flip(0).float()
    torch.testing.assert_close(ours, euler.sigmas[:-1], rtol=1e-4, atol=1e-6)

    sigmas = finite_terminal_sigmas(zsnr)
    assert sigmas[-1].item() == DEFAULT_TERMINAL_SIGMA == 20000.0
    assert torch.equal(sigmas[:-1], sigmas_from_alphas_cumprod(zsnr)[:-1])
    finite = finite_terminal_alphas_cumprod(zsnr)
    assert finite[-1].item() == 1 / (20000.0**2 + 1)
    assert torch.equal(finite[:-1], zsnr[:-1])
    torch.testing.assert_close(alphas_cumprod_from_sigmas(sigmas), finite, rtol=1e-12, atol=0)
    # A schedule without an infinite σ is left alone.
    plain = _sdxl_alphas_cumprod()
    assert torch.equal(finite_terminal_alphas_cumprod(plain), plain)


def test_training_alphas_cumprod_reads_optional_zero_terminal_snr():
    fields = {"schedule": "scaled_linear", "num_train_timesteps": 1000}
    fields |= {"beta_start": 0.00085, "beta_end": 0.012}
    old_config = SimpleNamespace(**fields, prediction_type="epsilon")
    assert torch.equal(training_alphas_cumprod(old_config), _sdxl_alphas_cumprod())

    zsnr = SimpleNamespace(**fields, prediction_type="v_prediction", zero_terminal_snr=True)
    alphas_cumprod = training_alphas_cumprod(zsnr)
    assert alphas_cumprod[-1].item() == 1 / (20000.0**2 + 1)
    assert sigmas_from_alphas_cumprod(alphas_cumprod)[-1].item() == pytest.approx(20000.0)
    zsnr.terminal_sigma = 4096.0
    assert training_alphas_cumprod(zsnr)[-1].item() == 1 / (4096.0**2 + 1)
    with pytest.raises(ValueError, match="v_prediction"):
        training_alphas_cumprod(
            SimpleNamespace(**fields, zero_terminal_snr=True, prediction_type="epsilon")
        )


def test_karras_sigmas_and_sigma_to_timestep_match_euler():
    alphas_cumprod = _sdxl_alphas_cumprod()
    sigmas_train = sigmas_from_alphas_cumprod(alphas_cumprod)
    euler = EulerDiscreteScheduler(**SDXL, use_karras_sigmas=True, timestep_spacing="linspace")
    euler.set_timesteps(25)
    sigmas = karras_sigmas(sigmas_train[0].item(), sigmas_train[-1].item(), 25)
    torch.testing.assert_close(sigmas.float(), euler.sigmas[:-1], rtol=1e-4, atol=0)
    # diffusers works from float32 ᾱ; 1e-3 of a timestep is well below any real difference.
    timesteps = sigma_to_timestep(euler.sigmas[:-1], alphas_cumprod)
    torch.testing.assert_close(timesteps.float(), euler.timesteps, rtol=0, atol=1e-3)
    # Karras' published form at ρ = 7: the ends are σ_max and σ_min.
    assert sigmas[0].item() == pytest.approx(14.6146, abs=1e-4)
    assert sigmas[-1].item() == pytest.approx(0.0292, abs=1e-4)


def test_timestep_to_sigma_inverts_sigma_to_timestep():
    alphas_cumprod = _sdxl_alphas_cumprod()
    sigmas_train = sigmas_from_alphas_cumprod(alphas_cumprod)
    integers = torch.arange(1000, dtype=torch.float64)
    torch.testing.assert_close(timestep_to_sigma(integers, alphas_cumprod), sigmas_train)
    torch.testing.assert_close(sigma_to_timestep(sigmas_train, alphas_cumprod), integers)
    fractional = torch.tensor([0.25, 17.5, 500.3, 998.9], dtype=torch.float64)
    round_trip = sigma_to_timestep(timestep_to_sigma(fractional, alphas_cumprod), alphas_cumprod)
    torch.testing.assert_close(round_trip, fractional)
    # Log-σ interpolation: the midpoint of two steps is their geometric mean.
    midpoint = timestep_to_sigma(torch.tensor([17.5], dtype=torch.float64), alphas_cumprod)
    torch.testing.assert_close(midpoint[0], (sigmas_train[17] * sigmas_train[18]).sqrt())


# --- integer timestep sampling -----------------------------------------------------------------


def test_uniform_timesteps_window_and_default_draws_unchanged():
    default = uniform_timesteps(64, 1000, torch.Generator().manual_seed(4), CPU)
    expected = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(default, expected)  # runs seeded before issue #4 replay

    draws = TIMESTEP_SAMPLERS["uniform"](
        40_000, 1000, torch.Generator().manual_seed(4), CPU, min_timestep=200, max_timestep=400
    )
    assert draws.min() == 200 and draws.max() == 399
    # U{200..399}: mean 299.5, std sqrt((200² − 1)/12) ≈ 57.7, SE of the mean ≈ 0.29.
    assert abs(draws.float().mean().item() - 299.5) < 5 * 57.7 / math.sqrt(40_000)
    probabilities = TIMESTEP_PROBABILITIES["uniform"](1000, min_timestep=200, max_timestep=400)
    assert probabilities.sum().item() == pytest.approx(1.0)
    assert probabilities[199] == 0 and probabilities[400] == 0 and probabilities[200] == 1 / 200
    with pytest.raises(ValueError):
        uniform_timestep_probabilities(1000, min_timestep=500, max_timestep=500)


def test_timestep_bias_probabilities_concrete_examples():
    thirteenth, sixteenth = 1 / 13, 1 / 16
    later = timestep_bias_probabilities(10, strategy="later", multiplier=2.0, portion=0.3)
    torch.testing.assert_close(
        later, torch.tensor([thirteenth] * 7 + [2 * thirteenth] * 3, dtype=torch.float64)
    )
    earlier = timestep_bias_probabilities(10, strategy="earlier", multiplier=2.0, portion=0.3)
    torch.testing.assert_close(earlier, later.flip(0))
    ranged = timestep_bias_probabilities(10, strategy="range", multiplier=3.0, begin=2, end=5)
    expected = torch.tensor([1, 1, 3, 3, 3, 1, 1, 1, 1, 1], dtype=torch.float64) * sixteenth
    torch.testing.assert_close(ranged, expected)  # end is exclusive
    none = timestep_bias_probabilities(10, strategy="none", multiplier=5.0)
    torch.testing.assert_close(none, torch.full((10,), 0.1, dtype=torch.float64))
    # diffusers' defaults on SDXL's 1000 steps, later ×2 on the last quarter.
    sdxl = timestep_bias_probabilities(1000, strategy="later", multiplier=2.0, portion=0.25)
    torch.testing.assert_close(
        sdxl[749:751], torch.tensor([1 / 1250, 2 / 1250], dtype=torch.float64)
    )


def test_timestep_bias_rejects_bad_settings():
    with pytest.raises(ValueError, match="multiplier"):
        timestep_bias_probabilities(1000, strategy="later", multiplier=0.0)
    with pytest.raises(ValueError, match="multiplier"):
        timestep_bias_probabilities(1000, strategy="range", multiplier=-1.0)
    with pytest.raises(ValueError, match="earlier, later, none, range"):
        timestep_bias_probabilities(1000, strategy="sooner")
    with pytest.raises(ValueError, match="begin"):
        timestep_bias_probabilities(1000, strategy="range", multiplier=2.0, begin=10, end=1001)
    with pytest.raises(ValueError, match="portion"):
        timestep_bias_probabilities(1000, strategy="later", multiplier=2.0, portion=0.0)


def test_timestep_bias_sampler_draws_its_probabilities():
    params = {"strategy": "range", "multiplier": 3.0, "begin": 2, "end": 5}
    num_draws = 100_000
    draws = TIMESTEP_SAMPLERS["timestep_bias"](
        num_draws, 10, torch.Generator().manual_seed(6), CPU, **params
    )
    assert draws.dtype == torch.int64
    frequencies = torch.bincount(draws, minlength=10).double() / num_draws
    expected = TIMESTEP_PROBABILITIES["timestep_bias"](10, **params)
    standard_error = (expected * (1 - expected) / num_draws).sqrt()
    assert torch.all((frequencies - expected).abs() < 5 * standard_error)


# --- loss weighting ----------------------------------------------------------------------------

SNRS = torch.tensor([0.0, 0.5, 5.0, 20.0], dtype=torch.float64)


def test_min_snr_weights_at_gamma_5_by_hand():
    weights = {
        p: LOSS_WEIGHTINGS["min_snr"](SNRS, p, gamma=5.0)
        for p in ("epsilon", "v_prediction", "sample")
    }
    # ε: min(SNR, 5)/SNR (limit 1 at SNR = 0); v: min(SNR, 5)/(SNR + 1); x0: min(SNR, 5).
    torch.testing.assert_close(weights["epsilon"], torch.tensor([1.0, 1.0, 1.0, 0.25]))
    torch.testing.assert_close(weights["v_prediction"], torch.tensor([0.0, 1 / 3, 5 / 6, 5 / 21]))
    torch.testing.assert_close(weights["sample"], torch.tensor([0.0, 0.5, 5.0, 5.0]))
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_min_snr_weights_match_diffusers_snr_and_training_script():
    timesteps = torch.tensor([0, 17, 250, 500, 999])
    snr = snr_from_alphas_cumprod(_sdxl_alphas_cumprod())[timesteps]
    diffusers_snr = compute_snr(DDPMScheduler(**SDXL), timesteps)
    # diffusers' float32 1 − ᾱ loses ~3e-5 relative at t = 0 (ᾱ ≈ 0.99915); ours is float64.
    torch.testing.assert_close(snr.float(), diffusers_snr, rtol=5e-5, atol=0)
    # diffusers train_text_to_image_sdxl.py: stack([snr, γ]).min / snr (ε) or / (snr + 1) (v).
    clipped = torch.stack([diffusers_snr, torch.full_like(diffusers_snr, 5.0)]).min(dim=0).values
    for prediction_type, scale in (("epsilon", 0.0), ("v_prediction", 1.0)):
        expected = clipped / (diffusers_snr + scale)
        ours = min_snr_weights(snr, prediction_type)
        torch.testing.assert_close(ours, expected, rtol=5e-5, atol=0)


def test_debiased_and_p2_weights_by_hand():
    snr = torch.tensor([0.0, 4.0, 4000.0], dtype=torch.float64)
    debiased = {
        p: LOSS_WEIGHTINGS["debiased"](snr, p) for p in ("epsilon", "v_prediction", "sample")
    }
    # ε: 1/sqrt(min(SNR, 1000)) (kohya); same x0 weighting sqrt(SNR) on v and x0 below the clamp.
    torch.testing.assert_close(debiased["epsilon"][1:], torch.tensor([0.5, 1 / math.sqrt(1000)]))
    assert debiased["epsilon"][0].item() == math.inf
    torch.testing.assert_close(debiased["v_prediction"][:2], torch.tensor([0.0, 2 / 5]))
    torch.testing.assert_close(debiased["sample"][:2], torch.tensor([0.0, 2.0]))
    p2 = {p: LOSS_WEIGHTINGS["p2"](snr[:2], p, gamma=1.0) for p in ("epsilon", "v_prediction")}
    torch.testing.assert_close(p2["epsilon"], torch.tensor([1.0, 0.2]))  # 1/(1 + SNR)
    torch.testing.assert_close(p2["v_prediction"], torch.tensor([0.0, 4 / 25]))
    torch.testing.assert_close(
        LOSS_WEIGHTINGS["p2"](snr[1:2], "epsilon", gamma=0.5), torch.tensor([1 / math.sqrt(5)])
    )
    torch.testing.assert_close(LOSS_WEIGHTINGS["none"](snr, "v_prediction"), torch.ones(3))


def test_weightings_put_the_same_weight_on_the_x0_error_for_every_prediction_type():
    t = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.97], dtype=torch.float64)
    snr = flow_snr(t)
    # ||pred error||² = λ·||x0 error||²: ε SNR, v SNR + 1, x0 1, flow 1/t².
    scales = {
        "epsilon": snr,
        "v_prediction": snr + 1,
        "sample": torch.ones_like(snr),
        "flow": t**-2,
    }
    for name, params in [("min_snr", {"gamma": 5.0}), ("debiased", {}), ("p2", {"gamma": 0.5})]:
        x0_weights = {
            p: LOSS_WEIGHTINGS[name](snr, p, **params).double() * scale
            for p, scale in scales.items()
        }
        for prediction_type, values in x0_weights.items():
            torch.testing.assert_close(
                values, x0_weights["sample"], rtol=1e-6, atol=0, msg=f"{name} {prediction_type}"
            )
    assert min_snr_weights(torch.tensor([1.0]), "flow").item() == pytest.approx(0.25)  # (1 − ½)²
    with pytest.raises(ValueError, match="epsilon, flow, sample, v_prediction"):
        min_snr_weights(snr, "velocity")


# --- noise tricks ------------------------------------------------------------------------------


def test_offset_noise_adds_a_per_channel_constant_of_std_k():
    batch, channels, k = 4096, 4, 0.5
    base = torch.zeros(batch, channels, 8, 8)
    noisy = offset_noise(base, k, torch.Generator().manual_seed(7))
    assert torch.equal(base, torch.zeros_like(base))  # input untouched
    assert noisy.std(dim=(2, 3)).max().item() == 0.0  # constant over H, W
    offsets = noisy[:, :, 0, 0].flatten().double()
    # Var of k·N(0,1) is k²; SE of the sample variance of n normals is k²·sqrt(2/(n − 1)).
    n = offsets.numel()
    assert abs(offsets.var().item() - k**2) < 5 * k**2 * math.sqrt(2 / (n - 1))
    random_strength = offset_noise(base, k, torch.Generator().manual_seed(7), random_strength=True)
    squares = (random_strength[:, :, 0, 0].double() ** 2).mean(dim=1)  # per sample: U²·mean(n²)
    # E[(kU·n)²] = k²/3; per-sample SD of U²·mean of 4 n² is k²·sqrt(0.2·1.5 − 1/9) ≈ 0.435k².
    assert abs(squares.mean().item() - k**2 / 3) < 5 * 0.435 * k**2 / math.sqrt(batch)


def test_input_perturbation_adds_gamma_scaled_noise_and_keeps_the_input():
    batch, gamma = 4096, 0.1
    noise = torch.randn(batch, 4, 8, 8, generator=torch.Generator().manual_seed(8))
    perturbed = perturb_noise(noise, gamma, torch.Generator().manual_seed(9))
    difference = (perturbed - noise).double()
    n = difference.numel()
    assert abs(difference.var().item() - gamma**2) < 5 * gamma**2 * math.sqrt(2 / (n - 1))
    covariance = (difference * noise.double()).mean().item()  # ξ independent of ε: SE γ/sqrt(n)
    assert abs(covariance) < 5 * gamma / math.sqrt(n)
    random_strength = perturb_noise(
        noise, gamma, torch.Generator().manual_seed(9), random_strength=True
    )
    per_sample = ((random_strength - noise).double() ** 2).flatten(1).mean(dim=1)  # ≈ γ²U²
    # E[γ²U²] = γ²/3, SD of U² is sqrt(1/5 − 1/9) ≈ 0.298.
    assert abs(per_sample.mean().item() - gamma**2 / 3) < 5 * 0.3 * gamma**2 / math.sqrt(batch)


def test_pyramid_noise_is_unit_std_per_sample_and_spatially_correlated():
    base = torch.randn(64, 4, 32, 32, generator=torch.Generator().manual_seed(10))
    pyramid = pyramid_noise(base, torch.Generator().manual_seed(11), iterations=6, discount=0.3)
    again = pyramid_noise(base, torch.Generator().manual_seed(11), iterations=6, discount=0.3)
    assert torch.equal(pyramid, again)
    torch.testing.assert_close(pyramid.flatten(1).std(dim=1), torch.ones(64))

    def neighbour_correlation(x: torch.Tensor) -> float:
        x = (x - x.mean()) / x.std()
        return (x[..., :, :-1] * x[..., :, 1:]).mean().item()

    num_pairs = 64 * 4 * 32 * 31
    # White noise: correlation ≈ 0 with SE 1/sqrt(pairs) ≈ 0.002; the coarse levels add ≈ 0.03.
    assert neighbour_correlation(pyramid) > 10 / math.sqrt(num_pairs)
    white = pyramid_noise(base, torch.Generator().manual_seed(11), iterations=6, discount=0.0)
    assert abs(neighbour_correlation(white)) < 5 / math.sqrt(num_pairs)


# --- losses ------------------------------------------------------------------------------------


def _per_element(errors: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.tensor(errors).view(-1, 1, 1, 1)
    return torch.zeros_like(target), target


def test_l1_huber_and_pseudo_huber_by_hand():
    prediction, target = _per_element([0.05, 0.5, -2.0])
    torch.testing.assert_close(LOSSES["l1"](prediction, target), torch.tensor([0.05, 0.5, 2.0]))
    # Huber scaled to d² below c = 0.1, 2c|d| − c² above.
    huber = LOSSES["huber"](prediction, target, huber_c=0.1)
    torch.testing.assert_close(huber, torch.tensor([0.0025, 0.09, 0.39]))
    reference = 2 * torch.nn.functional.huber_loss(prediction, target, delta=0.1, reduction="none")
    torch.testing.assert_close(huber, reference.flatten())
    # Pseudo-Huber 2c(sqrt(d² + c²) − c), kohya's "huber".
    pseudo = LOSSES["pseudo_huber"](prediction, target, huber_c=0.1)
    torch.testing.assert_close(pseudo, torch.tensor([0.00236068, 0.08198039, 0.38049969]))
    per_sample_c = LOSSES["pseudo_huber"](prediction, target, huber_c=torch.tensor([0.1, 1.0, 0.1]))
    assert per_sample_c[1].item() == pytest.approx(2 * (math.sqrt(1.25) - 1))
    with pytest.raises(ValueError, match="huber_c"):
        LOSSES["huber"](prediction, target)


def test_masked_loss_is_the_mean_over_the_mask():
    prediction = torch.zeros(2, 2, 2, 2, requires_grad=True)
    target = torch.arange(16, dtype=torch.float32).view(2, 2, 2, 2)
    mask = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]]], [[[0.0, 0.0], [0.0, 0.0]]]])
    loss = mse_loss(prediction, target, mask=mask)
    # Sample 0: pixel (0, 0) of channels 0 and 1: (0² + 4²)/2 = 8; sample 1: empty mask → 0.
    torch.testing.assert_close(loss, torch.tensor([8.0, 0.0]))
    loss.sum().backward()
    assert torch.isfinite(prediction.grad).all() and prediction.grad[1].abs().sum() == 0
    # A weighted mean: scaling the mask changes nothing, even when it sums to less than 1.
    soft = torch.full((2, 1, 2, 2), 0.5)
    torch.testing.assert_close(
        LOSSES["l1"](prediction, target, mask=soft), LOSSES["l1"](prediction, target)
    )
    torch.testing.assert_close(mse_loss(prediction, target, mask=0.1 * mask), loss)
    with pytest.raises(ValueError, match="mask"):
        mse_loss(prediction, target, mask=torch.ones(2, 2, 2, 2))


def test_huber_c_schedules_by_hand():
    fraction = torch.tensor([0, 500, 999]) / 1000
    sigma = torch.tensor([0.0, 1.0, 2.0])
    torch.testing.assert_close(
        HUBER_C_SCHEDULES["constant"](fraction, sigma, 0.1), torch.full((3,), 0.1)
    )
    # kohya exponential: exp(−αt), α = −ln(c)/T, so c^{t/T}: 1 at t = 0, sqrt(c) at T/2.
    exponential = HUBER_C_SCHEDULES["exponential"](fraction, sigma, 0.1)
    torch.testing.assert_close(exponential, torch.tensor([1.0, 0.1**0.5, 0.1**0.999]))
    # kohya snr: (1 − c)/(1 + σ)² + c.
    snr = HUBER_C_SCHEDULES["snr"](fraction, sigma, 0.1)
    torch.testing.assert_close(snr, torch.tensor([1.0, 0.9 / 4 + 0.1, 0.9 / 9 + 0.1]))
