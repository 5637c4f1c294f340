"""SD3.5 from single files, without a diffusers folder (issue #33): one whole checkpoint in
Stability's layout (``model.diffusion_model.*`` transformer, ``first_stage_model.*`` VAE,
``text_encoders.clip_l / clip_g / t5xxl.transformer.*``) named by every setting, or separate
files (ComfyUI's ``clip_l``, an OpenCLIP-layout ``clip_g``, ``t5xxl_fp16``), written here from
a tiny random model; loaded, every weight equals the original and it samples as the original."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_sd3_single_file import to_original

from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.sd3.components import build_tiny
from impasto.models.sd3.sampling import generate_sd3_latents
from impasto.models.single_file.keymap import (
    CLIP_G_PREFIX,
    _clip_g_sgm,
    _vae_sgm,
    clip_text_model_key,
)

TEXT_LENGTH = 16
NETWORKS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
SETTINGS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")


def clip_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' CLIP names with the ``text_model.`` level the downloaded files have."""
    return {clip_text_model_key(k): v for k, v in module.state_dict().items()}


def t5_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(module.state_dict())
    del state["encoder.embed_tokens.weight"]  # stored once, as shared.weight
    return state


def whole_checkpoint(components: Any) -> dict[str, torch.Tensor]:
    """Stability's all-in-one layout (sd3.5_large_fp8_scaled's names, unscaled)."""
    state = to_original(components.transformer.state_dict(), "model.diffusion_model.")
    state |= _vae_sgm(components.vae)  # first_stage_model.*
    for part, name in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        clip = clip_state(getattr(components, part))
        state |= {f"text_encoders.{name}.transformer.{k}": v for k, v in clip.items()}
    t5 = t5_state(components.text_encoder_3)
    return state | {f"text_encoders.t5xxl.transformer.{k}": v for k, v in t5.items()}


def write(path: Path, state: dict[str, torch.Tensor]) -> str:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return str(path)


def files_config(settings: dict[str, str], vae: str) -> Any:
    raw = {
        "config_version": 1,
        "model": {"family": "sd3", "preset": "tiny", "init_seed": 7, "vae": vae,
                  "sd3": {"text_length": TEXT_LENGTH, **settings}},
        "objective": {"prediction_type": "flow", "flow_shift": 3.0},
        "data": {"path": "synthetic"},
        "train": {"output_dir": "unused", "max_steps": 1},
    }  # fmt: skip
    return build_config(raw)


@pytest.fixture(scope="module")
def original():
    return build_tiny(0, TEXT_LENGTH)


def assert_same_networks(loaded: Any, original: Any) -> None:
    for name in NETWORKS:
        want, got = getattr(original, name).state_dict(), getattr(loaded, name).state_dict()
        assert want.keys() == got.keys(), name
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), f"{name}.{key}"


def test_one_whole_checkpoint_gives_every_network(original, tmp_path):
    path = write(tmp_path / "sd3.5_tiny.safetensors", whole_checkpoint(original))
    backbone = build_backbone(files_config(dict.fromkeys(SETTINGS, path), vae=path))
    assert_same_networks(backbone.components, original)
    from impasto.models.sd3.backbone import Sd3Backbone
    from impasto.models.sd3.options import Sd3Options

    reference = Sd3Backbone(original, Sd3Options(text_length=TEXT_LENGTH))
    call = {"prompts": ["a red circle"], "num_steps": 2, "height": 64, "width": 64, "seed": 1}
    torch.testing.assert_close(
        generate_sd3_latents(backbone, **call), generate_sd3_latents(reference, **call),
        rtol=0, atol=0,
    )  # fmt: skip


def test_separate_files_in_comfyuis_and_openclips_layouts(original, tmp_path):
    open_clip = _clip_g_sgm(original.text_encoder_2)  # OpenCLIP's own names (SDXL's file)
    assert any(key.startswith(CLIP_G_PREFIX + "transformer.resblocks.") for key in open_clip)
    settings = {
        "transformer": write(tmp_path / "sd3.5.safetensors",
                             to_original(original.transformer.state_dict())),
        "text_encoder": write(tmp_path / "clip_l.safetensors", clip_state(original.text_encoder)),
        "text_encoder_2": write(tmp_path / "clip_g.safetensors", open_clip),
        "text_encoder_3": write(tmp_path / "t5xxl.safetensors", t5_state(original.text_encoder_3)),
    }  # fmt: skip
    vae = {k.removeprefix("first_stage_model."): v for k, v in _vae_sgm(original.vae).items()}
    backbone = build_backbone(files_config(settings, write(tmp_path / "vae.safetensors", vae)))
    assert_same_networks(backbone.components, original)


def test_clip_l_in_place_of_clip_g_is_one_line(original, tmp_path):
    clip_l = write(tmp_path / "clip_l.safetensors", clip_state(original.text_encoder))
    with pytest.raises(ValueError, match=r"^model.sd3.text_encoder_2 .*clip_l.safetensors: .* has "
                       r"shape \(49408, 8\), CLIPTextModelWithProjection \(16 wide, 3 layers\) "
                       r"takes \(49408, 16\); is it another encoder's file\?$"):  # fmt: skip
        build_backbone(files_config({"text_encoder_2": clip_l}, vae=None))
