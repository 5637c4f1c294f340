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
(DoRA, LoHa, LoKr) are refused with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.single_file import DOUBLE_LINEARS, SINGLE_LINEARS, variant_of_model
from impasto.models.lora_kohya import to_kohya
from impasto.models.parts import ADAPTER_NAME
from impasto.models.single_file.keymap import clip_text_model_key
from impasto.models.single_file.stream import write_safetensors

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default weight name
EXPORTED_PARTS = ("transformer", "text_encoder")  # T5 trains frozen only


def adapter_state(
    module: torch.nn.Module, part: str
) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
    """``module``'s adapter as exported (the module docstring): its tensors, float32 on the
    CPU, alpha/rank in ``lora_B``, and the LoRA config to save beside them; None if it has
    none."""
    if not any(isinstance(child, BaseTunerLayer) for child in module.modules()):
        return None
    config = module.peft_config[ADAPTER_NAME]
    if not isinstance(config, peft.LoraConfig) or config.use_dora:
        kind = "dora" if getattr(config, "use_dora", False) else type(config).__name__
        raise ValueError(
            f"parts.{part}: a {kind} adapter; the diffusers LoRA format holds plain LoRA "
            "(lora.kind: lora)"
        )
    if config.rank_pattern or config.alpha_pattern:
        raise ValueError(f"parts.{part}: per-layer ranks or alphas are not exported")
    scale = config.lora_alpha / config.r
    state = {}
    for key, tensor in peft.get_peft_model_state_dict(module, adapter_name=ADAPTER_NAME).items():
        tensor = tensor.detach().to("cpu", torch.float32)
        if key.endswith("lora_B.weight"):
            tensor = tensor * scale
        if part == "text_encoder":
            key = clip_text_model_key(key)
        state[key] = tensor.contiguous()
    metadata = config.to_dict()
    metadata["lora_alpha"] = config.r  # the scale is in lora_B
    return state, metadata


def save_flux_lora(backbone: FluxBackbone, out: str | Path) -> Path:
    """Write the adapters of the transformer (and CLIP-L, if it has one) to the folder ``out``
    in diffusers' FLUX LoRA layout; returns the weights file."""
    adapters = {part: adapter_state(backbone.parts()[part], part) for part in EXPORTED_PARTS}
    if all(adapter is None for adapter in adapters.values()):
        raise ValueError("no adapter to export: the run trained no part with lora")
    return _save_diffusers(Path(out), adapters)


def _save_diffusers(root: Path, adapters: dict[str, tuple[dict, dict] | None]) -> Path:
    from diffusers import FluxPipeline

    transformer, text_encoder = adapters.get("transformer"), adapters.get("text_encoder")
    root.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(
        str(root),
        transformer_lora_layers=transformer[0] if transformer else None,
        text_encoder_lora_layers=text_encoder[0] if text_encoder else None,
        transformer_lora_adapter_metadata=transformer[1] if transformer else None,
        text_encoder_lora_adapter_metadata=text_encoder[1] if text_encoder else None,
        safe_serialization=True,
    )
    return root / LORA_FILE


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


def _check_exported(states: dict[str, dict[str, Tensor]]) -> None:
    for part in states:
        if part not in EXPORTED_PARTS:
            raise ValueError(f"export: parts.{part} takes no adapter in the flux family")


def _scale(config: Any) -> tuple[int, float]:
    lora = config.lora
    return lora.rank, float(lora.rank if lora.alpha is None else lora.alpha)


def write_lora_diffusers(
    config: Any, states: dict[str, dict[str, Tensor]], out: Path, dtype: torch.dtype,
    metadata: dict[str, str],
) -> Path:  # fmt: skip
    """``impasto export --format lora-diffusers``: ``OUT/pytorch_lora_weights.safetensors``
    (module docstring) in ``dtype``, written by ``FluxPipeline.save_lora_weights``, then
    given the run's header."""
    _check_exported(states)
    rank, alpha = _scale(config)
    adapters: dict[str, tuple[dict, dict] | None] = {}
    for part, state in states.items():
        scaled = {}
        for key, tensor in state.items():
            if key.endswith("lora_B.weight"):
                tensor = tensor * (alpha / rank)
            scaled[clip_text_model_key(key) if part == "text_encoder" else key] = tensor
        modules = sorted({key.partition(".lora_")[0] for key in state})
        lora_config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules)
        adapters[part] = scaled, lora_config.to_dict()
    file = _save_diffusers(Path(out), adapters)
    with safe_open(str(file), "pt") as handle:
        own = handle.metadata() or {}
    header = {**own, **flux_metadata(config, metadata), "impasto.lora_alpha_in_weights": "true"}
    write_safetensors(file, load_file(str(file)), dtype=dtype, metadata=header)
    return file


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


def _original_name(module: str) -> tuple[str, tuple[str, ...] | None, str]:
    """``(original module name, the fused group's parts or None, the part)`` of a diffusers
    module name inside the transformer's blocks."""
    blocks, index, rest = module.split(".", 2)
    if blocks not in ORIGINAL_BLOCKS:
        raise ValueError(f"export: {module} is not in a FLUX block; kohya names blocks only")
    prefix = f"{ORIGINAL_BLOCKS[blocks]}.{index}"
    for (kind, fused), members in FUSED.items():
        if kind == blocks and rest in members:
            return f"{prefix}.{fused}", members, rest
    if rest not in PLAIN[blocks]:
        raise ValueError(f"export: {module} has no layer of its own in the original layout")
    return f"{prefix}.{PLAIN[blocks][rest]}", None, rest


def _fused_lora(
    factors: dict[str, tuple[Tensor, Tensor]], members: tuple[str, ...]
) -> tuple[Tensor, Tensor]:
    """``(down [k·r, in], up [sum of the parts' outputs, k·r])`` of the k adapted parts of one
    fused layer (module docstring)."""
    some_b = next(iter(factors.values()))[1]
    name = next(iter(factors))
    hidden = some_b.shape[0] // (MLP_RATIO if name == "proj_mlp" else 1)
    sizes = [hidden * MLP_RATIO if member == "proj_mlp" else hidden for member in members]
    return fuse_lora(factors, members, sizes)


def fuse_lora(
    factors: dict[str, tuple[Tensor, Tensor]], members: tuple[str, ...], sizes: list[int]
) -> tuple[Tensor, Tensor]:
    """One LoRA of a fused layer whose outputs are ``members`` stacked (``sizes`` rows each)
    from the ``(lora_A, lora_B)`` of its k adapted parts: ``down [k·r, in]`` their ``lora_A``
    one under the other, ``up [sum(sizes), k·r]`` block-diagonal (zero rows for a part
    without an adapter), so ``up·down`` is each part's own ``B·A`` in its rows."""
    rank = next(iter(factors.values()))[0].shape[0]
    present = [member for member in members if member in factors]
    down = torch.cat([factors[member][0] for member in present])
    up = down.new_zeros(sum(sizes), rank * len(present))
    for column, member in enumerate(present):
        row = sum(sizes[: members.index(member)])
        lora_b = factors[member][1]
        up[row : row + lora_b.shape[0], column * rank : (column + 1) * rank] = lora_b
    return down, up


def to_kohya_flux(state: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """The transformer's peft LoRA weights → kohya's FLUX entries (module docstring)."""
    layers: dict[str, tuple[tuple[str, ...] | None, dict[str, tuple[Tensor, Tensor]]]] = {}
    for key in state:
        module, _, suffix = key.partition(".lora_")
        if suffix not in ("A.weight", "B.weight"):
            raise ValueError(f"export: {key} is not a plain LoRA weight; kohya holds LoRA only")
        original, members, name = _original_name(module)
        pair = (state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"])
        layers.setdefault(original, (members, {}))[1][name] = pair
    kohya = {}
    for original, (members, factors) in layers.items():
        if members is None:
            down, up = next(iter(factors.values()))
        else:
            down, up = _fused_lora(factors, members)
        name = "lora_unet_" + original.replace(".", "_")
        kohya[f"{name}.lora_down.weight"] = down.contiguous()
        kohya[f"{name}.lora_up.weight"] = up.contiguous()
        kohya[f"{name}.alpha"] = torch.tensor(alpha * len(factors))
    return kohya


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
            tensors |= to_kohya_flux(state, alpha)
        else:  # CLIP-L: lora_te1_text_model_…, as for SDXL
            tensors |= to_kohya(part, state, alpha)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, tensors, dtype=dtype, metadata=flux_metadata(config, metadata))
    return out


LORA_EXPORTS = {"lora-diffusers": write_lora_diffusers, "lora-kohya": write_lora_kohya}
"""``impasto export --format`` → writer of a FLUX LoRA run's adapters."""
