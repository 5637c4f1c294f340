"""Names of the SDXL networks' tensors in the original SGM layout, derived from the configs.

The single-file layout is the state dict of Stability AI's ``generative-models`` (SGM)
``DiffusionEngine`` for ``sd_xl_base.yaml``, which A1111, ComfyUI and Forge read:

- UNet ``model.diffusion_model.``: ``openaimodel.UNetModel`` (``input_blocks`` / ``middle_block``
  / ``output_blocks`` / ``time_embed`` / ``label_emb`` / ``out``); the transformer blocks inside
  carry the same names in SGM and diffusers.
- VAE ``first_stage_model.``: the LDM ``Encoder`` / ``Decoder``, whose mid-block attention
  ``q`` / ``k`` / ``v`` / ``proj_out`` are 1x1 convolutions (weights ``[C, C, 1, 1]``).
- CLIP ViT-L ``conditioner.embedders.0.transformer.``: a transformers ``CLIPTextModel``.
- OpenCLIP ViT-bigG ``conditioner.embedders.1.model.``: open_clip's text tower, with q/k/v
  packed into ``in_proj_weight`` and ``text_projection`` stored ``[width, embed_dim]`` (it is
  applied as ``x @ text_projection``, the transpose of transformers' Linear weight).

Every index is computed from the diffusers config (number of blocks, layers per block, which
blocks have attention), so any SDXL-shaped UNet maps, not only the released one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from impasto.models.components import SDXLComponents

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
CLIP_G_PREFIX = "conditioner.embedders.1.model."
# Tensors of sd_xl_base_1.0.safetensors that the diffusers modules do not hold. Written on export
# because A1111 and merge tools expect them; optional on import.
CLIP_L_POSITION_IDS = CLIP_L_PREFIX + "text_model.embeddings.position_ids"  # int64 [1, 77]
CLIP_G_LOGIT_SCALE = CLIP_G_PREFIX + "logit_scale"  # scalar, only used by CLIP's image-text loss
SDXL_LOGIT_SCALE = 4.6055  # its value in sd_xl_base_1.0 (~ln 100, open_clip's clamp)
OPTIONAL_KEYS = frozenset({CLIP_L_POSITION_IDS, CLIP_G_LOGIT_SCALE})

# Segments that torch.compile, DDP, FSDP and activation checkpointing insert into module names.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}


@dataclass(frozen=True)
class _Rename:
    """A diffusers module prefix's SGM name, and renames of its children (first segments)."""

    target: str
    children: Mapping[str, str] = field(default_factory=dict)


def _rename(name: str, table: Mapping[str, _Rename]) -> str | None:
    """Map ``name`` by its longest prefix in ``table``; ``None`` if no prefix matches."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        rename = table.get(".".join(parts[:end]))
        if rename is None:
            continue
        rest = ".".join(parts[end:])
        for child, sgm_child in rename.children.items():
            if rest == child or rest.startswith(child + "."):
                rest = sgm_child + rest[len(child) :]
                break
        return f"{rename.target}.{rest}" if rest else rename.target
    return None


def _per_block(value: int | list[int] | tuple[int, ...], num_blocks: int) -> list[int]:
    return [value] * num_blocks if isinstance(value, int) else list(value)


def _unet_table(config: Mapping[str, Any]) -> dict[str, _Rename]:
    """diffusers module prefix -> SGM ``UNetModel`` name, for the UNet described by ``config``."""
    num_blocks = len(config["block_out_channels"])
    layers = _per_block(config["layers_per_block"], num_blocks)
    table = {
        "conv_in": _Rename("input_blocks.0.0"),
        "time_embedding.linear_1": _Rename("time_embed.0"),
        "time_embedding.linear_2": _Rename("time_embed.2"),
        # SGM's `label_emb` is the Sequential(Linear, SiLU, Linear) of the size/pooled-text vector.
        "add_embedding.linear_1": _Rename("label_emb.0.0"),
        "add_embedding.linear_2": _Rename("label_emb.0.2"),
        "conv_norm_out": _Rename("out.0"),
        "conv_out": _Rename("out.2"),
        "mid_block.resnets.0": _Rename("middle_block.0", _UNET_RESNET),
    }
    # input_blocks: [conv_in] + per down block (ResBlock [+ SpatialTransformer]) x layers,
    # then a Downsample except after the last block.
    index = 1
    for block, block_type in enumerate(config["down_block_types"]):
        for layer in range(layers[block]):
            down = f"down_blocks.{block}"
            table[f"{down}.resnets.{layer}"] = _Rename(f"input_blocks.{index}.0", _UNET_RESNET)
            if "CrossAttn" in block_type:
                table[f"{down}.attentions.{layer}"] = _Rename(f"input_blocks.{index}.1")
            index += 1
        if block < num_blocks - 1:
            table[f"down_blocks.{block}.downsamplers.0.conv"] = _Rename(
                f"input_blocks.{index}.0.op"
            )
            index += 1
    # middle_block: ResBlock, SpatialTransformer, ResBlock (diffusers builds one mid transformer).
    table["mid_block.attentions.0"] = _Rename("middle_block.1")
    table["mid_block.resnets.1"] = _Rename("middle_block.2", _UNET_RESNET)
    # output_blocks: per up block (ResBlock [+ SpatialTransformer]) x (layers + 1), the last of
    # which also holds the Upsample (after the transformer if there is one).
    index = 0
    for block, block_type in enumerate(config["up_block_types"]):
        num_layers = layers[num_blocks - 1 - block] + 1
        has_attention = "CrossAttn" in block_type
        for layer in range(num_layers):
            up = f"up_blocks.{block}"
            table[f"{up}.resnets.{layer}"] = _Rename(f"output_blocks.{index}.0", _UNET_RESNET)
            if has_attention:
                table[f"{up}.attentions.{layer}"] = _Rename(f"output_blocks.{index}.1")
            index += 1
        if block < num_blocks - 1:
            upsample = f"output_blocks.{index - 1}.{2 if has_attention else 1}.conv"
            table[f"up_blocks.{block}.upsamplers.0.conv"] = _Rename(upsample)
    return table


def unet_module_to_sgm(diffusers_module_name: str, unet_config: Mapping[str, Any]) -> str:
    """SGM name of a diffusers UNet module or parameter, e.g. for SDXL
    ``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`` ->
    ``input_blocks.4.1.transformer_blocks.0.attn1.to_q`` and ``mid_block.resnets.1.conv1.weight``
    -> ``middle_block.2.in_layers.2.weight``. kohya LoRA names are ``"lora_unet_"`` + this with
    dots as underscores. ``unet_config`` is ``unet.config`` (or any mapping with its keys).
    """
    sgm_name = _rename(diffusers_module_name, _unet_table(unet_config))
    if sgm_name is None:
        raise ValueError(f"{diffusers_module_name!r} is not a module of an SDXL-style UNet")
    return sgm_name


def _vae_table(config: Mapping[str, Any]) -> dict[str, _Rename]:
    """diffusers ``AutoencoderKL`` module prefix -> LDM ``Encoder`` / ``Decoder`` name."""
    num_blocks = len(config["block_out_channels"])
    table = {
        "quant_conv": _Rename("quant_conv"),
        "post_quant_conv": _Rename("post_quant_conv"),
    }
    for coder in ("encoder", "decoder"):
        table[f"{coder}.conv_in"] = _Rename(f"{coder}.conv_in")
        table[f"{coder}.conv_norm_out"] = _Rename(f"{coder}.norm_out")
        table[f"{coder}.conv_out"] = _Rename(f"{coder}.conv_out")
        table[f"{coder}.mid_block.attentions.0"] = _Rename(f"{coder}.mid.attn_1", _VAE_ATTENTION)
        for layer in range(2):
            table[f"{coder}.mid_block.resnets.{layer}"] = _Rename(
                f"{coder}.mid.block_{layer + 1}", _VAE_RESNET
            )
    num_encoder_layers = config["layers_per_block"]  # the decoder has one more per level
    for block in range(num_blocks):
        # The LDM decoder numbers its levels from the lowest resolution up: up.{n-1} runs first.
        level = num_blocks - 1 - block
        for layer in range(num_encoder_layers):
            table[f"encoder.down_blocks.{block}.resnets.{layer}"] = _Rename(
                f"encoder.down.{block}.block.{layer}", _VAE_RESNET
            )
        for layer in range(num_encoder_layers + 1):
            table[f"decoder.up_blocks.{block}.resnets.{layer}"] = _Rename(
                f"decoder.up.{level}.block.{layer}", _VAE_RESNET
            )
        table[f"encoder.down_blocks.{block}.downsamplers.0.conv"] = _Rename(
            f"encoder.down.{block}.downsample.conv"
        )
        table[f"decoder.up_blocks.{block}.upsamplers.0.conv"] = _Rename(
            f"decoder.up.{level}.upsample.conv"
        )
    return table


def clean_key(key: str) -> str:
    """``key`` without the segments that torch.compile, DDP, FSDP or checkpoint wrappers add."""
    for segment in _WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    return key.removeprefix("module.")


def clip_text_model_key(key: str) -> str:
    """A CLIP text-encoder key with the ``text_model.`` level that transformers >= 5 dropped from
    ``CLIPTextModel`` (4.x, SGM files and kohya LoRA names have it)."""
    return key if key.startswith(("text_model.", "text_projection.")) else f"text_model.{key}"


def _clean_state_dict(module: torch.nn.Module, component: str) -> dict[str, Tensor]:
    state = {}
    for key, tensor in module.state_dict().items():
        key = clean_key(key)
        if ".base_layer." in key or ".lora_" in key:
            raise ValueError(
                f"the {component} has LoRA layers ({key}): merge them into the weights first "
                "(peft's merge_and_unload) or export the LoRA on its own"
            )
        state[key] = tensor
    return state


def _renamed(
    state: Mapping[str, Tensor], table: Mapping[str, _Rename], prefix: str, component: str
) -> dict[str, Tensor]:
    renamed = {}
    for key, tensor in state.items():
        sgm_key = _rename(key, table)
        if sgm_key is None:
            raise ValueError(f"the {component} tensor {key} has no name in the SGM layout")
        if prefix + sgm_key in renamed:
            raise ValueError(f"two {component} tensors map to {prefix + sgm_key}")
        renamed[prefix + sgm_key] = tensor
    return renamed


def _unet_sgm(unet: torch.nn.Module) -> dict[str, Tensor]:
    state = _clean_state_dict(unet, "UNet")
    return _renamed(state, _unet_table(unet.config), UNET_PREFIX, "UNet")


def _vae_sgm(vae: torch.nn.Module) -> dict[str, Tensor]:
    renamed = _renamed(_clean_state_dict(vae, "VAE"), _vae_table(vae.config), VAE_PREFIX, "VAE")
    for key, tensor in renamed.items():
        # LDM's attention projections are Conv2d(C, C, 1): Linear [C, C] -> [C, C, 1, 1].
        if ".mid.attn_1." in key and key.endswith(".weight") and tensor.ndim == 2:
            renamed[key] = tensor[:, :, None, None]
    return renamed


def _clip_l_sgm(text_encoder: torch.nn.Module) -> dict[str, Tensor]:
    state = {
        clip_text_model_key(k): v
        for k, v in _clean_state_dict(text_encoder, "text encoder").items()
    }
    num_positions = text_encoder.config.max_position_embeddings
    token_embedding = state["text_model.embeddings.token_embedding.weight"]
    state["text_model.embeddings.position_ids"] = torch.arange(
        num_positions, device=token_embedding.device
    )[None]
    return {CLIP_L_PREFIX + key: tensor for key, tensor in state.items()}


def _clip_g_sgm(text_encoder_2: torch.nn.Module) -> dict[str, Tensor]:
    """transformers ``CLIPTextModelWithProjection`` -> open_clip text tower (``CLIP_G_PREFIX``)."""
    state = {
        clip_text_model_key(k): v
        for k, v in _clean_state_dict(text_encoder_2, "text encoder 2").items()
    }
    state.pop("text_model.embeddings.position_ids", None)  # persistent in transformers < 4.31
    sgm = {
        "token_embedding.weight": state.pop("text_model.embeddings.token_embedding.weight"),
        "positional_embedding": state.pop("text_model.embeddings.position_embedding.weight"),
        "ln_final.weight": state.pop("text_model.final_layer_norm.weight"),
        "ln_final.bias": state.pop("text_model.final_layer_norm.bias"),
        # Linear weight [embed_dim, width]; open_clip computes x @ proj, proj [width, embed_dim].
        "text_projection": state.pop("text_projection.weight").T.contiguous(),
    }
    sgm["logit_scale"] = torch.tensor(SDXL_LOGIT_SCALE, device=sgm["ln_final.weight"].device)
    for layer in range(text_encoder_2.config.num_hidden_layers):
        src, dst = f"text_model.encoder.layers.{layer}.", f"transformer.resblocks.{layer}."
        for kind in ("weight", "bias"):
            # nn.MultiheadAttention packs the three input projections as [3 * width, width].
            sgm[f"{dst}attn.in_proj_{kind}"] = torch.cat(
                [state.pop(f"{src}self_attn.{proj}_proj.{kind}") for proj in "qkv"]
            )
            for diffusers_name, open_clip_name in (
                ("self_attn.out_proj", "attn.out_proj"),
                ("layer_norm1", "ln_1"),
                ("layer_norm2", "ln_2"),
                ("mlp.fc1", "mlp.c_fc"),
                ("mlp.fc2", "mlp.c_proj"),
            ):
                sgm[f"{dst}{open_clip_name}.{kind}"] = state.pop(f"{src}{diffusers_name}.{kind}")
    if state:
        raise ValueError(
            f"the text encoder 2 tensor {next(iter(state))} has no name in the open_clip layout"
        )
    return {CLIP_G_PREFIX + key: tensor for key, tensor in sgm.items()}


def sgm_state_dict(components: SDXLComponents) -> dict[str, Tensor]:
    """The four networks' tensors under their single-file (SGM) names, in the modules' dtype.

    Tensors are the modules' own (views where a reshape suffices), except the packed q/k/v and
    the transposed ``text_projection``; meta-device modules give meta tensors, so the key map
    of the full SDXL can be checked without allocating it. Includes CLIP-L's ``position_ids``
    and OpenCLIP's ``logit_scale``, which the released ``sd_xl_base_1.0`` file has.
    """
    return {
        **_unet_sgm(components.unet),
        **_vae_sgm(components.vae),
        **_clip_l_sgm(components.text_encoder),
        **_clip_g_sgm(components.text_encoder_2),
    }
