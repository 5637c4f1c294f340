"""Exporting a Wan 2.1 LoRA, from Python (:func:`save_wan_lora`, a trained backbone) or from
``impasto export RUN --format lora-diffusers | lora-comfyui | lora-kohya``
(:data:`LORA_EXPORTS`, the checkpoint's adapters, un-merged, through
:mod:`impasto.export.family`):

- ``lora-diffusers``: the diffusers/PEFT layout (``OUT/pytorch_lora_weights.safetensors``,
  ``transformer.blocks.N.attn1.to_q.lora_A.weight`` ...), written by diffusers' own
  ``WanPipeline.save_lora_weights``, which ``WanPipeline.load_lora_weights`` loads;
- ``lora-comfyui``: one ``.safetensors`` in Wan's original module names under
  ``diffusion_model.`` (``diffusion_model.blocks.N.self_attn.q.lora_A.weight``, ``cross_attn``,
  ``ffn.0`` / ``ffn.2``), the layout diffusion-pipe writes: ComfyUI's LoRA loader maps every
  key (``comfy/lora.py``, ``model_lora_keys_unet``'s generic map: ``diffusion_model.<name>``
  for each weight ``diffusion_model.<name>.weight`` of the model; it maps no key of the
  diffusers layout for Wan), and ``WanPipeline.load_lora_weights`` converts it too;
- ``lora-kohya``: one ``.safetensors`` in musubi-tuner's (kohya's) layout,
  ``lora_unet_blocks_N_self_attn_q.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``
  (the original name with "_" for "."): ComfyUI maps ``lora_unet_<name>`` for every weight of
  the model (the same generic map) and applies alpha/rank, and diffusers converts it
  (``_convert_musubi_wan_lora_to_diffusers``, for LoRA on every linear layer of the blocks).

The first two fold the LoRA scale alpha/rank into the ``lora_B`` weights (the saved LoRA
config's alpha set to its rank; no ``.alpha`` tensor), as the FLUX and SD3 exports do, so
every loader applies the trained strength; ``lora-kohya`` keeps the weights as trained and the
run's alpha beside them, as musubi-tuner writes them. Kinds other than plain LoRA (DoRA, LoHa,
LoKr) are refused with one line. ``lora-diffusers`` and the checks are the steps every
transformer family shares (:mod:`impasto.models.transformer_lora`); this module holds Wan's
names, header values and the two single-file layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from impasto.models.single_file.stream import write_safetensors
from impasto.models.transformer_lora import (
    OriginalLayer,
    TransformerLora,
    check_exported,
    fold_scale,
    lora_exports,
    lora_scale,
    save_lora,
    to_kohya_layers,
)
from impasto.models.wan.backbone import WanBackbone

EXPORTED_PARTS = ("transformer",)  # umT5 trains frozen only
KOHYA_NETWORK_MODULE = "networks.lora_wan"  # musubi-tuner's Wan LoRA module
IMPLEMENTATION = "https://github.com/Wan-Video/Wan2.1"

# diffusers' module name inside a block → Wan's original (Wan-AI's wan/modules/model.py,
# ComfyUI's comfy/ldm/wan/model.py), for the layers a LoRA adapts
ORIGINAL_LAYERS = {
    **{f"attn1.{ours}": f"self_attn.{theirs}" for ours, theirs in
       (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))},
    **{f"attn2.{ours}": f"cross_attn.{theirs}" for ours, theirs in
       (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))},
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}  # fmt: skip


def save_wan_lora(backbone: WanBackbone, out: str | Path) -> Path:
    """Write the transformer's adapter to the folder ``out`` in diffusers' Wan LoRA layout;
    returns the weights file."""
    return save_lora(backbone.parts(), out, LORA)


def original_module(module: str) -> str:
    """A diffusers module of the transformer's blocks (``blocks.0.attn1.to_q``) → Wan's
    original (``blocks.0.self_attn.q``)."""
    blocks, _, rest = module.partition(".")
    index, _, layer = rest.partition(".")
    if blocks != "blocks" or layer not in ORIGINAL_LAYERS:
        raise ValueError(
            f"export: {module} is not a plain LoRA weight of a Wan block's linear layer"
        )
    return f"blocks.{index}.{ORIGINAL_LAYERS[layer]}"


def original_key(key: str) -> str:
    """A peft key of the transformer (``blocks.0.attn1.to_q.lora_A.weight``) → Wan's original
    name under ``diffusion_model.`` (``diffusion_model.blocks.0.self_attn.q.lora_A.weight``)."""
    module, _, suffix = key.partition(".lora_")
    if suffix not in ("A.weight", "B.weight"):
        raise ValueError(f"export: {key} is not a plain LoRA weight of a Wan block's linear layer")
    return f"diffusion_model.{original_module(module)}.lora_{suffix}"


def to_comfyui(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The transformer's LoRA weights (scale folded in) → the ``lora-comfyui`` entries."""
    return {original_key(key): tensor.contiguous() for key, tensor in state.items()}


def to_kohya(state: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """The transformer's LoRA weights (unscaled) → the ``lora-kohya`` entries: musubi-tuner's
    ``lora_unet_<original name, "." as "_">`` with ``.lora_down.weight`` (A),
    ``.lora_up.weight`` (B) and the run's ``.alpha`` (Wan fuses no layers)."""
    return to_kohya_layers(state, alpha, lambda module: OriginalLayer(original_module(module), ""))


# -- impasto export --format lora-* (FamilySpec.lora_exports) --------------------------------
def wan_metadata(config: Any, metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` (an SDXL-shaped LoRA header) with Wan's values."""
    return {
        **metadata,
        "modelspec.architecture": "wan-2.1-t2v/lora",
        "modelspec.implementation": IMPLEMENTATION,
        "ss_base_model_version": "wan21",
        "ss_network_module": KOHYA_NETWORK_MODULE,
        "ss_discrete_flow_shift": repr(float(config.objective.flow_shift)),
        "ss_model_prediction_type": "raw",
    }


LORA = TransformerLora(
    family="wan", parts=EXPORTED_PARTS, pipeline="WanPipeline", header=wan_metadata
)  # its kohya layout (musubi-tuner's) is written below: unscaled weights, its own header


def _one_file(out: Path, layout: str) -> Path:
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"export: {out}: a {layout} LoRA is one file; give a .safetensors name")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def write_lora_comfyui(
    config: Any, states: dict[str, dict[str, Tensor]], out: Path, dtype: torch.dtype,
    metadata: dict[str, str],
) -> Path:  # fmt: skip
    """``impasto export --format lora-comfyui``: one ``.safetensors`` (module docstring)."""
    out = _one_file(out, "ComfyUI")
    check_exported(states, LORA)
    rank, alpha = lora_scale(config)
    header = {**wan_metadata(config, metadata), "impasto.lora_alpha_in_weights": "true"}
    entries = to_comfyui(fold_scale(states["transformer"], alpha / rank))
    write_safetensors(out, entries, dtype=dtype, metadata=header)
    return out


def write_lora_kohya(
    config: Any, states: dict[str, dict[str, Tensor]], out: Path, dtype: torch.dtype,
    metadata: dict[str, str],
) -> Path:  # fmt: skip
    """``impasto export --format lora-kohya``: one ``.safetensors`` (module docstring)."""
    out = _one_file(out, "kohya")
    check_exported(states, LORA)
    _, alpha = lora_scale(config)
    header = {**wan_metadata(config, metadata), "impasto.lora_alpha_in_weights": "false"}
    write_safetensors(out, to_kohya(states["transformer"], alpha), dtype=dtype, metadata=header)
    return out


LORA_EXPORTS = {
    **lora_exports(LORA),
    "lora-comfyui": write_lora_comfyui,
    "lora-kohya": write_lora_kohya,
}
"""``impasto export --format`` → writer of a Wan LoRA run's adapters."""
