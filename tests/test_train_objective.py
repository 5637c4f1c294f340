"""The objective options of the training step, wired from the config (issue #4)."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_inputs import tiny_batch

from impasto.checkpoint.trained import read_model_metadata
from impasto.config import build_config, load_config
from impasto.config.schema import ObjectiveConfig
from impasto.inference import model_sampling_options
from impasto.models.sdxl import SDXLBackbone
from impasto.objectives import alphas_cumprod_from_betas, scaled_linear_betas
from impasto.objectives.objective import Objective
from impasto.sampling import get_sampler
from impasto.train.methods.denoise import denoising_loss
from impasto.train.trainer import train


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, 8, 8, generator=generator), torch.randn(
        6, 4, 8, 8, generator=generator
    )


def test_min_snr_weights_the_v_loss_by_min_snr_over_snr_plus_one():
    objective = Objective.from_config(
        ObjectiveConfig(prediction_type="v_prediction", loss_weighting="min_snr")
    )
    prediction, target = _inputs()
    timesteps = torch.tensor([0, 100, 300, 500, 800, 999])
    alpha_bar = alphas_cumprod_from_betas(scaled_linear_betas(1000, 0.00085, 0.012))[timesteps]
    snr = (alpha_bar / (1 - alpha_bar)).tolist()
    mse = ((prediction - target) ** 2).flatten(1).mean(1).tolist()
    expected = [m * min(s, 5.0) / (s + 1) for m, s in zip(mse, snr, strict=True)]
    ours = objective.per_sample_loss(prediction, target, timesteps)
    torch.testing.assert_close(ours, torch.tensor(expected))


def test_pseudo_huber_with_a_constant_c():
    objective = Objective.from_config(
        ObjectiveConfig(loss="pseudo_huber", huber_schedule="constant", huber_c=0.1)
    )
    prediction, target = _inputs(1)
    d = prediction - target
    expected = (2 * 0.1 * (torch.sqrt(d**2 + 0.01) - 0.1)).flatten(1).mean(1)
    ours = objective.per_sample_loss(prediction, target, torch.arange(6))
    torch.testing.assert_close(ours, expected)


def test_input_perturbation_keeps_the_clean_noise_for_the_target():
    objective = Objective.from_config(ObjectiveConfig(input_perturbation=0.1))
    noise = torch.randn(64, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    for_target, for_input = objective.shape_noise(noise, torch.Generator().manual_seed(3))
    assert torch.equal(for_target, noise)
    assert (for_input - noise).std().item() == pytest.approx(0.1, rel=0.02)


def test_offset_noise_moves_target_and_input_together_and_defaults_draw_nothing():
    noise = torch.randn(256, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    objective = Objective.from_config(ObjectiveConfig(noise_offset=0.1))
    for_target, for_input = objective.shape_noise(noise, torch.Generator().manual_seed(5))
    assert for_target is for_input
    offset = for_target - noise
    torch.testing.assert_close(offset, offset[:, :, :1, :1].expand_as(offset))  # per channel
    assert offset[:, :, 0, 0].std().item() == pytest.approx(0.1, rel=0.1)
    generator = torch.Generator().manual_seed(6)
    state = generator.get_state()
    plain = Objective.from_config(ObjectiveConfig())
    assert plain.shape_noise(noise, generator) == (noise, noise)
    assert torch.equal(generator.get_state(), state)  # the default run's random stream is unchanged


def test_timestep_bias_later_draws_the_last_quarter_ten_times_as_often():
    bias = {"strategy": "later", "multiplier": 10.0, "portion": 0.25}
    objective = Objective.from_config(
        ObjectiveConfig(timestep_sampling="timestep_bias", timestep_bias=bias)
    )
    draws = objective.sample_times(20000, torch.Generator().manual_seed(7), torch.device("cpu"))
    late = (draws >= 750).float().mean().item()
    p = 10 * 250 / (10 * 250 + 750)  # 0.769
    assert abs(late - p) < 5 * math.sqrt(p * (1 - p) / 20000)


def test_uniform_window_and_zero_terminal_snr_schedule():
    objective = Objective.from_config(ObjectiveConfig(min_timestep=200, max_timestep=400))
    draws = objective.sample_times(5000, torch.Generator().manual_seed(8), torch.device("cpu"))
    assert draws.min() == 200 and draws.max() == 399
    ztsnr = Objective.from_config(
        ObjectiveConfig(
            prediction_type="v_prediction", zero_terminal_snr=True, terminal_sigma=20000
        )
    )
    sigma_max = ((1 - ztsnr.alphas_cumprod[-1]) / ztsnr.alphas_cumprod[-1]).sqrt().item()
    assert sigma_max == pytest.approx(20000, rel=1e-6)


def test_zero_terminal_snr_sampling_starts_at_the_terminal_sigma(tiny_raw):
    plain = model_sampling_options(build_config(tiny_raw))
    assert plain["spacing"] == "leading" and plain["prediction_type"] == "epsilon"
    tiny_raw["objective"] = {"prediction_type": "v_prediction", "zero_terminal_snr": True}
    options = model_sampling_options(build_config(tiny_raw))
    assert options["spacing"] == "trailing" and options["prediction_type"] == "v_prediction"
    timesteps, sigmas = get_sampler("euler").schedule(
        30, options["alphas_cumprod"], options["spacing"], 1
    )
    assert timesteps[0] == 999 and sigmas[0].item() == pytest.approx(20000, rel=1e-5)
    assert model_sampling_options(build_config(tiny_raw), "leading")["spacing"] == "leading"


@pytest.mark.parametrize(
    "objective",
    [
        {"prediction_type": "v_prediction", "zero_terminal_snr": True, "loss_weighting": "min_snr"},
        {"noise_offset": 0.1, "input_perturbation": 0.1, "loss": "pseudo_huber"},
        {"prediction_type": "flow", "timestep_sampling": "logit_normal", "flow_shift": 3.0},
    ],
)
def test_tiny_run_learns_under_other_objectives(tiny_raw, objective):
    tiny_raw["objective"] = objective
    tiny_raw["train"]["max_steps"] = 30
    tiny_raw["optim"]["lr"] = 2e-3
    tiny_raw["checkpoint"]["every_steps"] = 30
    result = train(build_config(tiny_raw))
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert all(math.isfinite(loss) for loss in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.9 * first, (first, last)


def _preset_on_tiny(name: str, tmp_path: Path, demo_folder: Path):
    """configs/NAME.yaml with the overrides its header gives for the tiny model, 2 steps."""
    preset = Path(__file__).parents[1] / "configs" / f"{name}.yaml"
    overrides = [
        "model.path=null",
        "model.preset=tiny",
        f"data.path={demo_folder}",
        "data.resolution=64",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "checkpoint.every_steps=2",
        "sample.every_steps=2",
        "sample.num_steps=3",
        "log.progress_bar=false",
    ]
    return load_config(preset, overrides)


def _train_and_read_metadata(config) -> dict[str, str]:
    result = train(config)
    assert result.state.step == 2
    assert (result.run_dir / "samples" / "step-00000002.png").is_file()
    return read_model_metadata(result.run_dir)


def test_vpred_ztsnr_preset_runs_on_the_tiny_model(tmp_path, demo_folder):
    config = _preset_on_tiny("sdxl-vpred-ztsnr", tmp_path, demo_folder)
    objective = config.objective
    assert (objective.prediction_type, objective.zero_terminal_snr) == ("v_prediction", True)
    assert (objective.terminal_sigma, objective.loss_weighting) == (20000.0, "min_snr")
    assert model_sampling_options(config)["spacing"] == "trailing"
    metadata = _train_and_read_metadata(config)
    assert metadata["impasto.prediction_type"] == "v_prediction"
    assert metadata["impasto.zero_terminal_snr"] == "true"
    assert float(metadata["impasto.terminal_sigma"]) == 20000.0


def test_flow_preset_runs_on_the_tiny_model(tmp_path, demo_folder):
    config = _preset_on_tiny("sdxl-flow", tmp_path, demo_folder)
    objective = config.objective
    assert (objective.prediction_type, objective.timestep_sampling) == ("flow", "logit_normal")
    assert (objective.logit_mean, objective.logit_std) == (0.0, 1.0)
    assert (objective.flow_shift, objective.flow_shift_resolution) == (3.0, 1024)
    metadata = _train_and_read_metadata(config)
    assert metadata["impasto.prediction_type"] == "flow"
    assert metadata["impasto.zero_terminal_snr"] == "false"
    assert (metadata["impasto.flow_shift"], metadata["impasto.flow_shift_resolution"]) == (
        "3.0",
        "1024",
    )


def test_per_sample_loss_weights_and_masks_multiply_in(tiny):
    batch = tiny_batch()
    objective = Objective.from_config(ObjectiveConfig())

    def per_sample(**changes):
        out = denoising_loss(
            SDXLBackbone(tiny),
            objective,
            replace(batch, **changes),
            torch.Generator().manual_seed(1),
            nullcontext,
        )
        return out.per_sample_loss

    plain = per_sample()
    torch.testing.assert_close(
        per_sample(loss_weights=torch.tensor([2.0, 0.5])), plain * torch.tensor([2.0, 0.5])
    )
    top = torch.zeros(2, 1, 64, 64)
    top[:, :, :32] = 1
    top_loss, bottom_loss = per_sample(loss_masks=top), per_sample(loss_masks=1 - top)
    # The halves' means average to the whole mean, and differ from it (the mask is applied).
    torch.testing.assert_close((top_loss + bottom_loss) / 2, plain)
    assert not torch.allclose(top_loss, bottom_loss)
