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
  k times the run's: :func:`impasto.models.flux.lora.fuse_lora`), so each part's update is
  exact. The last block's text modulation is stored (shift, scale) in the original layout where
  diffusers has (scale, shift): its ``up`` rows are swapped the same way. ComfyUI maps these
  names (``lora_unet_<original name>``) to the weights of its SD3 model.

The LoRA scale alpha/rank is folded into the diffusers file's ``lora_B`` weights and its saved
LoRA config's alpha set to its rank (the same rule as FLUX's and SDXL's exports), so diffusers
and ComfyUI both apply the trained strength. Both files carry the header every impasto LoRA
export carries (kohya's ``ss_*``, SAI model-spec, ``impasto.*``) with SD3.5's values. Kinds
other than plain LoRA (DoRA, LoHa, LoKr) are refused with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from impasto.models.flux.lora import LORA_FILE, adapter_state, fuse_lora
from impasto.models.lora_kohya import to_kohya
from impasto.models.sd3.backbone import BLOCK_LIST, Sd3Backbone
from impasto.models.sd3.single_file import (
    FUSED_QKV,
    IMAGE_LINEARS,
    SECOND_ATTENTION,
    SECOND_QKV,
    TEXT_LINEARS,
    swap_scale_shift,
    variant_of_model,
)
from impasto.models.single_file.keymap import clip_text_model_key
from impasto.models.single_file.stream import write_safetensors

EXPORTED_PARTS = ("transformer", "text_encoder", "text_encoder_2")  # T5 trains frozen only


def save_sd3_lora(backbone: Sd3Backbone, out: str | Path) -> Path:
    """Write the adapters of the transformer (and of CLIP-L / CLIP-G, where they have one) to
    the folder ``out`` in diffusers' SD3 LoRA layout; returns the weights file."""
    adapters = {part: adapter_state(backbone.parts()[part], part) for part in EXPORTED_PARTS}
    if all(adapter is None for adapter in adapters.values()):
        raise ValueError("no adapter to export: the run trained no part with lora")
    return _save_diffusers(Path(out), adapters)


def _save_diffusers(root: Path, adapters: dict[str, tuple[dict, dict] | None]) -> Path:
    from diffusers import StableDiffusion3Pipeline

    def layers(part: str) -> dict | None:
        return adapters[part][0] if adapters.get(part) else None

    def metadata(part: str) -> dict | None:
        return adapters[part][1] if adapters.get(part) else None

    root.mkdir(parents=True, exist_ok=True)
    StableDiffusion3Pipeline.save_lora_weights(
        str(root),
        transformer_lora_layers=layers("transformer"),
        text_encoder_lora_layers=layers("text_encoder"),
        text_encoder_2_lora_layers=layers("text_encoder_2"),
        transformer_lora_adapter_metadata=metadata("transformer"),
        text_encoder_lora_adapter_metadata=metadata("text_encoder"),
        text_encoder_2_lora_adapter_metadata=metadata("text_encoder_2"),
        safe_serialization=True,
    )
    return root / LORA_FILE


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


def _check_exported(states: dict[str, dict[str, Tensor]]) -> None:
    for part in states:
        if part not in EXPORTED_PARTS:
            raise ValueError(f"export: parts.{part} takes no adapter in the sd3 family")


def _scale(config: Any) -> tuple[int, float]:
    lora = config.lora
    return lora.rank, float(lora.rank if lora.alpha is None else lora.alpha)


def write_lora_diffusers(
    config: Any, states: dict[str, dict[str, Tensor]], out: Path, dtype: torch.dtype,
    metadata: dict[str, str],
) -> Path:  # fmt: skip
    """``impasto export --format lora-diffusers``: ``OUT/pytorch_lora_weights.safetensors``
    (module docstring) in ``dtype``, written by ``StableDiffusion3Pipeline.save_lora_weights``,
    then given the run's header."""
    _check_exported(states)
    rank, alpha = _scale(config)
    adapters: dict[str, tuple[dict, dict] | None] = {}
    for part, state in states.items():
        scaled = {}
        for key, tensor in state.items():
            if key.endswith("lora_B.weight"):
                tensor = tensor * (alpha / rank)
            scaled[key if part == "transformer" else clip_text_model_key(key)] = tensor
        modules = sorted({key.partition(".lora_")[0] for key in state})
        lora_config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules)
        adapters[part] = scaled, lora_config.to_dict()
    file = _save_diffusers(Path(out), adapters)
    with safe_open(str(file), "pt") as handle:
        own = handle.metadata() or {}
    header = {**own, **sd3_metadata(config, metadata), "impasto.lora_alpha_in_weights": "true"}
    write_safetensors(file, load_file(str(file)), dtype=dtype, metadata=header)
    return file


def _original_name(module: str, depth: int) -> tuple[str, tuple[str, ...] | None, str, bool]:
    """``(original module name, the fused q/k/v names or None, the part, swapped)`` of a
    diffusers module name inside the transformer's joint blocks (``depth``: their number;
    swapped: the last block's text modulation, stored (shift, scale))."""
    blocks, index, rest = module.split(".", 2)
    if blocks != BLOCK_LIST:
        raise ValueError(f"export: {module} is not in an SD3 joint block; kohya names blocks only")
    prefix = f"joint_blocks.{index}"
    last = int(index) == depth - 1
    for names, fused in (*FUSED_QKV, SECOND_QKV):
        if rest in names:
            return f"{prefix}.{fused}", names, rest, False
    if rest == "norm1_context.linear" and last:
        return f"{prefix}.context_block.adaLN_modulation.1", None, rest, True
    linears = IMAGE_LINEARS | SECOND_ATTENTION | ({} if last else TEXT_LINEARS)
    if rest not in linears:
        raise ValueError(f"export: {module} has no layer of its own in the original layout")
    return f"{prefix}.{linears[rest]}", None, rest, False


def to_kohya_sd3(state: dict[str, Tensor], alpha: float, depth: int) -> dict[str, Tensor]:
    """The transformer's peft LoRA weights → kohya's SD3 entries (module docstring);
    ``depth``: the transformer's joint blocks."""
    layers: dict[str, tuple[tuple[str, ...] | None, dict[str, tuple[Tensor, Tensor]], bool]] = {}
    for key in state:
        module, _, suffix = key.partition(".lora_")
        if suffix not in ("A.weight", "B.weight"):
            raise ValueError(f"export: {key} is not a plain LoRA weight; kohya holds LoRA only")
        original, members, name, swapped = _original_name(module, depth)
        pair = (state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"])
        layers.setdefault(original, (members, {}, swapped))[1][name] = pair
    kohya = {}
    for original, (members, factors, swapped) in layers.items():
        if members is None:
            down, up = next(iter(factors.values()))
        else:
            sizes = [next(iter(factors.values()))[1].shape[0]] * len(members)
            down, up = fuse_lora(factors, members, sizes)
        if swapped:
            up = swap_scale_shift(up)
        name = "lora_unet_" + original.replace(".", "_")
        kohya[f"{name}.lora_down.weight"] = down.contiguous()
        kohya[f"{name}.lora_up.weight"] = up.contiguous()
        kohya[f"{name}.alpha"] = torch.tensor(alpha * len(factors))
    return kohya


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


def write_lora_kohya(
    config: Any, states: dict[str, dict[str, Tensor]], out: Path, dtype: torch.dtype,
    metadata: dict[str, str],
) -> Path:  # fmt: skip
    """``impasto export --format lora-kohya``: one ``.safetensors`` (module docstring)."""
    _check_exported(states)
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"export: {out}: a kohya LoRA is one file; give a .safetensors name")
    _, alpha = _scale(config)
    tensors = {}
    for part, state in states.items():
        if part == "transformer":
            tensors |= to_kohya_sd3(state, alpha, _depth(state, config))
        else:  # CLIP-L lora_te1_text_model_…, CLIP-G lora_te2_…, as for SDXL
            tensors |= to_kohya(part, state, alpha)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, tensors, dtype=dtype, metadata=sd3_metadata(config, metadata))
    return out


LORA_EXPORTS = {"lora-diffusers": write_lora_diffusers, "lora-kohya": write_lora_kohya}
"""``impasto export --format`` → writer of an SD3.5 LoRA run's adapters."""
