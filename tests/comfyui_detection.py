"""How ComfyUI tells which model a diffusion-model file holds (its ``UNETLoader``, the files of
``models/diffusion_models/``), for the FLUX.1 and Wan 2.1 single-file exports (issue #33).

ComfyUI is not a dependency, so the steps are reimplemented here from Comfy-Org/ComfyUI
``comfy/sd.py`` (``load_diffusion_model_state_dict``: take off the prefix that
``unet_prefix_from_state_dict`` finds, then ``model_config_from_unet(sd, "")``) and
``comfy/model_detection.py`` (``detect_unet_config``: the first branch whose marker tensor the
file holds decides the model; the FLUX.1 and Wan 2.1 branches, and the markers of the branches
checked before them, which must not fire) and ``comfy/supported_models.py`` (the first class
whose ``unet_config`` items all match: ``Flux``, ``FluxSchnell``, ``WAN21_T2V``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# detect_unet_config's markers of the models it checks before FLUX.1 (mmdit, Stable Cascade,
# trellis2, Stable Audio, AuraFlow, Hunyuan DiT, Hunyuan Video), then, after FLUX, before Wan
BEFORE_FLUX = (
    "joint_blocks.0.context_block.attn.qkv.weight", "clf.1.weight",
    "img2shape.t_embedder.mlp.0.weight", "shape2txt.t_embedder.mlp.0.weight",
    "transformer.rotary_pos_emb.inv_freq", "double_layers.0.attn.w1q.weight",
    "mlp_t5.0.weight", "txt_in.individual_token_refiner.blocks.0.norm1.weight",
)  # fmt: skip
BEFORE_WAN = (
    "t5_yproj.weight", "video_patch_proj.weight",
    "adaln_single.emb.timestep_embedder.linear_1.bias", "genre_embedder.weight",
    "t_block.1.weight", "blocks.block0.blocks.0.block.attn.to_q.0.weight",
    "lq_proj.latent_proj.0.weight", "core.pixel_embedder.proj.weight", "cap_embedder.1.weight",
    "blocks.0.norm1.linear.weight", "blocks.35.mlp.vid.proj_out.weight",
    "blocks.35.mlp.all.proj_in_gate.weight", "blocks.31.mlp.all.proj_in_gate.weight",
)  # fmt: skip
WAN_OTHER_TYPES = (  # Wan branch: markers of VACE, camera, s2v, humo, animate, scail, ...
    "vace_patch_embedding.weight", "control_adapter.conv.weight",
    "casual_audio_encoder.encoder.final_linear.weight",
    "audio_proj.audio_proj_glob_1.layer.bias", "face_adapter.fuser_blocks.0.k_norm.weight",
    "patch_embedding_mask.weight", "patch_embedding_pose.weight",
    "patch_embedding_global.weight",
)  # fmt: skip
SUPPORTED_MODELS = (  # supported_models.models, in order, as far as these files reach
    ("Flux", {"image_model": "flux", "guidance_embed": True}),
    ("FluxInpaint", {"image_model": "flux", "guidance_embed": True, "in_channels": 96}),
    ("FluxSchnell", {"image_model": "flux", "guidance_embed": False}),
    ("WAN21_T2V", {"image_model": "wan2.1", "model_type": "t2v"}),
)


def count_blocks(keys: list[str], prefix_string: str) -> int:
    """model_detection.count_blocks: consecutive indices from 0 with some key under them."""
    count = 0
    while any(key.startswith(prefix_string.format(count)) for key in keys):
        count += 1
    return count


def unet_prefix(state: Mapping[str, Any]) -> str:
    """model_detection.unet_prefix_from_state_dict."""
    for prefix in ("model.diffusion_model.", "net."):
        if sum(1 for key in state if key.startswith(prefix)) > 5:
            return prefix
    return "model."


def _flux(state: Mapping[str, Any], keys: list[str]) -> dict[str, Any]:
    """The FLUX.1 branch (not FLUX.2, not Chroma: neither marker is in a FLUX.1 file)."""
    config: dict[str, Any] = {
        "image_model": "flux", "axes_dim": [16, 56, 56], "patch_size": 2, "in_channels": 16,
        "hidden_size": 3072, "context_in_dim": 4096,
    }  # fmt: skip
    assert "double_stream_modulation_img.lin.weight" not in keys
    if "img_in.weight" in keys:
        config["in_channels"] = state["img_in.weight"].shape[1] // 4
        config["hidden_size"] = state["img_in.weight"].shape[0]
    if "txt_in.weight" in keys:
        config["context_in_dim"] = state["txt_in.weight"].shape[1]
        config["hidden_size"] = state["txt_in.weight"].shape[0]
    vector = "vector_in.in_layer.weight"
    config["vec_in_dim"] = state[vector].shape[1] if vector in keys else None
    config["depth"] = count_blocks(keys, "double_blocks.{}.")
    config["depth_single_blocks"] = count_blocks(keys, "single_blocks.{}.")
    assert not any(key.startswith("distilled_guidance_layer.") for key in keys)  # Chroma
    config["guidance_embed"] = "guidance_in.in_layer.weight" in keys
    return config


def _wan(state: Mapping[str, Any], keys: list[str]) -> dict[str, Any]:
    """The Wan 2.1 branch, text-to-video or image-to-video."""
    assert not any(marker in keys for marker in WAN_OTHER_TYPES)
    return {
        "image_model": "wan2.1",
        "dim": state["head.modulation"].shape[-1],
        "out_dim": state["head.head.weight"].shape[0] // 4,
        "ffn_dim": state["blocks.0.ffn.0.weight"].shape[0],
        "num_layers": count_blocks(keys, "blocks.{}."),
        "in_dim": state["patch_embedding.weight"].shape[1],
        "model_type": "i2v" if "img_emb.proj.0.bias" in keys else "t2v",
    }


def detect(state: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``(supported model class, unet config)`` ComfyUI's diffusion-model loader picks for the
    file's tensors ``state`` (name → tensor or anything with ``.shape``); None: no match."""
    prefix = unet_prefix(state)
    stripped = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    state = stripped or dict(state)
    keys = list(state)
    if any(marker in keys for marker in BEFORE_FLUX):
        return None
    flux = any(
        f"double_blocks.0.img_attn.norm.key_norm.{end}" in keys for end in ("weight", "scale")
    )
    if flux and "img_in.weight" in keys:
        config = _flux(state, keys)
    elif any(marker in keys for marker in BEFORE_WAN) or "head.modulation" not in keys:
        return None
    else:
        config = _wan(state, keys)
    for name, wanted in SUPPORTED_MODELS:
        if all(config.get(key) == value for key, value in wanted.items()):
            return name, config
    return None
