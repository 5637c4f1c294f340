"""LoRA weights in the kohya / sd-scripts layout that ComfyUI, A1111 and Forge load.

One entry per adapted layer, named from the original (SGM) module names with dots as
underscores: ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`` for the UNet,
``lora_te1_text_model_encoder_layers_0_self_attn_q_proj`` for CLIP-L and ``lora_te2_…`` for
OpenCLIP bigG (kohya names both encoders by their transformers modules). Each entry holds
``.lora_down.weight`` (peft's ``lora_A``), ``.lora_up.weight`` (``lora_B``) and a scalar
``.alpha``; a tool applies W + up·down·alpha/rank. Convolutions keep their 4-D kernels.

The names need only the UNet's config (its block layout), not its weights: an export renames
the adapter tensors of a checkpoint without building the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from impasto.models.single_file import clip_text_model_key, unet_module_to_sgm

PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
PEFT_TO_KOHYA = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}


def kohya_module_name(
    part: str, module_name: str, unet_config: Mapping[str, Any] | None = None
) -> str:
    """``lora_unet_…`` / ``lora_te1_…`` / ``lora_te2_…`` for a diffusers/transformers name;
    ``unet_config`` (the UNet's ``config``) is needed for UNet names only."""
    if part == "unet":
        if unet_config is None:
            raise ValueError("kohya names of UNet layers need the UNet's config")
        original = unet_module_to_sgm(module_name, unet_config)
    else:
        original = clip_text_model_key(module_name)
    return PREFIXES[part] + original.replace(".", "_")


def _config_of(part: str, module: nn.Module) -> Mapping[str, Any] | None:
    return module.config if part == "unet" else None


def to_kohya(
    part: str,
    peft_state: Mapping[str, Tensor],
    alpha: float,
    unet_config: Mapping[str, Any] | None = None,
) -> dict[str, Tensor]:
    """peft LoRA weights of one part (``get_peft_model_state_dict`` keys) → kohya entries."""
    kohya = {}
    for key, tensor in peft_state.items():
        module_name, _, suffix = key.partition(".lora_")
        suffix = "lora_" + suffix
        if suffix not in PEFT_TO_KOHYA:
            raise ValueError(
                f"export: {key} is not a plain LoRA weight; the kohya format holds LoRA only"
            )
        name = kohya_module_name(part, module_name, unet_config)
        kohya[f"{name}.{PEFT_TO_KOHYA[suffix]}"] = tensor
        kohya[f"{name}.alpha"] = torch.tensor(float(alpha))
    return kohya


def from_kohya(
    parts: dict[str, nn.Module], kohya: dict[str, Tensor], rank: int, alpha: float
) -> dict[str, dict[str, Tensor]]:
    """kohya entries → peft LoRA weights per part, for modules adapted with (rank, alpha).

    Every kohya entry must name an adapted module of ``parts``, and its alpha must equal
    ``alpha`` (a different scale cannot be expressed in one peft config); else ValueError.
    """
    names = {}
    for part, module in parts.items():
        for module_name, child in module.named_modules():
            if hasattr(child, "base_layer"):
                name = kohya_module_name(part, module_name, _config_of(part, module))
                names[name] = (part, module_name)
    states: dict[str, dict[str, Tensor]] = {part: {} for part in parts}
    inverse = {value: key for key, value in PEFT_TO_KOHYA.items()}
    for key, tensor in kohya.items():
        name, _, suffix = key.partition(".")
        if name not in names:
            raise ValueError(f"lora: {key} names no adapted layer of this model (lora.targets?)")
        part, module_name = names[name]
        if suffix == "alpha":
            if abs(float(tensor) - alpha) > 1e-6 * max(1.0, alpha):
                raise ValueError(
                    f"lora: {key} = {float(tensor)}, the config's lora.alpha is {alpha}"
                )
            continue
        if suffix not in inverse:
            raise ValueError(f"lora: {key}: unknown weight {suffix!r} (LoRA only)")
        if suffix == "lora_down.weight" and tensor.shape[0] != rank:
            raise ValueError(
                f"lora: {key} has rank {tensor.shape[0]}, the config's lora.rank is {rank}"
            )
        states[part][f"{module_name}.{inverse[suffix]}"] = tensor
    return states


def merge_kohya(models, kohya: dict[str, Tensor], scale: float = 1.0) -> int:
    """Add a kohya LoRA to the base weights in place: W += scale·up·down·alpha/rank per entry.

    ``models`` is an :class:`~impasto.models.SDXLComponents` without adapters. Convolution
    entries (4-D down [r, in, kh, kw], up [out, r, 1, 1]) merge as their matrix product.
    Returns the number of layers merged; an entry naming no layer is a ValueError.
    """
    layers = {}
    for part in PREFIXES:
        module = getattr(models, part)
        for name, child in module.named_modules():
            if isinstance(child, nn.Linear | nn.Conv2d):
                layers[kohya_module_name(part, name, _config_of(part, module))] = child
    names = {key.partition(".")[0] for key in kohya}
    unknown = sorted(names - set(layers))
    if unknown:
        raise ValueError(f"lora: {unknown[0]} names no layer of this SDXL model")
    for name in names:
        down, up = (
            kohya[f"{name}.lora_down.weight"].float(),
            kohya[f"{name}.lora_up.weight"].float(),
        )
        rank = down.shape[0]
        alpha = float(kohya[f"{name}.alpha"]) if f"{name}.alpha" in kohya else rank
        weight = layers[name].weight
        delta = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * (scale * alpha / rank)
        with torch.no_grad():
            weight += delta.to(weight.dtype)
    return len(names)
