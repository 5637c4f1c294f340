"""``impasto export RUN --format single-file`` of a FLUX run (issue #33): the trained transformer
as one file in Black Forest Labs' layout, as ``flux1-dev.safetensors`` holds it (no prefix, q/k/v
stacked in ``qkv``, a single block's q/k/v and MLP input in ``linear1``, the final modulation as
(shift, scale), ``guidance_in`` for FLUX.1-dev only). The file equals ComfyUI's map of the
trained weights, loads back through ``model.flux.transformer`` to them exactly, and ComfyUI's
model detection (tests/comfyui_detection.py) picks FLUX.1-dev (or -schnell) from its names.

diffusers' ``FluxTransformer2DModel.from_single_file`` converts with FLUX.1's width written in
(3072, ``convert_flux_transformer_checkpoint_to_diffusers``), so it cannot read a tiny model:
diffusers' converter is held to the writer at FLUX.1's width on the meta device (names and
shapes), and ``from_single_file`` itself reads a FLUX-wide file of one block of each kind to
the same weights in the slow test (1.1 GB in bf16, 3 GB of memory)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from comfyui_detection import detect
from diffusers import FluxTransformer2DModel
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
from safetensors import safe_open
from safetensors.torch import load_file
from test_flux_single_file import to_original as comfyui_map

from impasto.cli import main
from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.flux.components import build_tiny
from impasto.models.flux.single_file import (
    from_original,
    to_original,
    transformer_variant,
    write_single_file,
)

TEXT_LENGTH = 16


@pytest.fixture(scope="module")
def full_run(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX run that fully fine-tunes the transformer (2 steps)."""
    from impasto.train.trainer import train

    out = tmp_path_factory.mktemp("flux-full")
    raw = {
        "config_version": 1,
        "model": {"family": "flux", "preset": "tiny", "flux": {"text_length": TEXT_LENGTH}},
        "objective": {"prediction_type": "flow"},
        "parts": {"transformer": "full"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(out / "run"), "seed": 0, "max_steps": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    return train(build_config(raw)).run_dir


def export(run: Path, out: Path, dtype: str) -> dict[str, torch.Tensor]:
    assert main(["export", str(run), "--format", "single-file", "--dtype", dtype,
                 "--out", str(out)]) == 0  # fmt: skip
    return load_file(str(out))


def loaded_by_impasto(tiny_raw: dict, file: Path) -> dict[str, torch.Tensor]:
    """``model.flux.transformer: FILE`` over the tiny preset of another seed."""
    options = {"text_length": TEXT_LENGTH, "transformer": str(file)}
    tiny_raw["model"] = {"family": "flux", "preset": "tiny", "init_seed": 1, "flux": options}
    tiny_raw["objective"] = {"prediction_type": "flow"}
    return build_backbone(build_config(tiny_raw)).denoiser().state_dict()


def test_a_full_fine_tune_exports_bfls_single_file(full_run, tiny_raw, tmp_path):
    from impasto.checkpoint.trained import load_trained

    _, backbone = load_trained(full_run)
    want = backbone.denoiser().state_dict()
    assert not torch.equal(
        want["proj_out.weight"], build_tiny(0, TEXT_LENGTH).transformer.proj_out.weight
    )
    file = tmp_path / "flux1-tuned.safetensors"
    stored = export(full_run, file, "fp32")
    comfy = comfyui_map(want)  # ComfyUI's flux_to_diffusers, read backwards: its model's names
    assert stored.keys() == comfy.keys()
    assert all(torch.equal(stored[key], tensor) for key, tensor in comfy.items())
    assert "guidance_in.in_layer.weight" in stored and transformer_variant(stored) == "dev"
    with safe_open(str(file), "pt") as handle:
        assert handle.metadata() == {"impasto.family": "flux", "format": "pt"}
    got = loaded_by_impasto(tiny_raw, file)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], tensor) for key, tensor in want.items())
    hidden = want["x_embedder.weight"].shape[0]
    assert detect(stored) == ("Flux", {
        "image_model": "flux", "axes_dim": [16, 56, 56], "patch_size": 2, "in_channels": 16,
        "hidden_size": hidden, "context_in_dim": want["context_embedder.weight"].shape[1],
        "vec_in_dim": want["time_text_embed.text_embedder.linear_1.weight"].shape[1],
        "depth": 1, "depth_single_blocks": 1, "guidance_embed": True,
    })  # fmt: skip


def test_the_export_dtype_is_the_files(full_run, tiny_raw, tmp_path):
    from impasto.checkpoint.trained import load_trained
    from impasto.export import ExportOptions, export_checkpoint

    _, backbone = load_trained(full_run)
    want = backbone.denoiser().state_dict()
    stored = export(full_run, tmp_path / "flux1-tuned-bf16.safetensors", "bf16")
    assert {tensor.dtype for tensor in stored.values()} == {torch.bfloat16}
    got = loaded_by_impasto(tiny_raw, tmp_path / "flux1-tuned-bf16.safetensors")
    assert all(torch.equal(got[key], t.to(torch.bfloat16).float()) for key, t in want.items())
    with pytest.raises(ValueError, match=r"export --out .*: the single file needs a \.safetensors"):
        export_checkpoint(full_run, "single-file", tmp_path / "flux.pt", ExportOptions("fp32"))


def test_a_schnell_transformer_is_written_without_guidance(tmp_path):
    tiny = build_tiny(0, TEXT_LENGTH).transformer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        schnell = FluxTransformer2DModel.from_config({**tiny.config, "guidance_embeds": False})
    state = schnell.state_dict()
    backbone = types.SimpleNamespace(components=types.SimpleNamespace(transformer=schnell))
    file = write_single_file(backbone, tmp_path / "schnell.safetensors", {}, torch.float32)
    stored = load_file(str(file))
    assert not any(key.startswith("guidance_in.") for key in stored)
    assert transformer_variant(stored) == "schnell" and detect(stored)[0] == "FluxSchnell"
    back = from_original(stored)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_diffusers_converter_reads_the_writers_layout_at_flux_width():
    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=2, num_single_layers=2, guidance_embeds=True)
    written = to_original(model.state_dict())
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(written))
    expected = model.state_dict()
    assert theirs.keys() == expected.keys()
    assert all(theirs[key].shape == expected[key].shape for key in expected)
    with pytest.raises(ValueError, match="a tensor the FLUX original layout has no place for"):
        to_original({**model.state_dict(), "extra.weight": torch.zeros(1)})


@pytest.mark.slow
def test_diffusers_from_single_file_loads_a_flux_wide_export(tmp_path):
    """FLUX.1-dev's width (3072, 24 heads), one double and one single block, bf16 weights."""
    with torch.device("meta"):
        model = FluxTransformer2DModel(
            num_layers=1, num_single_layers=1, guidance_embeds=True, joint_attention_dim=64,
            pooled_projection_dim=32,
        )  # fmt: skip
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.bfloat16))
    model.save_config(tmp_path / "config")
    backbone = types.SimpleNamespace(components=types.SimpleNamespace(transformer=model))
    file = write_single_file(backbone, tmp_path / "flux1-wide.safetensors", {}, torch.bfloat16)
    loaded = FluxTransformer2DModel.from_single_file(
        str(file), config=str(tmp_path / "config"), torch_dtype=torch.bfloat16
    )
    want, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], tensor) for key, tensor in want.items())
