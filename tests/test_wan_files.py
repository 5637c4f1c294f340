"""Wan 2.1 from single files, without a diffusers folder (issue #33): the transformer
(``model.wan.transformer``), ``wan_2.1_vae.safetensors`` (``model.vae``, Wan-AI's original
layout, renamed by diffusers' ``convert_wan_vae_to_diffusers``) and ``umt5_xxl_fp16.safetensors``
(``model.wan.text_encoder``, transformers' layout), written here from tiny random networks;
loaded, every weight equals the original, and a wrong file is one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from safetensors.torch import save_file
from test_wan_single_file import original_name

from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.wan.components import build_tiny

TEXT_LENGTH = 16
RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma":
            "residual.3.gamma", "conv2": "residual.6", "conv_shortcut": "shortcut"}  # fmt: skip


def release_like_vae() -> AutoencoderKLWan:
    """Wan 2.1's VAE layout (two residual blocks a level, widths ×1 ×2 ×4 ×4) at base width 4:
    the layout the original file and diffusers' converter number their blocks by."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                temperal_downsample=[False, True, True])  # fmt: skip


def _residual(rest: str) -> str:
    for diffusers, original in RESIDUAL.items():
        if rest == diffusers or rest.startswith(diffusers + "."):
            return original + rest[len(diffusers) :]
    return rest


def vae_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' ``AutoencoderKLWan`` names → Wan-AI's (``convert_wan_vae_to_diffusers`` read
    backwards; the test checks the converter maps them back to every name)."""
    out = {}
    for key, tensor in state.items():
        name = key.replace("quant_conv", "conv1").replace("post_conv1", "conv2")
        name = name.replace(".conv_in.", ".conv1.").replace(".norm_out.", ".head.0.")
        name = name.replace(".conv_out.", ".head.2.").replace("mid_block.attentions.0", "middle.1")
        if match := re.match(r"(\w+)\.mid_block\.resnets\.(\d)\.(.*)", name):
            coder, index, rest = match.groups()
            name = f"{coder}.middle.{2 * int(index)}.{_residual(rest)}"
        elif match := re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", name):
            name = f"encoder.downsamples.{match[1]}.{_residual(match[2])}"
        elif match := re.match(r"decoder\.up_blocks\.(\d)\.resnets\.(\d)\.(.*)", name):
            name = f"decoder.upsamples.{4 * int(match[1]) + int(match[2])}.{_residual(match[3])}"
        elif match := re.match(r"decoder\.up_blocks\.(\d)\.upsamplers\.0\.(.*)", name):
            name = f"decoder.upsamples.{4 * int(match[1]) + 3}.{match[2]}"
        out[name] = tensor
    return out


def to_original(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {original_name(k): v for k, v in transformer.state_dict().items()}


def write(path: Path, state: dict[str, torch.Tensor]) -> str:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return str(path)


def files_config(**settings: Any) -> Any:
    vae = settings.pop("vae")
    raw = {
        "config_version": 1,
        "model": {"family": "wan", "preset": "tiny", "init_seed": 7, "vae": vae,
                  "wan": {"text_length": TEXT_LENGTH, **settings}},
        "objective": {"prediction_type": "flow"},
        "data": {"path": "synthetic"},
        "train": {"output_dir": "unused", "max_steps": 1},
    }  # fmt: skip
    return build_config(raw)


def test_the_inverse_map_is_what_diffusers_converter_reads():
    state = release_like_vae().state_dict()
    original = vae_to_original(state)
    assert "encoder.downsamples.0.residual.0.gamma" in original
    assert "decoder.upsamples.7.resample.1.weight" in original  # an upsampler, original index
    converted = convert_wan_vae_to_diffusers(original)
    assert converted.keys() == state.keys()
    assert all(converted[key] is state[key] for key in state)


def test_files_alone_load_every_weight(tmp_path):
    original = build_tiny(0, TEXT_LENGTH)
    vae = release_like_vae()
    original.vae = vae  # the file's VAE needs the architecture it fits: the preset's is smaller
    umt5 = dict(original.text_encoder.state_dict())
    umt5.pop("encoder.embed_tokens.weight", None)
    settings = {
        "transformer": write(tmp_path / "wan2.1_t2v.safetensors",
                             to_original(original.transformer)),
        "text_encoder": write(tmp_path / "umt5_xxl_fp16.safetensors", umt5),
        "vae": write(tmp_path / "wan_2.1_vae.safetensors", vae_to_original(vae.state_dict())),
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"^model.vae .*wan_2.1_vae.safetensors: does not fit "
                       r"this model's Wan VAE \(.*\); is it the VAE of another model"):  # fmt: skip
        build_backbone(files_config(**settings))  # the tiny preset's VAE is another layout
    import impasto.models.wan.components as components

    tiny_vae = components.tiny_vae
    components.tiny_vae = release_like_vae
    try:
        loaded = build_backbone(files_config(**settings)).components
    finally:
        components.tiny_vae = tiny_vae
    for name in ("transformer", "vae", "text_encoder"):
        want, got = getattr(original, name).state_dict(), getattr(loaded, name).state_dict()
        assert want.keys() == got.keys(), name
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor) and not got[key].is_meta, f"{name}.{key}"


def test_a_wrong_vae_file_is_one_line(tmp_path):
    transformer = to_original(build_tiny(0, TEXT_LENGTH).transformer)
    path = write(tmp_path / "wan2.1_t2v.safetensors", transformer)
    with pytest.raises(ValueError, match=r"^model.vae .*: a Wan transformer, not a Wan 2.1 VAE"):
        build_backbone(files_config(vae=path))
