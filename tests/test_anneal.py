"""Annealed guidance (``sampling/anneal.py``, ``impasto sample --anneal``): the weight
schedules, the step lookup, the mix at every sampler step, and the base model of a LoRA and of a
full fine-tune checkpoint."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from torch.testing import assert_close

from impasto.checkpoint.trained import load_trained
from impasto.cli import main
from impasto.config import build_config
from impasto.inference import base_model_forward, model_sampling_options
from impasto.models.backbone import build_backbone
from impasto.models.parts import adapters_disabled, has_adapters
from impasto.models.sdxl import SDXLBackbone
from impasto.sampling import generate_latents, model_forward, sdxl_alphas_cumprod
from impasto.sampling.anneal import Annealing, anneal_weights, annealed_forward
from impasto.sampling.process import SamplingRequest, sampling_plan
from impasto.train.trainer import train

PROMPT = "a red circle on a white background"
FIVE = torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8], dtype=torch.float64)  # i/5

# --- the weight schedules ----------------------------------------------------------------------


def test_anneal_weights_for_five_steps() -> None:
    assert torch.equal(anneal_weights("linear", 5), FIVE)
    assert torch.equal(anneal_weights("base", 5), torch.zeros(5, dtype=torch.float64))
    assert torch.equal(anneal_weights("draft", 5), torch.ones(5, dtype=torch.float64))
    assert torch.equal(anneal_weights("step_0.6", 5), torch.tensor([0.0, 0, 0, 1, 1]).double())
    assert torch.equal(anneal_weights("step_0", 5), torch.ones(5, dtype=torch.float64))
    assert_close(anneal_weights("power_2", 5), FIVE**2, rtol=0, atol=1e-16)
    assert_close(
        anneal_weights("power_4", 5),
        torch.tensor([0.0, 0.0016, 0.0256, 0.1296, 0.4096], dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    assert_close(
        anneal_weights("power_0.5", 4), torch.tensor([0.0, 0.5, 0.5**0.5, 0.75**0.5]).double()
    )
    assert anneal_weights("linear", 1).tolist() == [0.0]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("power_-1", "P must be > 0"),
        ("power_0", "P must be > 0"),
        ("power_", "'' is not a number"),
        ("power_inf", "'inf' is not a finite number"),
        ("step_1.5", r"F must be in \[0, 1\]"),
        ("step_-0.1", r"F must be in \[0, 1\]"),
        ("step_x", "'x' is not a number"),
        ("foo", "unknown schedule"),
        ("linear_2", "unknown schedule"),
        ("Draft", "unknown schedule"),
    ],
)
def test_bad_specs_name_the_problem_and_the_valid_forms(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match=f"anneal schedule '{spec}': {reason}; valid forms: "):
        anneal_weights(spec, 5)
    with pytest.raises(ValueError) as error:
        anneal_weights(spec, 5)
    assert "\n" not in str(error.value)
    assert "base, draft, linear, power_P (P > 0, e.g. power_2), step_F" in str(error.value)


def test_anneal_weights_need_a_step() -> None:
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        anneal_weights("linear", 0)


# --- the mixed forward -------------------------------------------------------------------------


def _constant_forward(value: float, calls: list[float]):
    def forward(x_t: torch.Tensor, timestep: torch.Tensor, conditioning: object) -> torch.Tensor:
        calls.append(float(timestep))
        return torch.full_like(x_t, value)

    return forward


def test_annealed_forward_finds_each_step_by_its_timestep_and_skips_zero_weights() -> None:
    base_calls: list[float] = []
    tuned_calls: list[float] = []
    timesteps = torch.tensor([9.0, 9.0, 4.0, 1.0])  # a repeated value: steps 0 and 1
    weights = torch.tensor([0.0, 0.25, 1.0, 0.5], dtype=torch.float64)
    forward = annealed_forward(
        _constant_forward(10.0, base_calls),
        _constant_forward(30.0, tuned_calls),
        timesteps,
        weights,
    )
    x = torch.zeros(2, 3)
    outputs = [forward(x, t, None)[0, 0].item() for t in timesteps]
    assert outputs == [10.0, 15.0, 30.0, 20.0]
    assert base_calls == [9.0, 9.0, 1.0]  # no base call where w = 1
    assert tuned_calls == [9.0, 4.0, 1.0]  # no tuned call where w = 0
    # A second pass over the same ladder starts again at step 0.
    assert [forward(x, t, None)[0, 0].item() for t in timesteps] == outputs
    with pytest.raises(ValueError, match="timestep 5.0 is not one of the sampling plan's"):
        forward(x, torch.tensor(5.0), None)
    with pytest.raises(ValueError, match=r"must both be \[n\]"):
        annealed_forward(forward, forward, timesteps, weights[:3])


# --- generate with two models sharing their text encoders ------------------------------------


@pytest.fixture(scope="module")
def tuned_and_base(tiny) -> tuple[SDXLBackbone, SDXLBackbone]:
    """The tiny model and a "base" with the same text encoders and VAE but another UNet."""
    unet = copy.deepcopy(tiny.unet)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in unet.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator) * param.std())
    return SDXLBackbone(tiny), SDXLBackbone(dataclasses.replace(tiny, unet=unet))


GUIDED = {"negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 5}


def test_draft_and_base_are_the_two_models_bit_for_bit(
    tuned_and_base: tuple[SDXLBackbone, SDXLBackbone],
) -> None:
    tuned, base = tuned_and_base

    def sample(backbone: SDXLBackbone, spec: str | None = None) -> torch.Tensor:
        anneal = None if spec is None else Annealing(spec, model_forward(base))
        return generate_latents(backbone, [PROMPT], num_steps=3, anneal=anneal, **GUIDED)

    plain, base_plain = sample(tuned), sample(base)
    assert torch.equal(sample(tuned, "draft"), plain)
    assert torch.equal(sample(tuned, "base"), base_plain)
    assert (base_plain - plain).abs().max() > 1e-3


# A stochastic sampler, a multistep one, and flow; three prediction types.
CASES = [("euler_ancestral", "epsilon"), ("dpmpp_2m", "v_prediction"), ("euler", "flow")]


@pytest.mark.parametrize(("sampler", "prediction_type"), CASES)
def test_linear_mixes_the_two_models_denoised_at_every_step(
    tuned_and_base: tuple[SDXLBackbone, SDXLBackbone], sampler: str, prediction_type: str
) -> None:
    """Each step's x̂0 is (1 − i/n)·D_base + (i/n)·D_tuned at that step's input: mixing the
    network outputs (what annealed_forward does) mixes x̂0, the conversions being affine."""
    tuned, base = tuned_and_base
    num_steps = 3
    plan = sampling_plan(
        SamplingRequest(
            sampler=sampler,
            num_steps=num_steps,
            prediction_type=prediction_type,
            alphas_cumprod=sdxl_alphas_cumprod(),
        )
    )
    with torch.no_grad():
        cond = tuned.sampling_condition([PROMPT], 64, 64)
        both = tuned.sampling_condition(["blurry"], 64, 64).cat(cond)

    def denoiser(backbone: SDXLBackbone):
        return plan.make_denoiser(model_forward(backbone), cond, both, guidance_scale=4.0)

    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(GUIDED["seed"]))
    states = [noise * plan.noise_scale]  # the state each step starts from
    denoised_seen: list[torch.Tensor] = []

    def record(i: int, x: torch.Tensor, denoised: torch.Tensor) -> None:
        states.append(x)
        denoised_seen.append(denoised)

    generate_latents(
        tuned,
        [PROMPT],
        num_steps=num_steps,
        sampler=sampler,
        prediction_type=prediction_type,
        anneal=Annealing("linear", model_forward(base)),
        callback=record,
        **GUIDED,
    )
    assert len(denoised_seen) == num_steps
    gaps = []
    with torch.no_grad():
        for i, denoised in enumerate(denoised_seen):
            x, sigma, t = states[i], plan.sigmas[i], plan.timesteps[i]
            from_base, from_tuned = denoiser(base)(x, sigma, t), denoiser(tuned)(x, sigma, t)
            weight = i / num_steps
            expected = (1 - weight) * from_base + weight * from_tuned
            assert_close(denoised, expected, rtol=1e-4, atol=1e-4)
            gaps.append((from_base - from_tuned).abs().max().item())
    assert max(gaps[1:]) > 1e-3  # at a step with 0 < w < 1 the two models differ


# --- checkpoints: LoRA and full fine-tuning ----------------------------------------------------


def _train_run(tmp_path_factory, demo_folder, name: str, unet: str) -> object:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    raw = {
        "model": {"preset": "tiny"},
        "parts": {"unet": unet},
        "lora": {"rank": 4},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "train": {"output_dir": str(run_dir), "seed": 0, "max_steps": 1},
        "checkpoint": {"every_steps": 1},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    train(build_config(raw))
    return run_dir


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, demo_folder):
    return _train_run(tmp_path_factory, demo_folder, "anneal-lora", "lora")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, demo_folder):
    return _train_run(tmp_path_factory, demo_folder, "anneal-full", "full")


SAMPLE = {"num_steps": 2, "guidance_scale": 3.0, "seed": 2}


def test_lora_checkpoint_base_is_the_backbone_with_adapters_disabled(lora_run) -> None:
    config, backbone = load_trained(lora_run)
    assert has_adapters(backbone.denoiser())
    options = {**SAMPLE, **model_sampling_options(config)}
    base = base_model_forward(config, backbone)
    plain = generate_latents(backbone, [PROMPT], **options)
    with adapters_disabled(backbone.denoiser()):
        without = generate_latents(backbone, [PROMPT], **options)
    annealed_base = generate_latents(backbone, [PROMPT], anneal=Annealing("base", base), **options)
    # After the base's calls the adapters are on again: draft is the plain checkpoint.
    draft = generate_latents(backbone, [PROMPT], anneal=Annealing("draft", base), **options)
    assert torch.equal(annealed_base, without)
    assert torch.equal(draft, plain)
    assert (annealed_base - draft).abs().max() > 1e-3  # the adapters trained


def test_full_fine_tune_base_is_the_preset_model(full_run) -> None:
    config, backbone = load_trained(full_run)
    assert not has_adapters(backbone.denoiser())
    options = {**SAMPLE, **model_sampling_options(config)}
    base = base_model_forward(config, backbone)
    preset = build_backbone(config)  # the run's starting model: the tiny preset
    plain = generate_latents(backbone, [PROMPT], **options)
    draft = generate_latents(backbone, [PROMPT], anneal=Annealing("draft", base), **options)
    annealed_base = generate_latents(backbone, [PROMPT], anneal=Annealing("base", base), **options)
    assert torch.equal(draft, plain)
    assert torch.equal(annealed_base, generate_latents(preset, [PROMPT], **options))
    assert (annealed_base - draft).abs().max() > 1e-3  # the UNet trained


def test_anneal_refuses_a_checkpoint_that_trains_a_text_encoder(tiny_raw, tiny) -> None:
    tiny_raw["parts"] = {"unet": "lora", "text_encoder": "full"}
    with pytest.raises(ValueError, match="this checkpoint trains unet, text_encoder; anneal a run"):
        base_model_forward(build_config(tiny_raw), SDXLBackbone(tiny))
    tiny_raw["parts"] = {"unet": "frozen", "text_encoder": "lora"}
    with pytest.raises(
        ValueError, match="trains text_encoder; anneal a run that trains parts.unet"
    ):
        base_model_forward(build_config(tiny_raw), SDXLBackbone(tiny))


def _png(folder, seed: int = 2) -> tuple[np.ndarray, str]:
    (path,) = folder.glob(f"*-a-red-circle-on-a-white-background-*-seed{seed}.png")
    with Image.open(path) as image:
        return np.asarray(image), image.text["parameters"]


def test_sample_command_anneal_end_to_end(lora_run, tmp_path, capsys) -> None:
    args = ["sample", str(lora_run), "--prompt", PROMPT, "--steps", "2", "--cfg", "3", "--seed"]
    args += ["2"]
    assert main([*args, "--out", str(tmp_path / "plain")]) == 0
    assert main([*args, "--anneal", "linear", "--out", str(tmp_path / "linear")]) == 0
    plain, plain_text = _png(tmp_path / "plain")
    linear, linear_text = _png(tmp_path / "linear")
    assert linear.shape == plain.shape == (64, 64, 3)
    assert "Anneal" not in plain_text
    assert linear_text.endswith("Size: 64x64, Anneal: linear")
    capsys.readouterr()
    assert main([*args, "--anneal", "power_-1", "--out", str(tmp_path / "bad")]) == 2
    assert "valid forms: base, draft, linear, power_P" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
