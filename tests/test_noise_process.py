"""The noise-process registries: one process per kind, picked by prediction type (issue #13)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from impasto.config.schema import ObjectiveConfig
from impasto.objectives import (
    NOISE_PROCESSES,
    PREDICTION_TARGETS,
    PROCESS_KINDS,
    FlowProcess,
    VPProcess,
    process_kind,
    training_alphas_cumprod,
)
from impasto.objectives.objective import Objective
from impasto.sampling import (
    SAMPLING_PROCESSES,
    SamplingRequest,
    sample_ddim,
    sample_euler,
    sampling_plan,
    sdxl_alphas_cumprod,
)
from impasto.sampling.denoisers import vp_denoiser
from impasto.sampling.flow import flow_denoiser

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("prediction_type", "kind", "process_class"),
    [
        ("epsilon", "vp", VPProcess),
        ("v_prediction", "vp", VPProcess),
        ("sample", "vp", VPProcess),
        ("flow", "flow", FlowProcess),
    ],
)
def test_each_prediction_type_resolves_to_its_process(prediction_type, kind, process_class):
    assert process_kind(prediction_type) == kind
    objective = Objective.from_config(ObjectiveConfig(prediction_type=prediction_type))
    assert type(objective.process) is process_class is NOISE_PROCESSES[kind]


def test_the_training_and_sampling_registries_have_the_same_kinds():
    assert set(PROCESS_KINDS) == {*PREDICTION_TARGETS, "flow"}
    assert set(NOISE_PROCESSES) == set(SAMPLING_PROCESSES) == set(PROCESS_KINDS.values())


def test_an_unknown_prediction_type_names_the_valid_ones():
    valid = r"valid types: \['epsilon', 'flow', 'sample', 'v_prediction'\]"
    with pytest.raises(ValueError, match=valid):
        process_kind("x0")
    with pytest.raises(ValueError, match=valid):
        sampling_plan(SamplingRequest("euler", 4, "x0", sdxl_alphas_cumprod()))


def _duck_config(**fields):
    """An objective config without pydantic: the processes read attributes only."""
    defaults = ObjectiveConfig(**fields)
    return SimpleNamespace(
        **defaults.model_dump(),
        timestep_sampler_params=defaults.timestep_sampler_params,
        loss_weighting_params=defaults.loss_weighting_params,
    )


def test_vp_process_noises_by_hand_from_a_duck_typed_config():
    objective = Objective.from_config(_duck_config(prediction_type="v_prediction"))
    process = objective.process
    x0, noise = torch.randn(2, 3, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    times = torch.tensor([0, 500, 999])
    x_t, target, model_times = process.noised(x0, noise, noise, times)
    alpha_bar = objective.alphas_cumprod[times].float().view(-1, 1, 1, 1)
    torch.testing.assert_close(x_t, alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise)
    torch.testing.assert_close(target, alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * x0)
    assert torch.equal(model_times, times)
    assert torch.equal(process.huber_fraction(times), times / 1000)
    torch.testing.assert_close(process.sigmas(times), process.snr(times).rsqrt())
    draws = process.sample_times(64, torch.Generator().manual_seed(1), CPU)
    assert draws.dtype == torch.int64 and 0 <= draws.min() and draws.max() < 1000


def test_flow_process_noises_by_hand_and_ignores_all_of_the_schedule_but_its_length():
    config = ObjectiveConfig(prediction_type="flow", num_train_timesteps=500)
    process = FlowProcess.from_config(config, training_alphas_cumprod(config))
    x0, noise = torch.randn(2, 3, 4, 2, 2, generator=torch.Generator().manual_seed(2))
    times = torch.tensor([0.25, 0.5, 1.0])
    x_t, target, model_times = process.noised(x0, noise, noise, times)
    t = times.view(-1, 1, 1, 1)
    torch.testing.assert_close(x_t, (1 - t) * x0 + t * noise)
    torch.testing.assert_close(target, noise - x0)
    torch.testing.assert_close(model_times, times * 500)
    assert torch.equal(process.huber_fraction(times), times)
    grid = process.grid_times()
    assert grid.shape == (500,) and 0 < grid.min() and grid.max() < 1
    torch.testing.assert_close(process.sigmas(grid), grid / (1 - grid))


def test_vp_plans_start_from_the_prior_and_end_in_vp_form():
    alphas_cumprod = sdxl_alphas_cumprod()
    euler = sampling_plan(SamplingRequest("euler", 10, "epsilon", alphas_cumprod))
    assert (euler.sample, euler.stochastic) == (sample_euler, False)
    assert euler.noise_scale == pytest.approx((euler.sigmas[0].item() ** 2 + 1) ** 0.5)
    assert euler.make_denoiser.func is vp_denoiser
    x = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(euler.to_latents(x), x)  # the Euler ladder ends at σ = 0
    ddim = sampling_plan(SamplingRequest("ddim", 10, "v_prediction", alphas_cumprod))
    sigma_min = ddim.sigmas[-1]
    assert ddim.sample is sample_ddim and sigma_min > 0
    torch.testing.assert_close(ddim.to_latents(x), x / (sigma_min**2 + 1).sqrt())
    ancestral = sampling_plan(SamplingRequest("euler_ancestral", 10, "epsilon", alphas_cumprod))
    assert ancestral.stochastic


def test_flow_plans_start_from_noise_and_end_at_the_latent():
    request = SamplingRequest(
        "euler", 8, "flow", sdxl_alphas_cumprod(), flow_shift=3.0, flow_shift_resolution=64
    )
    plan = sampling_plan(request)
    assert (plan.sample, plan.stochastic, plan.noise_scale) == (sample_euler, False, 1.0)
    assert plan.make_denoiser is flow_denoiser
    assert plan.sigmas[0] == 1.0 and plan.sigmas[-1] == 0.0
    torch.testing.assert_close(plan.timesteps, plan.sigmas[:-1] * 1000)
    x = torch.randn(1, 4, 2, 2)
    assert plan.to_latents(x) is x
    # The shift scales with the image side: at 128² it is 6, so the ladder sits nearer noise.
    larger = sampling_plan(SamplingRequest(**{**vars(request), "height": 128, "width": 128}))
    assert (larger.sigmas[1:-1] > plan.sigmas[1:-1]).all()
    with pytest.raises(ValueError, match="cannot sample a flow model"):
        sampling_plan(SamplingRequest("ddim", 8, "flow", sdxl_alphas_cumprod()))
