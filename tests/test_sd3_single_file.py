"""An SD3.5 transformer from one file in the original layout (``model.sd3.transformer``, issue
#33): it loads to the same weights as the diffusers model it was written from, over a preset or
a diffusers folder's architecture, and the conversion agrees with diffusers' own converter.

The original-layout files here are written with ComfyUI's map (Comfy-Org/ComfyUI
``comfy/utils.py``, ``mmdit_to_diffusers`` with ``MMDIT_MAP_BASIC`` and ``MMDIT_MAP_BLOCK``:
diffusers name → original name, each attention's q/k/v stacked into ``qkv``, the final and the
last block's text modulations' halves swapped), the inverse of what impasto reads."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file

from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.sd3.components import build_tiny
from impasto.models.sd3.files import save_sd3_folder

TEXT_LENGTH = 16

_BASIC = {  # MMDIT_MAP_BASIC: original → diffusers (weights and biases, but pos_embed)
    "context_embedder": "context_embedder",
    "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "x_embedder.proj": "pos_embed.proj",
    "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
    "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
_BLOCK = {  # MMDIT_MAP_BLOCK: original → diffusers (weight and bias)
    "context_block.adaLN_modulation.1": "norm1_context.linear",
    "context_block.attn.proj": "attn.to_add_out",
    "context_block.mlp.fc1": "ff_context.net.0.proj",
    "context_block.mlp.fc2": "ff_context.net.2",
    "x_block.adaLN_modulation.1": "norm1.linear",
    "x_block.attn.proj": "attn.to_out.0",
    "x_block.attn2.proj": "attn2.to_out.0",
    "x_block.mlp.fc1": "ff.net.0.proj",
    "x_block.mlp.fc2": "ff.net.2",
}
_NORMS = {  # MMDIT_MAP_BLOCK's norms (weights only)
    "context_block.attn.ln_q": "attn.norm_added_q", "context_block.attn.ln_k": "attn.norm_added_k",
    "x_block.attn.ln_q": "attn.norm_q", "x_block.attn.ln_k": "attn.norm_k",
    "x_block.attn2.ln_q": "attn2.norm_q", "x_block.attn2.ln_k": "attn2.norm_k",
}  # fmt: skip
_QKV = {
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
}


def _swap(weight: torch.Tensor) -> torch.Tensor:  # ComfyUI's swap_scale_shift
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def to_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers SD3 transformer's state dict in the original layout (ComfyUI's map)."""
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    out = {f"{prefix}pos_embed": state["pos_embed.pos_embed"]}
    for end in ("weight", "bias"):
        for original, name in _BASIC.items():
            out[f"{prefix}{original}.{end}"] = state[f"{name}.{end}"]
        out[f"{prefix}final_layer.adaLN_modulation.1.{end}"] = _swap(
            state[f"norm_out.linear.{end}"]
        )
        for i in range(depth):
            block, target = f"transformer_blocks.{i}", f"{prefix}joint_blocks.{i}"
            for original, name in _BLOCK.items():
                if f"{block}.{name}.{end}" in state:
                    tensor = state[f"{block}.{name}.{end}"]
                    if i == depth - 1 and name == "norm1_context.linear":
                        tensor = _swap(tensor)
                    out[f"{target}.{original}.{end}"] = tensor
            for fused, names in _QKV.items():
                if f"{block}.{names[0]}.{end}" in state:
                    pieces = [state[f"{block}.{name}.{end}"] for name in names]
                    out[f"{target}.{fused}.{end}"] = torch.cat(pieces)
    for i in range(depth):
        for original, name in _NORMS.items():
            if f"transformer_blocks.{i}.{name}.weight" in state:
                tensor = state[f"transformer_blocks.{i}.{name}.weight"]
                out[f"{prefix}joint_blocks.{i}.{original}.weight"] = tensor
    assert sum(t.numel() for t in out.values()) == sum(t.numel() for t in state.values())
    return out


def other_transformer() -> dict[str, torch.Tensor]:
    """A transformer of the tiny architecture with other weights (seed 1) than the preset's."""
    return {
        key: tensor.clone()
        for key, tensor in build_tiny(1, TEXT_LENGTH).transformer.state_dict().items()
    }


def sd3_config(tiny_raw: dict, **model):
    tiny_raw["model"] = {"family": "sd3", "sd3": {"text_length": TEXT_LENGTH}, **model}
    tiny_raw["objective"] = {"prediction_type": "flow", "flow_shift": 3.0}
    return build_config(tiny_raw)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_an_original_layout_file_loads_the_same_transformer(tiny_raw, tmp_path, prefix):
    want = other_transformer()
    file = tmp_path / "sd3.5_tiny.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in to_original(want, prefix).items()}, str(file))
    options = {"text_length": TEXT_LENGTH, "transformer": str(file)}
    backbone = build_backbone(sd3_config(tiny_raw, preset="tiny", sd3=options))
    got = backbone.denoiser().state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():  # bf16 in the file, float32 in the model
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], tensor.to(torch.bfloat16).float()), key


def test_the_conversion_agrees_with_diffusers_converter(tmp_path):
    """diffusers' converter reads the file written with ComfyUI's map back to the diffusers
    state dict, tensor for tensor: the test's writer is the layout both tools read."""
    from impasto.models.sd3.single_file import read_transformer_file

    want = other_transformer()
    original = to_original(want, "model.diffusion_model.")
    theirs = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
    file = tmp_path / "t.safetensors"
    save_file(original, str(file))
    ours = read_transformer_file(file)
    assert theirs.keys() == ours.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(theirs[key], tensor) and torch.equal(ours[key], tensor), key


def test_a_folder_takes_a_transformer_file_in_place_of_its_own(tiny_raw, tmp_path):
    save_sd3_folder(build_tiny(0, TEXT_LENGTH), tmp_path / "folder")
    want = other_transformer()
    file = tmp_path / "t.safetensors"
    # an all-in-one checkpoint: the transformer under its prefix, and other networks' tensors
    extra = {
        "text_encoders.clip_l.transformer.x": torch.ones(2),
        "first_stage_model.y": torch.ones(1),
    }
    save_file(to_original(want, "model.diffusion_model.") | extra, str(file))
    options = {"text_length": TEXT_LENGTH, "transformer": str(file)}
    backbone = build_backbone(sd3_config(tiny_raw, path=str(tmp_path / "folder"), sd3=options))
    got = backbone.denoiser().state_dict()
    assert all(torch.equal(got[key], tensor) for key, tensor in want.items())
    assert not any(t.is_meta for t in backbone.denoiser().parameters())


def test_files_that_are_not_an_sd3_transformer_are_one_line(tiny_raw, tmp_path):
    original = to_original(other_transformer())
    cases = {
        "missing.safetensors": (None, "does not exist"),
        "vae.safetensors": ({"decoder.conv_in.weight": torch.ones(1)}, "neither an SD3"),
        "partial.safetensors": (
            {k: v for k, v in original.items() if "joint_blocks.1.x_block.mlp" not in k},
            "not a whole SD3 transformer in the original layout (no 'joint_blocks.1.x_block.mlp",
        ),
        "extra.safetensors": (
            original | {"joint_blocks.0.x_block.scale_weight": torch.ones(1)},
            "a tensor the SD3 transformer does not have: 'joint_blocks.0.x_block.scale_weight'",
        ),
        "wide.safetensors": (
            to_original(
                {
                    k: torch.cat([v, v]) if k == "proj_out.bias" else v
                    for k, v in other_transformer().items()
                }  # fmt: skip
            ),
            "does not fit the transformer of model.path / model.preset ('proj_out.bias' of shape",
        ),
    }
    for name, (tensors, message) in cases.items():
        file = tmp_path / name
        if tensors is not None:
            save_file(tensors, str(file))
        options = {"text_length": TEXT_LENGTH, "transformer": str(file)}
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            build_backbone(sd3_config(tiny_raw, preset="tiny", sd3=options))
        assert str(error.value).startswith(f"model.sd3.transformer {file}")
        assert "\n" not in str(error.value)


def test_the_inverse_map_writes_comfyuis_layout():
    from impasto.models.sd3.single_file import from_original
    from impasto.models.sd3.single_file import to_original as ours

    state = other_transformer()
    written = ours(state, "model.diffusion_model.")
    comfy = to_original(state, "model.diffusion_model.")
    assert written.keys() == comfy.keys()
    assert all(torch.equal(written[key], tensor) for key, tensor in comfy.items())
    back = from_original(ours(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_a_full_fine_tune_exports_the_original_single_file(tiny_raw, tmp_path):
    from impasto.checkpoint.trained import load_trained
    from impasto.export import ExportOptions, export_checkpoint
    from impasto.train.trainer import train

    tiny_raw["model"] = {"family": "sd3", "preset": "tiny", "sd3": {"text_length": TEXT_LENGTH}}
    tiny_raw["objective"] = {"prediction_type": "flow", "flow_shift": 3.0}
    tiny_raw["data"]["batch_size"] = 2
    tiny_raw["train"]["max_steps"] = 2
    tiny_raw["checkpoint"]["every_steps"] = 2
    tiny_raw["parts"] = {"transformer": "full"}
    result = train(build_config(tiny_raw))
    file = export_checkpoint(
        result.run_dir, "single-file", tmp_path / "sd3_tuned.safetensors", ExportOptions("fp32")
    )
    _, backbone = load_trained(result.last_checkpoint)
    want = backbone.denoiser().state_dict()
    assert not torch.equal(want["proj_out.weight"], build_tiny(0, 16).transformer.proj_out.weight)
    from safetensors.torch import load_file

    stored = load_file(str(file))
    assert all(key.startswith("model.diffusion_model.") for key in stored)
    assert "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight" in stored
    theirs = convert_sd3_transformer_checkpoint_to_diffusers(stored)
    assert theirs.keys() == want.keys()
    assert all(torch.equal(theirs[key], tensor) for key, tensor in want.items())
    with pytest.raises(ValueError, match=r"export --out .*: the single file needs a \.safetensors"):
        export_checkpoint(result.run_dir, "single-file", tmp_path / "folder", ExportOptions("fp32"))
