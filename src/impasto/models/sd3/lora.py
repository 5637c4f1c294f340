"""Exporting an SD3.5 LoRA, from Python (:func:`save_sd3_lora`, a trained backbone) or from
``impasto export RUN --format lora-diffusers | lora-kohya`` (:data:`LORA_EXPORTS`, the
checkpoint's adapters, un-merged, through :mod:`impasto.export.family`):

- ``lora-diffusers``: the diffusers/PEFT layout (``OUT/pytorch_lora_weights.safetensors``),
  which both ``StableDiffusion3Pipeline.load_lora_weights`` and ComfyUI's LoRA loader map
  (``comfy/lora.py``: ``transformer.<diffusers name>`` for SD3 through
  ``comfy.utils.mmdit_to_diffusers``; ``text_encoder.text_model.encoder.layers.N.*`` for CLIP-L
  and ``text_encoder_2.text_model.encoder.layers.N.*`` for CLIP-G), as diffusers'
  train_dreambooth_lora_sd3.py writes it: through diffusers' own
  ``StableDiffusion3Pipeline.save_lora_weights``.
- ``lora-kohya``: one ``.safetensors`` in kohya sd-scripts' SD3 layout (``networks/lora_sd3.py``:
  the original MMDiT's module names with dots as underscores under ``lora_unet_``, e.g.
  ``lora_unet_joint_blocks_0_x_block_attn_qkv``; CLIP-L under ``lora_te1_``, CLIP-G under
  ``lora_te2_``), each with ``.lora_down.weight``, ``.lora_up.weight`` and a scalar ``.alpha``.
  Where the original layout fuses q, k and v into one ``qkv`` (each attention: ``x_block.attn``,
  ``context_block.attn``, SD3.5 Medium's ``x_block.attn2``), the parts' adapters are stacked
  into one LoRA of k times the rank (``down`` one under the other, ``up`` block-diagonal, alpha
  k times the run's: :func:`impasto.models.transformer_lora.fuse_lora`), so each part's update is
  exact. The last block's text modulation is stored (shift, scale) in the original layout where
  diffusers has (scale, shift): its ``up`` rows are swapped the same way. ComfyUI maps these
  names (``lora_unet_<original name>``) to the weights of its SD3 model.

The LoRA scale alpha/rank is folded into the diffusers file's ``lora_B`` weights and its saved
LoRA config's alpha set to its rank (the same rule as FLUX's and SDXL's exports), so diffusers
and ComfyUI both apply the trained strength. Both files carry the header every impasto LoRA
export carries (kohya's ``ss_*``, SAI model-spec, ``impasto.*``) with SD3.5's values. Kinds
other than plain LoRA (DoRA, LoHa, LoKr) are refused with one line. The steps every transformer
family shares are :mod:`impasto.models.transformer_lora`; this module holds SD3's names and
header values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from impasto.models.sd3.backbone import BLOCK_LIST, Sd3Backbone
from impasto.models.sd3.single_file import (
    FUSED_QKV,
    IMAGE_LINEARS,
    SECOND_ATTENTION,
    SECOND_QKV,
    TEXT_LINEARS,
    variant_of_model,
)
from impasto.models.transformer_lora import (
    OriginalLayer,
    TransformerLora,
    lora_exports,
    save_lora,
    to_kohya_layers,
)

EXPORTED_PARTS = ("transformer", "text_encoder", "text_encoder_2")  # T5 trains frozen only


def save_sd3_lora(backbone: Sd3Backbone, out: str | Path) -> Path:
    """Write the adapters of the transformer (and of CLIP-L / CLIP-G, where they have one) to
    the folder ``out`` in diffusers' SD3 LoRA layout; returns the weights file."""
    return save_lora(backbone.parts(), out, LORA)


# -- impasto export --format lora-* (FamilySpec.lora_exports) --------------------------------
IMPLEMENTATION = "https://github.com/Stability-AI/sd3.5"  # SAI model-spec's for SD3.5
ARCHITECTURE = "stable-diffusion-3"  # sd-scripts' sai_model_spec.ARCH_SD3_M, + "-5-large" etc.
KOHYA_MODEL_VERSION = "sd3"
KOHYA_NETWORK_MODULE = "networks.lora_sd3"


def sd3_metadata(config: Any, metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` (an SDXL-shaped LoRA header) with SD3.5's values: the model-spec
    architecture ``stable-diffusion-3-5-large/lora`` (``-medium``; ``stable-diffusion-3`` when
    the run's model does not say), kohya's ``networks.lora_sd3``, the shift trained with."""
    from impasto.models.sd3.build import SPEC

    options = SPEC.read_options(config.model.options, "sd3")
    variant = variant_of_model(config.model.path, config.model.preset, options.transformer)
    architecture = ARCHITECTURE if variant is None else f"{ARCHITECTURE}-5-{variant}"
    return {
        **metadata,
        "modelspec.architecture": f"{architecture}/lora",
        "modelspec.implementation": IMPLEMENTATION,
        "ss_base_model_version": KOHYA_MODEL_VERSION,
        "ss_network_module": KOHYA_NETWORK_MODULE,
        "ss_discrete_flow_shift": repr(float(config.objective.flow_shift)),
        "ss_model_prediction_type": "raw",
    }


def original_layer(module: str, depth: int) -> OriginalLayer:
    """Where the adapter of a diffusers module inside the transformer's joint blocks goes in
    the original layout (``depth``: their number; the last block's text modulation is stored
    (shift, scale))."""
    blocks, index, rest = module.split(".", 2)
    if blocks != BLOCK_LIST:
        raise ValueError(f"export: {module} is not in an SD3 joint block; kohya names blocks only")
    prefix = f"joint_blocks.{index}"
    last = int(index) == depth - 1
    for names, fused in (*FUSED_QKV, SECOND_QKV):
        if rest in names:
            return OriginalLayer(f"{prefix}.{fused}", rest, names)
    if rest == "norm1_context.linear" and last:
        return OriginalLayer(f"{prefix}.context_block.adaLN_modulation.1", rest, swapped=True)
    linears = IMAGE_LINEARS | SECOND_ATTENTION | ({} if last else TEXT_LINEARS)
    if rest not in linears:
        raise ValueError(f"export: {module} has no layer of its own in the original layout")
    return OriginalLayer(f"{prefix}.{linears[rest]}", rest)


def to_kohya_sd3(state: dict[str, Tensor], alpha: float, depth: int) -> dict[str, Tensor]:
    """The transformer's peft LoRA weights → kohya's SD3 entries (module docstring);
    ``depth``: the transformer's joint blocks."""
    return to_kohya_layers(state, alpha, lambda module: original_layer(module, depth))


def _depth(state: dict[str, Tensor], config: Any) -> int:
    """The joint blocks of the run's transformer: from its config file (model.path) or preset,
    read without building the model."""
    import json

    from impasto.models.sd3.build import SPEC
    from impasto.models.sd3.components import PRESET_DEPTHS

    options = SPEC.read_options(config.model.options, "sd3")
    if options.transformer is not None:
        from safetensors import safe_open as open_file

        with open_file(str(options.transformer), "pt") as handle:
            keys = list(handle.keys())
        indices = {int(k.split("joint_blocks.")[1].split(".")[0]) for k in keys
                   if "joint_blocks." in k}  # fmt: skip
        indices |= {int(k.split(f"{BLOCK_LIST}.")[1].split(".")[0]) for k in keys
                    if k.startswith(f"{BLOCK_LIST}.")}  # fmt: skip
        return max(indices) + 1
    if config.model.path is not None:
        path = Path(config.model.path) / "transformer" / "config.json"
        return int(json.loads(path.read_text(encoding="utf-8"))["num_layers"])
    return PRESET_DEPTHS[config.model.preset]


def _kohya_entries(config: Any, state: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    return to_kohya_sd3(state, alpha, _depth(state, config))


LORA = TransformerLora(
    family="sd3",
    parts=EXPORTED_PARTS,
    pipeline="StableDiffusion3Pipeline",
    header=sd3_metadata,
    kohya=_kohya_entries,
)
LORA_EXPORTS = lora_exports(LORA)
"""``impasto export --format`` → writer of an SD3.5 LoRA run's adapters."""
