"""Tests for impasto.vae: the shipped demo VAE, PSNR, the training run and its weight files."""

from __future__ import annotations

import math
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from safetensors.torch import load_file

from impasto.data import scan_image_folder, write_demo_dataset
from impasto.models import build_tiny
from impasto.vae import (
    TINY_VAE_CONFIG,
    evaluate_vae,
    load_demo_vae,
    load_images,
    load_vae_file,
    lr_at,
    psnr,
    read_vae_metadata,
    train_vae,
)

DEMO_VAE_DIR = Path(str(files("impasto") / "assets" / "demo_vae"))
SHIPPED_FILE = DEMO_VAE_DIR / "diffusion_pytorch_model.safetensors"
TRAINING_SEED = 0  # the shipped VAE saw write_demo_dataset(..., seed=0) images only
FRESH_SEED = 4242


@pytest.fixture(scope="module")
def fresh_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 demo images the shipped VAE never saw (a seed other than its training seed)."""
    path = tmp_path_factory.mktemp("fresh") / "demo"
    write_demo_dataset(path, num_images=64, size=64, seed=FRESH_SEED)
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """Two identical short runs (same seed) on 32 demo images."""
    root = tmp_path_factory.mktemp("train")
    write_demo_dataset(root / "data", num_images=32, size=64, seed=TRAINING_SEED)
    kwargs = {"steps": 30, "batch_size": 8, "lr": 4e-3, "warmup_steps": 5, "log_every": 10}
    first = train_vae(
        root / "data", root / "a" / "diffusion_pytorch_model.safetensors", seed=3, **kwargs
    )
    second = train_vae(
        root / "data", root / "b" / "diffusion_pytorch_model.safetensors", seed=3, **kwargs
    )
    return first, second


def _decode(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(latents).sample


# --- the shipped demo VAE -------------------------------------------------------------------


def test_shipped_vae_reconstructs_unseen_demo_images(fresh_demo_dir: Path) -> None:
    assert FRESH_SEED != TRAINING_SEED
    vae = load_demo_vae()
    value = evaluate_vae(vae, scan_image_folder(fresh_demo_dir), resolution=64)
    assert value >= 25.0, f"held-out PSNR {value:.2f} dB"


def test_shipped_vae_is_the_tiny_architecture_with_measured_scaling(fresh_demo_dir: Path) -> None:
    config, training = read_vae_metadata(SHIPPED_FILE)
    for key, value in TINY_VAE_CONFIG.items():
        assert config[key] == value, key
    assert training["command"].startswith("impasto train-vae ")
    assert training["psnr_held_out_db"] >= 25.0
    vae = load_demo_vae()
    images = load_images(scan_image_folder(fresh_demo_dir), 64)
    with torch.no_grad():
        posterior = vae.encode(images).latent_dist
    latents = posterior.mode() * vae.config.scaling_factor
    assert latents.shape == (64, 4, 8, 8)
    # scaling_factor = 1 / std of the latents (Rombach et al. 2022), so scaled latents have unit
    # std on demo images; the posterior noise the trainer adds is small next to them.
    assert latents.std().item() == pytest.approx(1.0, abs=0.1)
    assert (posterior.std * vae.config.scaling_factor).mean().item() < 0.1


def test_tiny_preset_uses_the_shipped_vae_for_every_seed() -> None:
    shipped = load_file(str(SHIPPED_FILE))
    for seed in (0, 1):
        state = build_tiny(seed).vae.state_dict()
        assert state.keys() == shipped.keys()
        assert all(torch.equal(state[key], shipped[key]) for key in shipped)
    from_diffusers = AutoencoderKL.from_pretrained(DEMO_VAE_DIR, local_files_only=True)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_decode(from_diffusers, latents), _decode(build_tiny(0).vae, latents))


# --- PSNR -----------------------------------------------------------------------------------


def test_psnr_matches_hand_computed_values() -> None:
    reference = torch.zeros(1, 3, 2, 2)
    reconstruction = reference.clone()
    reconstruction[0, 0, 0, 0] = 0.5  # MSE = 0.25 / 12
    assert psnr(reference, reconstruction) == pytest.approx(10 * math.log10(48.0))  # 16.812 dB
    assert psnr(torch.full((4,), 0.5), torch.full((4,), 0.6)) == pytest.approx(20.0)
    assert psnr(reference, reference) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(reference, reference[0])


def test_lr_warms_up_then_decays_to_zero() -> None:
    assert lr_at(0, 1.0, 4, 10) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 4, 10) == pytest.approx(1.0)
    assert lr_at(7, 1.0, 4, 10) == pytest.approx(0.5)
    assert lr_at(10, 1.0, 4, 10) == pytest.approx(0.0)


# --- training -------------------------------------------------------------------------------


def test_train_vae_is_deterministic_and_learns(tiny_run: tuple) -> None:
    first, second = tiny_run
    weights, again = load_file(str(first.out_file)), load_file(str(second.out_file))
    assert all(torch.equal(weights[key], again[key]) for key in weights)
    assert first.losses == second.losses and len(first.losses) == 3
    assert first.losses[-1] < 0.7 * first.losses[0]
    assert first.psnr > first.psnr_before + 1.0
    assert (first.num_train_images, first.num_held_out_images) == (31, 1)
    assert first.latent_shape == (4, 8, 8)
    _, training = read_vae_metadata(first.out_file)
    assert training["command"] == first.command
    assert "--steps 30 --batch-size 8" in first.command and "--seed 3" in first.command


def test_saved_file_loads_into_the_tiny_preset_with_identical_outputs(tiny_run: tuple) -> None:
    report = tiny_run[0]
    loaded = load_vae_file(report.out_file)
    preset_vae = build_tiny(0).vae
    preset_vae.load_state_dict(load_file(str(report.out_file)), strict=True)
    from_diffusers = AutoencoderKL.from_pretrained(report.out_file.parent, local_files_only=True)
    assert report.config_file == report.out_file.parent / "config.json"
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    reference = _decode(loaded, latents)
    assert torch.equal(_decode(preset_vae, latents), reference)
    assert torch.equal(_decode(from_diffusers, latents), reference)
    assert loaded.config.scaling_factor == pytest.approx(report.scaling_factor)
    assert from_diffusers.config.scaling_factor == pytest.approx(report.scaling_factor)


def test_bad_inputs_raise_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must end in .safetensors"):
        train_vae(tmp_path, tmp_path / "vae.pt")
    with pytest.raises(ValueError, match="unknown loss 'l3'; valid losses: \\['l1', 'mse'\\]"):
        train_vae(tmp_path, tmp_path / "vae.safetensors", loss="l3")
    with pytest.raises(ValueError, match="multiple of 8"):
        train_vae(tmp_path, tmp_path / "vae.safetensors", resolution=60)
    with pytest.raises(ValueError, match="does not exist"):
        load_vae_file(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_vae_file(garbage)
