"""Exporting a FLUX LoRA, from Python (:func:`save_flux_lora`, a trained backbone) or from
``impasto export RUN --format lora-diffusers | lora-kohya`` (:data:`LORA_EXPORTS`, the
checkpoint's adapters, un-merged, through :mod:`impasto.export.family`):

- ``lora-diffusers``: the diffusers/PEFT layout (``OUT/pytorch_lora_weights.safetensors``),
  which both ``FluxPipeline.load_lora_weights`` and ComfyUI's LoRA loader map
  (``comfy/lora.py``: ``transformer.<diffusers name>`` for FLUX, and
  ``text_encoder.text_model.encoder.layers.N.*`` for CLIP-L), as diffusers'
  train_dreambooth_lora_flux.py writes it: through diffusers' own
  ``FluxPipeline.save_lora_weights``; e.g.
  ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``, and CLIP-L's peft names
  under ``text_encoder.`` with the ``text_model.`` level that transformers 5 dropped from
  ``CLIPTextModel`` (ComfyUI maps nothing without it). The LoRA scale alpha/rank is folded
  into the ``lora_B`` weights (as impasto's SDXL exports do): ComfyUI applies alpha/rank only
  where the file holds ``<layer>.alpha`` tensors, which diffusers' PEFT loader does not take;
  with the scale in the weights (and the saved LoRA config's alpha equal to its rank) both
  apply the trained strength.
- ``lora-kohya``: one ``.safetensors`` in kohya sd-scripts' FLUX layout
  (``networks/lora_flux.py``): Black Forest Labs' module names with dots as underscores
  under ``lora_unet_`` (``lora_unet_double_blocks_0_img_attn_qkv``), CLIP-L's under
  ``lora_te1_``, each with ``.lora_down.weight``, ``.lora_up.weight`` and a scalar ``.alpha``.
  Where the original layout fuses layers that diffusers keeps apart (a double block's
  ``img_attn.qkv`` / ``txt_attn.qkv``; a single block's ``linear1``: q, k, v and the MLP's
  input), the adapters of the parts are stacked into one LoRA of k times the rank: ``down``
  the parts' ``lora_A`` one under the other, ``up`` block-diagonal (each part's ``lora_B`` in
  its rows and its own columns; zero rows for a part without an adapter), alpha k times the
  run's, so up·down·alpha/(k·r) is each part's own update, exactly. ComfyUI maps these names
  (``lora_unet_<original name>``) and diffusers' kohya converter splits them back.

Both carry the header every impasto LoRA export carries (kohya's ``ss_*``, SAI model-spec,
``impasto.*``) with FLUX's values (``flux1``, ``flux-1-dev``). Kinds other than plain LoRA
(DoRA, LoHa, LoKr) are refused with one line. The steps every transformer family shares are
:mod:`impasto.models.transformer_lora`; this module holds FLUX's names and header values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.single_file import DOUBLE_LINEARS, SINGLE_LINEARS, variant_of_model
from impasto.models.transformer_lora import (
    OriginalLayer,
    TransformerLora,
    lora_exports,
    save_lora,
    to_kohya_layers,
)

EXPORTED_PARTS = ("transformer", "text_encoder")  # T5 trains frozen only


def save_flux_lora(backbone: FluxBackbone, out: str | Path) -> Path:
    """Write the adapters of the transformer (and CLIP-L, if it has one) to the folder ``out``
    in diffusers' FLUX LoRA layout; returns the weights file."""
    return save_lora(backbone.parts(), out, LORA)


# -- impasto export --format lora-* (FamilySpec.lora_exports) --------------------------------
IMPLEMENTATION = "https://github.com/black-forest-labs/flux"  # SAI model-spec's for FLUX
KOHYA_MODEL_VERSION = "flux1"  # sd-scripts' flux_utils.MODEL_VERSION_FLUX_V1
KOHYA_NETWORK_MODULE = "networks.lora_flux"


def flux_metadata(config: Any, metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` (an SDXL-shaped LoRA header) with FLUX's values: the model-spec
    architecture ``flux-1-dev/lora`` (``flux-1-schnell``; ``flux-1`` when the run's model does
    not say), kohya's ``flux1`` and ``networks.lora_flux``, the guidance and shift trained
    with."""
    from impasto.models.flux.build import SPEC

    options = SPEC.read_options(config.model.options, "flux")
    variant = variant_of_model(config.model.path, config.model.preset, options.transformer)
    architecture = "flux-1" if variant is None else f"flux-1-{variant}"
    return {
        **metadata,
        "modelspec.architecture": f"{architecture}/lora",
        "modelspec.implementation": IMPLEMENTATION,
        "ss_base_model_version": KOHYA_MODEL_VERSION,
        "ss_network_module": KOHYA_NETWORK_MODULE,
        "ss_guidance_scale": repr(float(options.guidance)),
        "ss_discrete_flow_shift": repr(float(config.objective.flow_shift)),
        "ss_apply_t5_attn_mask": "False",  # T5 runs without a mask (text.py)
        "ss_model_prediction_type": "raw",
    }


# the fused layers of the original layout: (block list, original name) → diffusers' parts,
# in the order the original stacks them
FUSED = {
    ("transformer_blocks", "img_attn.qkv"): ("attn.to_q", "attn.to_k", "attn.to_v"),
    ("transformer_blocks", "txt_attn.qkv"): ("attn.add_q_proj", "attn.add_k_proj",
                                             "attn.add_v_proj"),
    ("single_transformer_blocks", "linear1"): ("attn.to_q", "attn.to_k", "attn.to_v",
                                               "proj_mlp"),
}  # fmt: skip
ORIGINAL_BLOCKS = {
    "transformer_blocks": "double_blocks",
    "single_transformer_blocks": "single_blocks",
}
PLAIN = {"transformer_blocks": DOUBLE_LINEARS, "single_transformer_blocks": SINGLE_LINEARS}
MLP_RATIO = 4  # a single block's MLP input is 4× the width (diffusers' FluxSingleTransformerBlock)


def original_layer(module: str) -> OriginalLayer:
    """Where the adapter of a diffusers module inside the transformer's blocks goes in the
    original layout."""
    blocks, index, rest = module.split(".", 2)
    if blocks not in ORIGINAL_BLOCKS:
        raise ValueError(f"export: {module} is not in a FLUX block; kohya names blocks only")
    prefix = f"{ORIGINAL_BLOCKS[blocks]}.{index}"
    for (kind, fused), members in FUSED.items():
        if kind == blocks and rest in members:
            widths = tuple(MLP_RATIO if member == "proj_mlp" else 1 for member in members)
            return OriginalLayer(f"{prefix}.{fused}", rest, members, widths)
    if rest not in PLAIN[blocks]:
        raise ValueError(f"export: {module} has no layer of its own in the original layout")
    return OriginalLayer(f"{prefix}.{PLAIN[blocks][rest]}", rest)


def to_kohya_flux(state: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """The transformer's peft LoRA weights → kohya's FLUX entries (module docstring)."""
    return to_kohya_layers(state, alpha, original_layer)


def _kohya_entries(config: Any, state: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    return to_kohya_flux(state, alpha)  # FLUX's names need nothing of the run's config


LORA = TransformerLora(
    family="flux",
    parts=EXPORTED_PARTS,
    pipeline="FluxPipeline",
    header=flux_metadata,
    kohya=_kohya_entries,
)
LORA_EXPORTS = lora_exports(LORA)
"""``impasto export --format`` → writer of a FLUX LoRA run's adapters."""
