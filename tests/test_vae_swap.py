"""``model.vae``: another VAE from a folder or a single file (diffusers or original names)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from impasto.config import build_config
from impasto.models import build_tiny, load_model, vae_swap
from impasto.models.single_file import sgm_state_dict
from impasto.models.single_file.keymap import VAE_PREFIX
from impasto.models.vae_swap import load_vae


@pytest.fixture(scope="module")
def tiny():
    return build_tiny(seed=0)


@pytest.fixture(scope="module")
def other_vae(tiny):
    """The tiny model's VAE with other weights: what a swap must deliver exactly."""
    vae = type(tiny.vae).from_config(tiny.vae.config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for tensor in vae.state_dict().values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return vae.eval()


def assert_same_weights(expected, actual) -> None:
    expected_state, actual_state = expected.state_dict(), actual.state_dict()
    assert actual_state.keys() == expected_state.keys()
    for key, tensor in expected_state.items():
        assert torch.equal(actual_state[key], tensor), key


def ldm_tensors(tiny, vae, prefix: str) -> dict[str, torch.Tensor]:
    """``vae`` in the original (LDM) layout, as Stability's sdxl_vae.safetensors stores it."""
    swapped = type(tiny)(**{**tiny.__dict__, "vae": vae})
    tensors = sgm_state_dict(swapped)
    return {
        prefix + key.removeprefix(VAE_PREFIX): tensor.contiguous()
        for key, tensor in tensors.items()
        if key.startswith(VAE_PREFIX)
    }


def test_a_diffusers_folder_or_a_whole_pipeline_folder(tiny, other_vae, tmp_path: Path):
    other_vae.save_pretrained(tmp_path / "fp16-fix")
    assert_same_weights(other_vae, load_vae(tmp_path / "fp16-fix", tiny.vae))
    other_vae.save_pretrained(tmp_path / "pipeline" / "vae")
    assert_same_weights(other_vae, load_vae(tmp_path / "pipeline", tiny.vae))


def test_a_file_with_diffusers_names(tiny, other_vae, tmp_path: Path):
    path = tmp_path / "sdxl.vae.safetensors"
    save_file({k: v.contiguous() for k, v in other_vae.state_dict().items()}, path)
    loaded = load_vae(path, tiny.vae)
    assert_same_weights(other_vae, loaded)
    assert loaded.config.scaling_factor == tiny.vae.config.scaling_factor


@pytest.mark.parametrize("prefix", ["", "first_stage_model."])
def test_a_file_with_original_names(tiny, other_vae, tmp_path: Path, prefix: str):
    path = tmp_path / "sdxl_vae.safetensors"
    save_file(ldm_tensors(tiny, other_vae, prefix), path)
    assert_same_weights(other_vae, load_vae(path, tiny.vae))


class ReadRecorder:
    """A safetensors handle that notes every tensor read from it."""

    def __init__(self, handle: Any, read: list[str]) -> None:
        self.handle, self.read = handle, read

    def get_tensor(self, name: str) -> torch.Tensor:
        self.read.append(name)
        return self.handle.get_tensor(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_a_whole_checkpoint_gives_its_vae_and_reads_nothing_else(
    tiny, other_vae, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
):
    """An all-in-one file (SD3.5's: the VAE beside the transformer and text encoders) loads
    the same VAE as the VAE alone, reading the VAE's tensors only (16 GB → ~160 MB)."""
    if layout == "original":
        vae_tensors = ldm_tensors(tiny, other_vae, "first_stage_model.")
    else:
        vae_tensors = {k: v.contiguous() for k, v in other_vae.state_dict().items()}
    others = {
        "model.diffusion_model.x_embedder.proj.weight": torch.randn(8, 16, 2, 2),
        "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": torch.ones(8),
        "first_stage_model.loss.logvar": torch.zeros(()),  # in the prefix, not the VAE
    }
    path = tmp_path / "sd3.5_all_in_one.safetensors"
    save_file({**vae_tensors, **others}, path)
    read: list[str] = []

    @contextmanager
    def recording_open(*args: Any, **kwargs: Any) -> Iterator[ReadRecorder]:
        with safe_open(*args, **kwargs) as handle:
            yield ReadRecorder(handle, read)

    monkeypatch.setattr(vae_swap, "safe_open", recording_open)
    assert_same_weights(other_vae, load_vae(path, tiny.vae))
    assert sorted(read) == sorted(vae_tensors)


def test_model_vae_replaces_the_models_own(other_vae, tmp_path: Path):
    other_vae.save_pretrained(tmp_path / "vae")
    raw = {"model": {"preset": "tiny", "vae": str(tmp_path / "vae")}, "data": {"path": "x"},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1}}  # fmt: skip
    components = load_model(build_config(raw))
    assert_same_weights(other_vae, components.vae)
    assert not any(p.requires_grad for p in components.vae.parameters())


def test_what_is_not_a_fitting_vae_is_one_line(tiny, tmp_path: Path):
    def problem(path) -> str:
        with pytest.raises(ValueError) as error:
            load_vae(path, tiny.vae)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"model.vae {path}")
        return message

    assert "does not exist" in problem(tmp_path / "missing.safetensors")
    (tmp_path / "vae.ckpt").write_bytes(b"x")
    assert ".safetensors" in problem(tmp_path / "vae.ckpt")
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert "truncated" in problem(tmp_path / "broken.safetensors")
    save_file({"model.diffusion_model.x": torch.zeros(1)}, tmp_path / "unet.safetensors")
    assert "not a VAE" in problem(tmp_path / "unet.safetensors")
    state = {k: v.contiguous() for k, v in tiny.vae.state_dict().items()}
    del state["decoder.conv_out.weight"]
    save_file(state, tmp_path / "partial.safetensors")
    assert "missing" in problem(tmp_path / "partial.safetensors")
    state = {k: v.contiguous() for k, v in tiny.vae.state_dict().items()}
    state["decoder.conv_out.bias"] = torch.zeros(7)
    save_file(state, tmp_path / "other.safetensors")
    assert "shape" in problem(tmp_path / "other.safetensors")
    (tmp_path / "empty").mkdir()
    assert "config.json" in problem(tmp_path / "empty")
