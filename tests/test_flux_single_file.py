"""A FLUX transformer from one file in the original layout (``model.flux.transformer``, issue
#33): it loads to the same weights as the diffusers model it was written from, over a preset or
a diffusers folder's architecture, and the conversion agrees with diffusers' own converter.

The original-layout files here are written with ComfyUI's map (Comfy-Org/ComfyUI
``comfy/utils.py``, ``flux_to_diffusers``: diffusers name → original name, q/k/v stacked into
``qkv`` and ``linear1``, the final modulation's halves swapped), the inverse of what impasto
reads."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file

from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.flux.components import build_tiny
from impasto.models.flux.files import save_flux_folder
from impasto.models.flux.single_file import from_original

TEXT_LENGTH = 16

_DOUBLE = {  # flux_to_diffusers' block_map of a double block (weight and bias)
    "attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}  # fmt: skip
_DOUBLE_NORMS = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
}
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
_SINGLE_NORMS = {"attn.norm_q.weight": "norm.query_norm.scale",
                 "attn.norm_k.weight": "norm.key_norm.scale"}  # fmt: skip
_BASIC = {  # MAP_BASIC
    "proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
}  # fmt: skip


def _swap(weight: torch.Tensor) -> torch.Tensor:  # ComfyUI's swap_scale_shift
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def to_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers FLUX transformer's state dict in the original layout (ComfyUI's map)."""
    blocks = {k.split(".")[1] for k in state if k.startswith("transformer_blocks.")}
    singles = {k.split(".")[1] for k in state if k.startswith("single_transformer_blocks.")}
    out = {}
    for i in blocks:
        s, d = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for end in ("weight", "bias"):
            out[f"{d}.img_attn.qkv.{end}"] = torch.cat(
                [state[f"{s}.attn.to_{x}.{end}"] for x in "qkv"]
            )
            out[f"{d}.txt_attn.qkv.{end}"] = torch.cat(
                [state[f"{s}.attn.add_{x}_proj.{end}"] for x in "qkv"]
            )
            out |= {f"{d}.{b}.{end}": state[f"{s}.{a}.{end}"] for a, b in _DOUBLE.items()}
        out |= {f"{d}.{b}": state[f"{s}.{a}"] for a, b in _DOUBLE_NORMS.items()}
    for i in singles:
        s, d = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for end in ("weight", "bias"):
            stacked = [state[f"{s}.attn.to_{x}.{end}"] for x in "qkv"]
            out[f"{d}.linear1.{end}"] = torch.cat([*stacked, state[f"{s}.proj_mlp.{end}"]])
            out |= {f"{d}.{b}.{end}": state[f"{s}.{a}.{end}"] for a, b in _SINGLE.items()}
        out |= {f"{d}.{b}": state[f"{s}.{a}"] for a, b in _SINGLE_NORMS.items()}
    for end in ("weight", "bias"):
        out |= {f"{b}.{end}": state[f"{a}.{end}"] for a, b in _BASIC.items()
                if f"{a}.{end}" in state}  # fmt: skip
        out[f"final_layer.adaLN_modulation.1.{end}"] = _swap(state[f"norm_out.linear.{end}"])
    return {f"{prefix}{key}": tensor.contiguous() for key, tensor in out.items()}


def flux_raw(tiny_raw: dict, **flux) -> dict:
    tiny_raw["model"] = {"family": "flux", "preset": "tiny", "init_seed": 1,
                         "flux": {"text_length": TEXT_LENGTH, **flux}}  # fmt: skip
    tiny_raw["objective"] = {"prediction_type": "flow"}
    return tiny_raw


def assert_same_weights(module: torch.nn.Module, other: torch.nn.Module) -> None:
    mine, theirs = module.state_dict(), other.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_an_original_layout_file_loads_the_same_transformer(tiny_raw, tmp_path, prefix):
    source = build_tiny(0, TEXT_LENGTH).transformer  # another seed than the preset's (1)
    file = tmp_path / "flux1-tiny.safetensors"
    save_file(to_original(source.state_dict(), prefix), str(file))
    backbone = build_backbone(build_config(flux_raw(tiny_raw, transformer=str(file))))
    assert_same_weights(backbone.denoiser(), source)
    preset = build_tiny(1, TEXT_LENGTH)
    assert_same_weights(backbone.components.text_encoder, preset.text_encoder)
    # fp8 / bf16 files load as float32
    save_file({k: v.to(torch.bfloat16) for k, v in to_original(source.state_dict()).items()},
              str(tmp_path / "bf16.safetensors"))  # fmt: skip
    raw = flux_raw(tiny_raw, transformer=str(tmp_path / "bf16.safetensors"))
    loaded = build_backbone(build_config(raw)).denoiser()
    for key, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor.to(torch.bfloat16).float()), key


def test_a_folder_takes_a_transformer_file_in_place_of_its_own(tiny_raw, tmp_path):
    folder_model = build_tiny(1, TEXT_LENGTH)
    save_flux_folder(folder_model, tmp_path / "flux")
    source = build_tiny(0, TEXT_LENGTH).transformer
    save_file(to_original(source.state_dict()), str(tmp_path / "t.safetensors"))
    raw = flux_raw(tiny_raw, transformer=str(tmp_path / "t.safetensors"))
    raw["model"] = {**raw["model"], "preset": None, "path": str(tmp_path / "flux")}
    backbone = build_backbone(build_config(raw))
    assert_same_weights(backbone.denoiser(), source)
    assert backbone.device == torch.device("cpu")  # built on meta, then given the file's
    assert_same_weights(backbone.components.text_encoder_2, folder_model.text_encoder_2)


def test_the_conversion_agrees_with_diffusers_converter_at_flux_width():
    """diffusers' converter knows FLUX.1's width only (3072); both on the meta device, a
    FLUX.1-dev-wide model of one block of each kind: the same names and shapes."""
    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    original = to_original(model.state_dict())
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    mine = from_original(original)
    assert mine.keys() == theirs.keys() == model.state_dict().keys()
    assert all(mine[key].shape == theirs[key].shape for key in mine)


def test_files_that_are_not_a_flux_transformer_are_one_line(tiny_raw, tmp_path):
    source = build_tiny(0, TEXT_LENGTH).transformer.state_dict()
    cases = {
        "other.safetensors": ({"w": torch.zeros(2)}, "neither a FLUX transformer's original"),
        "cut.safetensors": (
            {k: v for k, v in to_original(source).items() if "linear2" not in k},
            "original layout (no 'single_blocks.0.linear2.weight')",
        ),
        "wide.safetensors": (
            to_original(FluxTransformer2DModel.from_config(
                {**build_tiny(0, TEXT_LENGTH).transformer.config, "num_attention_heads": 4}
            ).state_dict()),
            "does not fit the transformer of model.path / model.preset",
        ),
    }  # fmt: skip
    for name, (tensors, message) in cases.items():
        save_file(tensors, str(tmp_path / name))
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            build_backbone(build_config(flux_raw(tiny_raw, transformer=str(tmp_path / name))))
        assert "\n" not in str(error.value) and "model.flux.transformer" in str(error.value)
