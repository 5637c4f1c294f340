"""Flow matching (rectified flow, SD3 convention) end to end (issue #4): the math against
diffusers' FlowMatchEulerDiscreteScheduler and SD3 training utilities, the training objective,
the sampling ladder and the Euler loop.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import (
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

import impasto
from impasto.config.schema import ObjectiveConfig
from impasto.models import SDXLComponents
from impasto.models.sdxl import SDXLBackbone
from impasto.objectives import (
    FLOW_LOSS_WEIGHTINGS,
    FLOW_TIME_DENSITIES,
    FLOW_TIME_SAMPLERS,
    add_flow_noise,
    cosmap_density,
    flow_snr,
    flow_target,
    flow_unet_timesteps,
    logit_normal_density,
    mode_density,
    shift_flow_times,
    shift_for_size,
    shifted_flow_density,
    unshift_flow_times,
)
from impasto.objectives.objective import Objective
from impasto.sampling import (
    generate_latents,
    initial_noise,
    sample_euler,
)
from impasto.sampling.flow import flow_denoiser, flow_timesteps
from impasto.train.checks import check_objective

CPU = torch.device("cpu")


def test_flow_shift_noising_and_unet_time_match_flow_match_euler():
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    unshifted = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(shift_flow_times(unshifted, 3.0), scheduler.sigmas)
    torch.testing.assert_close(flow_unet_timesteps(scheduler.sigmas), scheduler.timesteps)
    assert shift_flow_times(torch.tensor([0.5]), 3.0).item() == pytest.approx(0.75)

    generator = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 4, 8, 8, generator=generator)
    noise = torch.randn(4, 4, 8, 8, generator=generator)
    index = torch.tensor([0, 100, 500, 999])
    expected = scheduler.scale_noise(x0, scheduler.timesteps[index], noise)
    noisy = add_flow_noise(x0, noise, scheduler.sigmas[index])
    torch.testing.assert_close(noisy, expected)
    # The target is the velocity: x0 = x_t − t·(ε − x0).
    t = scheduler.sigmas[index].view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy - t * flow_target(x0, noise), x0, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        shift_flow_times(unshifted, 0.0)


def test_flow_snr():
    t = torch.tensor([0.5, 0.2, 1.0])
    torch.testing.assert_close(flow_snr(t), torch.tensor([1.0, 16.0, 0.0]))


def test_flow_time_samplers_draw_as_diffusers():
    cases = [
        ("logit_normal", {"mean": 0.0, "std": 1.0}, {"logit_mean": 0.0, "logit_std": 1.0}),
        ("logit_normal", {"mean": 0.5, "std": 1.3}, {"logit_mean": 0.5, "logit_std": 1.3}),
        ("mode", {"scale": 1.29}, {"mode_scale": 1.29}),
    ]
    for name, params, diffusers_params in cases:
        generator = torch.Generator().manual_seed(5)
        expected = compute_density_for_timestep_sampling(
            name, 4096, generator=generator, **diffusers_params
        )
        ours = FLOW_TIME_SAMPLERS[name](4096, torch.Generator().manual_seed(5), CPU, **params)
        torch.testing.assert_close(ours, expected)


def test_flow_time_densities_closed_form_and_normalised():
    half = torch.tensor([0.5], dtype=torch.float64)
    # Logit-normal (0, 1) at t = ½: 1/sqrt(2π) · 1/(½·½) = 4/sqrt(2π).
    assert logit_normal_density(half).item() == pytest.approx(4 / math.sqrt(2 * math.pi))
    t, mean, std = 0.25, 0.5, 1.3
    closed = math.exp(-((math.log(t / (1 - t)) - mean) ** 2) / (2 * std**2)) / (
        std * math.sqrt(2 * math.pi) * t * (1 - t)
    )
    value = logit_normal_density(torch.tensor([t], dtype=torch.float64), mean=mean, std=std)
    assert value.item() == pytest.approx(closed, rel=1e-12)
    # Mode: f(½) = ½ for any s, and there π = 1/|f'(½)| = 1/(1 + s − sπ/2).
    assert mode_density(half, scale=1.29).item() == pytest.approx(
        1 / (1 + 1.29 - 1.29 * math.pi / 2)
    )
    inner = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    torch.testing.assert_close(mode_density(inner, scale=0.0), torch.ones_like(inner))  # s = 0: U
    # Cosmap: π(t) = 2/(π(1 − 2t + 2t²)) = 4/π at t = ½.
    assert cosmap_density(half).item() == pytest.approx(4 / math.pi)
    grid = torch.linspace(0, 1, 200_001, dtype=torch.float64)
    for name, params in [
        ("uniform", {}),
        ("logit_normal", {}),
        ("logit_normal", {"mean": 1.0, "std": 0.5}),
        ("mode", {"scale": 1.29}),
        ("mode", {"scale": -0.5}),
        ("cosmap", {}),
    ]:
        area = torch.trapezoid(FLOW_TIME_DENSITIES[name](grid, **params), grid).item()
        assert area == pytest.approx(1.0, abs=1e-6), (name, params)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("uniform", {}),
        ("logit_normal", {"mean": 0.3, "std": 0.8}),
        ("mode", {"scale": 1.29}),
        ("cosmap", {}),
    ],
)
def test_flow_time_samplers_follow_their_densities(name, params):
    num_draws = 100_000
    t = FLOW_TIME_SAMPLERS[name](num_draws, torch.Generator().manual_seed(11), CPU, **params)
    assert t.dtype == torch.float32 and t.min() > 0 and t.max() <= 1
    grid = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    cdf = torch.cumulative_trapezoid(FLOW_TIME_DENSITIES[name](grid, **params), grid)
    for point in (0.1, 0.3, 0.5, 0.7, 0.9):
        expected = cdf[int(point * 100_000) - 1].item()
        empirical = (t.double() <= point).double().mean().item()
        # Binomial standard error of an empirical CDF value; 5 SE, plus quadrature error.
        tolerance = 5 * math.sqrt(expected * (1 - expected) / num_draws) + 1e-5
        assert abs(empirical - expected) < tolerance, (point, empirical, expected)


def test_mode_scale_outside_monotone_range_raises():
    with pytest.raises(ValueError, match="mode scale"):
        FLOW_TIME_SAMPLERS["mode"](4, torch.Generator(), CPU, scale=1.8)
    with pytest.raises(ValueError, match="mode scale"):
        mode_density(torch.tensor([0.5]), scale=-1.1)


def test_flow_loss_weightings_match_diffusers_sd3():
    t = torch.tensor([0.01, 0.2, 0.5, 0.9, 1.0])
    for name in ("sigma_sqrt", "cosmap", "none"):
        torch.testing.assert_close(
            FLOW_LOSS_WEIGHTINGS[name](t), compute_loss_weighting_for_sd3(name, t)
        )
    torch.testing.assert_close(
        FLOW_LOSS_WEIGHTINGS["sigma_sqrt"](torch.tensor([0.5])), torch.tensor([4.0])
    )


# --- shift ---------------------------------------------------------------------------------------


def test_shifts_compose_by_multiplying_and_scale_with_the_image_side():
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    torch.testing.assert_close(
        shift_flow_times(shift_flow_times(t, 2.0), 1.5), shift_flow_times(t, 3.0)
    )
    torch.testing.assert_close(unshift_flow_times(shift_flow_times(t, 3.0), 3.0), t)
    assert shift_for_size(3.0, 1024, 1024, 1024) == 3.0
    assert shift_for_size(3.0, 512, 512, 1024) == 1.5
    assert shift_for_size(3.0, 768, 1344, 1024) == pytest.approx(3.0 * math.sqrt(768 * 1344) / 1024)
    assert shift_for_size(3.0, 64, 64, None) == 3.0


@pytest.mark.parametrize(
    ("name", "params"), [("uniform", {}), ("logit_normal", {"mean": 0.0, "std": 1.0})]
)
def test_shifted_density_is_normalised_and_follows_the_shifted_draws(name, params):
    shift, num_draws = 3.0, 100_000
    grid = torch.linspace(0, 1, 200_001, dtype=torch.float64)
    density = shifted_flow_density(FLOW_TIME_DENSITIES[name], grid, shift, **params)
    assert torch.trapezoid(density, grid).item() == pytest.approx(1.0, abs=1e-6)
    u = FLOW_TIME_SAMPLERS[name](num_draws, torch.Generator().manual_seed(3), CPU, **params)
    t = shift_flow_times(u, shift).double()
    cdf = torch.cumulative_trapezoid(density, grid)
    for point in (0.2, 0.5, 0.75, 0.9):
        expected = cdf[int(point * 200_000) - 1].item()
        empirical = (t <= point).double().mean().item()
        assert (
            abs(empirical - expected) < 5 * math.sqrt(expected * (1 - expected) / num_draws) + 1e-5
        )
    # Uniform u shifted by 3: P(t <= ½) = P(u <= 1/4) = 1/4.
    if name == "uniform":
        assert cdf[100_000 - 1].item() == pytest.approx(0.25, abs=1e-6)


# --- the training objective --------------------------------------------------------------------


def test_flow_objective_draws_like_the_sd3_script_and_noises_to_the_velocity():
    config = ObjectiveConfig(
        prediction_type="flow", timestep_sampling="logit_normal", flow_shift=3.0
    )
    objective = Objective.from_config(config)
    times = objective.sample_times(512, torch.Generator().manual_seed(9), CPU)
    u = compute_density_for_timestep_sampling(
        "logit_normal",
        512,
        logit_mean=0.0,
        logit_std=1.0,
        generator=torch.Generator().manual_seed(9),
    )
    torch.testing.assert_close(times, 3.0 * u / (1 + 2.0 * u))
    generator = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 4, 4, 8, 8, generator=generator)
    t = torch.tensor([0.1, 0.5, 0.9, 1.0])
    x_t, target, unet_timesteps = objective.noised(x0, noise, noise, t)
    scheduler = FlowMatchEulerDiscreteScheduler()
    torch.testing.assert_close(x_t, scheduler.scale_noise(x0, t * 1000, noise))
    torch.testing.assert_close(target, noise - x0)
    torch.testing.assert_close(unet_timesteps, t * 1000)


def test_flow_shift_follows_the_image_size():
    config = ObjectiveConfig(prediction_type="flow", flow_shift=3.0, flow_shift_resolution=1024)
    objective = Objective.from_config(config)
    draw = lambda size: objective.sample_times(64, torch.Generator().manual_seed(2), CPU, size)  # noqa: E731
    u = FLOW_TIME_SAMPLERS["uniform"](64, torch.Generator().manual_seed(2), CPU)
    torch.testing.assert_close(draw((1024, 1024)), shift_flow_times(u, 3.0))
    torch.testing.assert_close(draw((512, 512)), shift_flow_times(u, 1.5))
    with pytest.raises(ValueError, match="image size"):
        objective.sample_times(4, torch.Generator(), CPU)


def test_flow_loss_weights_by_hand():
    generator = torch.Generator().manual_seed(4)
    prediction, target = torch.randn(2, 4, 4, 8, 8, generator=generator)
    t = torch.tensor([0.1, 0.4, 0.6, 0.95])
    mse = ((prediction - target) ** 2).flatten(1).mean(1)

    def loss(**options):
        objective = Objective.from_config(ObjectiveConfig(prediction_type="flow", **options))
        return objective.per_sample_loss(prediction, target, t)

    torch.testing.assert_close(loss(), mse)
    torch.testing.assert_close(
        loss(loss_weighting="sigma_sqrt"), mse * compute_loss_weighting_for_sd3("sigma_sqrt", t)
    )
    torch.testing.assert_close(loss(loss_weighting="cosmap"), mse * cosmap_density(t))
    # Min-SNR-5 on the x0 error; flow's loss is the x0 error / t², so w = min(SNR, 5)·t².
    snr = ((1 - t) / t) ** 2
    torch.testing.assert_close(
        loss(loss_weighting="min_snr"), mse * torch.minimum(snr, torch.tensor(5.0)) * t**2
    )
    # Huber "snr" schedule with σ = t/(1 − t): c(t) = (1 − c)/(1 + σ)² + c = (1 − c)(1 − t)² + c.
    c = 0.9 * (1 - t) ** 2 + 0.1
    d = prediction - target
    expected = (
        (
            2
            * c.view(-1, 1, 1, 1)
            * (torch.sqrt(d**2 + c.view(-1, 1, 1, 1) ** 2) - c.view(-1, 1, 1, 1))
        )
        .flatten(1)
        .mean(1)
    )
    torch.testing.assert_close(loss(loss="pseudo_huber"), expected)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"timestep_sampling": "timestep_bias"},
            "timestep_sampling: unknown name 'timestep_bias' for prediction_type flow",
        ),
        ({"min_timestep": 10}, "min_timestep applies to DDPM objectives"),
        ({"zero_terminal_snr": True}, "zero_terminal_snr needs prediction_type: v_prediction"),
        ({"timestep_sampling": "mode", "mode_scale": 2.0}, "mode scale must be in"),
    ],
)
def test_bad_flow_configs_fail_at_load(options, message):
    with pytest.raises(ValueError, match=message):
        check_objective(ObjectiveConfig(prediction_type="flow", **options))


def test_flow_options_need_a_flow_objective():
    with pytest.raises(ValueError, match="flow_shift applies to flow only"):
        ObjectiveConfig(prediction_type="v_prediction", flow_shift=3.0)
    with pytest.raises(
        ValueError, match="loss_weighting: unknown name 'sigma_sqrt' for prediction_type epsilon"
    ):
        check_objective(ObjectiveConfig(loss_weighting="sigma_sqrt"))
    dumped = ObjectiveConfig(prediction_type="flow", flow_shift=3.0).model_dump()
    assert ObjectiveConfig(**dumped).flow_shift == 3.0  # a stored (fully dumped) config reloads


# --- sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shift", "num_steps"), [(1.0, 1), (1.0, 30), (3.0, 4), (3.0, 28)])
def test_flow_ladder_equals_flow_match_euler_bit_for_bit(shift, num_steps):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    timesteps, ts = flow_timesteps(num_steps, shift)
    assert torch.equal(timesteps, scheduler.timesteps) and torch.equal(ts, scheduler.sigmas)


def test_flow_euler_loop_equals_flow_match_euler_scheduler():
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(6)) * 0.3

    def velocity_model(x, timestep, cond):  # a toy velocity field, nonlinear in x and t
        return torch.einsum("oc,bchw->bohw", weight, torch.tanh(x)) * (timestep / 1000) + cond * x

    cond = torch.tensor(0.7)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(7))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(12)
    expected = x.clone()
    for timestep in scheduler.timesteps:
        expected = scheduler.step(
            velocity_model(expected, timestep, cond), timestep, expected
        ).prev_sample
    timesteps, ts = flow_timesteps(12, 3.0)
    ours = sample_euler(flow_denoiser(velocity_model, cond), x.clone(), ts, timesteps)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_flow_euler_transports_a_point_mass_exactly():
    # Data = the point x0*: the exact velocity is (x − x0*)/t, and Euler lands on x0* exactly.
    target = torch.full((1, 4, 8, 8), 0.25)
    denoise = flow_denoiser(lambda x, timestep, cond: (x - target) / (timestep / 1000), None)
    timesteps, ts = flow_timesteps(5, 3.0)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(sample_euler(denoise, x, ts, timesteps), target)


def test_generate_on_a_flow_model_equals_a_flow_match_euler_loop(tiny: SDXLComponents):
    prompts, negative, guidance, shift = ["a red circle", "a blue square"], "blurry", 4.5, 3.0
    latents = generate_latents(
        SDXLBackbone(tiny),
        prompts,
        negative_prompt=negative,
        num_steps=6,
        guidance_scale=guidance,
        prediction_type="flow",
        flow_shift=1.5,
        flow_shift_resolution=32,  # 64x64 images: shift 1.5 * 64/32 = 3
        seed=3,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(6)
    cond = SDXLBackbone(tiny).sampling_condition(prompts, 64, 64)
    both = SDXLBackbone(tiny).sampling_condition([negative] * 2, 64, 64).cat(cond)
    x = initial_noise(2, SDXLBackbone(tiny).latent_shape(64, 64), seed=3)
    with torch.no_grad():
        for timestep in scheduler.timesteps:
            output = tiny.unet(
                torch.cat([x, x]),
                timestep,
                encoder_hidden_states=both.prompt_embeds,
                added_cond_kwargs={
                    "text_embeds": both.pooled_prompt_embeds,
                    "time_ids": both.time_ids,
                },
            ).sample
            uncond, conditional = output.chunk(2)
            velocity = uncond + guidance * (conditional - uncond)
            x = scheduler.step(velocity, timestep, x).prev_sample
    torch.testing.assert_close(latents, x, rtol=1e-4, atol=1e-5)


def test_flow_models_refuse_the_ve_samplers(tiny: SDXLComponents, tiny_raw):
    with pytest.raises(ValueError, match="cannot sample a flow model"):
        generate_latents(
            SDXLBackbone(tiny), ["a"], prediction_type="flow", sampler="dpmpp_2m", num_steps=2
        )
    tiny_raw["objective"] = {"prediction_type": "flow"}
    tiny_raw["sample"] = {"sampler": "ddim"}
    with pytest.raises(ValueError, match="sample.sampler: 'ddim' cannot sample a flow model"):
        impasto.build_config(tiny_raw)
