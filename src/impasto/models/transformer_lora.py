"""Exporting a transformer family's LoRA, the steps the families share; each family passes its
own parts as a :class:`TransformerLora` and keeps its module map and header values.

- ``lora-diffusers``: the diffusers/PEFT layout (``OUT/pytorch_lora_weights.safetensors``),
  written by the family's own ``<Pipeline>.save_lora_weights`` (the parts it names,
  ``transformer_lora_layers``, ``text_encoder_lora_layers`` ...), then given the run's header.
  The LoRA scale alpha/rank is folded into the ``lora_B`` weights and the saved LoRA config's
  alpha set to its rank: ComfyUI applies alpha/rank only where a file holds ``<layer>.alpha``
  tensors, which diffusers' PEFT loader does not take; with the scale in the weights both
  apply the trained strength. CLIP keys get the ``text_model.`` level that transformers 5
  dropped from ``CLIPTextModel`` (ComfyUI maps nothing without it).
- ``lora-kohya``: one ``.safetensors`` in kohya sd-scripts' layout: the original module names
  with dots as underscores under ``lora_unet_``, each with ``.lora_down.weight``,
  ``.lora_up.weight`` and a scalar ``.alpha`` (the text encoders' as for SDXL,
  :func:`impasto.models.lora_kohya.to_kohya`). Where the original layout fuses layers that
  diffusers keeps apart (q, k and v in one ``qkv``), the parts' adapters are stacked into one
  LoRA of k times the rank (:func:`fuse_lora`), alpha k times the run's, so
  up·down·alpha/(k·r) is each part's own update, exactly. A layer the original stores
  (shift, scale) where diffusers has (scale, shift) gets its ``up`` rows swapped the same way.

Kinds other than plain LoRA (DoRA, LoHa, LoKr) are refused with one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import peft
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from impasto.models.lora_kohya import to_kohya
from impasto.models.parts import ADAPTER_NAME
from impasto.models.single_file.keymap import clip_text_model_key
from impasto.models.single_file.stream import write_safetensors
from impasto.models.transformer_single_file import swap_scale_shift

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default weight name
Adapter = tuple[dict[str, Tensor], dict[str, Any]]  # (tensors, the LoRA config saved beside)


@dataclass(frozen=True)
class TransformerLora:
    """What one family's LoRA exports need from it."""

    family: str  # the family's name, in "parts.X takes no adapter in the <family> family"
    parts: tuple[str, ...]  # the parts whose adapters are exported, as the pipeline names them
    pipeline: str  # diffusers' pipeline class whose save_lora_weights writes the layout
    # ``metadata`` (an SDXL-shaped LoRA header) with the family's values, for the run's config
    header: Callable[[Any, dict[str, str]], dict[str, str]]
    # the run's config, the transformer's peft LoRA weights and alpha → its kohya entries;
    # None: the family writes its kohya layout itself (:func:`lora_exports` leaves it out)
    kohya: Callable[[Any, dict[str, Tensor], float], dict[str, Tensor]] | None = None


def exported_key(part: str, key: str) -> str:
    """A peft key of ``part``'s adapter as exported: a CLIP encoder's with the ``text_model.``
    level (CLIP-L and CLIP-G alike; a no-op where the model keeps the level)."""
    return key if part == "transformer" else clip_text_model_key(key)


def fold_scale(state: Mapping[str, Tensor], scale: float) -> dict[str, Tensor]:
    """``state`` with the LoRA scale alpha/rank multiplied into its ``lora_B`` weights."""
    return {
        key: tensor * scale if key.endswith("lora_B.weight") else tensor
        for key, tensor in state.items()
    }


def adapter_state(module: torch.nn.Module, part: str) -> Adapter | None:
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
    weights = peft.get_peft_model_state_dict(module, adapter_name=ADAPTER_NAME)
    weights = {key: tensor.detach().to("cpu", torch.float32) for key, tensor in weights.items()}
    scaled = fold_scale(weights, config.lora_alpha / config.r)
    state = {exported_key(part, key): tensor.contiguous() for key, tensor in scaled.items()}
    metadata = config.to_dict()
    metadata["lora_alpha"] = config.r  # the scale is in lora_B
    return state, metadata


def save_lora_weights(
    pipeline: str, root: Path, adapters: Mapping[str, Adapter | None], parts: tuple[str, ...]
) -> Path:
    """``<pipeline>.save_lora_weights`` of the ``adapters`` of ``parts`` (None or absent: the
    part has none) into the folder ``root``; returns the weights file."""
    import diffusers

    arguments: dict[str, Any] = {}
    for part in parts:
        adapter = adapters.get(part)
        arguments[f"{part}_lora_layers"] = adapter[0] if adapter else None
    for part in parts:
        adapter = adapters.get(part)
        arguments[f"{part}_lora_adapter_metadata"] = adapter[1] if adapter else None
    root.mkdir(parents=True, exist_ok=True)
    getattr(diffusers, pipeline).save_lora_weights(str(root), **arguments, safe_serialization=True)
    return root / LORA_FILE


def save_lora(parts: Mapping[str, torch.nn.Module], out: str | Path, lora: TransformerLora) -> Path:
    """Write the adapters of ``lora.parts`` (those that have one) to the folder ``out`` in the
    family's diffusers LoRA layout; returns the weights file."""
    adapters = {part: adapter_state(parts[part], part) for part in lora.parts}
    if all(adapter is None for adapter in adapters.values()):
        raise ValueError("no adapter to export: the run trained no part with lora")
    return save_lora_weights(lora.pipeline, Path(out), adapters, lora.parts)


def check_exported(states: Mapping[str, Any], lora: TransformerLora) -> None:
    """A one-line error for a part that takes no adapter, or for no adapter at all."""
    for part in states:
        if part not in lora.parts:
            raise ValueError(f"export: parts.{part} takes no adapter in the {lora.family} family")
    if not any(states.get(part) for part in lora.parts):
        names = " or ".join(lora.parts)
        where = ", ".join(f"parts.{part}" for part in lora.parts)
        raise ValueError(f"export: the run trained no {names} adapter ({where})")


def lora_scale(config: Any) -> tuple[int, float]:
    """The run's LoRA ``(rank, alpha)``; alpha defaults to the rank."""
    lora = config.lora
    return lora.rank, float(lora.rank if lora.alpha is None else lora.alpha)


def write_lora_diffusers(
    lora: TransformerLora, config: Any, states: dict[str, dict[str, Tensor]], out: Path,
    dtype: torch.dtype, metadata: dict[str, str],
) -> Path:  # fmt: skip
    """``impasto export --format lora-diffusers``: ``OUT/pytorch_lora_weights.safetensors``
    (module docstring) in ``dtype``, written by the family's pipeline, then given the run's
    header."""
    check_exported(states, lora)
    rank, alpha = lora_scale(config)
    adapters: dict[str, Adapter | None] = {}
    for part, state in states.items():
        scaled = {exported_key(part, key): t for key, t in fold_scale(state, alpha / rank).items()}
        modules = sorted({key.partition(".lora_")[0] for key in state})
        lora_config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules)
        adapters[part] = scaled, lora_config.to_dict()
    file = save_lora_weights(lora.pipeline, Path(out), adapters, lora.parts)
    with safe_open(str(file), "pt") as handle:
        own = handle.metadata() or {}
    header = {**own, **lora.header(config, metadata), "impasto.lora_alpha_in_weights": "true"}
    write_safetensors(file, load_file(str(file)), dtype=dtype, metadata=header)
    return file


def write_lora_kohya(
    lora: TransformerLora, config: Any, states: dict[str, dict[str, Tensor]], out: Path,
    dtype: torch.dtype, metadata: dict[str, str],
) -> Path:  # fmt: skip
    """``impasto export --format lora-kohya``: one ``.safetensors`` (module docstring)."""
    check_exported(states, lora)
    assert lora.kohya is not None, "lora_exports registers this writer only with kohya names"
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"export: {out}: a kohya LoRA is one file; give a .safetensors name")
    _, alpha = lora_scale(config)
    tensors = {}
    for part, state in states.items():
        if part == "transformer":
            tensors |= lora.kohya(config, state, alpha)
        else:  # CLIP-L lora_te1_text_model_…, CLIP-G lora_te2_…, as for SDXL
            tensors |= to_kohya(part, state, alpha)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, tensors, dtype=dtype, metadata=lora.header(config, metadata))
    return out


def lora_exports(lora: TransformerLora) -> dict[str, Callable[..., Path]]:
    """``impasto export --format`` → writer of the family's LoRA (``FamilySpec.lora_exports``):
    ``lora-diffusers``, and ``lora-kohya`` where the family gives its kohya names."""
    writers = {"lora-diffusers": partial(write_lora_diffusers, lora)}
    if lora.kohya is not None:
        writers["lora-kohya"] = partial(write_lora_kohya, lora)
    return writers


# -- kohya's names: the original layout's modules, fused layers stacked ----------------------
@dataclass(frozen=True)
class OriginalLayer:
    """Where the adapter of one diffusers layer goes in the original layout."""

    name: str  # the original module ("double_blocks.0.img_attn.qkv")
    part: str  # the diffusers layer inside its block ("attn.to_q")
    members: tuple[str, ...] = ()  # a fused layer's parts, in the order it stacks them
    widths: tuple[int, ...] = ()  # their output rows relative to each other (1 each if empty)
    swapped: bool = False  # stored (shift, scale) where diffusers has (scale, shift)


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


def _member_sizes(layer: OriginalLayer, factors: dict[str, tuple[Tensor, Tensor]]) -> list[int]:
    """The output rows of each member of a fused layer, from one adapted part's ``lora_B``."""
    widths = layer.widths or (1,) * len(layer.members)
    name, (_, lora_b) = next(iter(factors.items()))
    unit = lora_b.shape[0] // widths[layer.members.index(name)]
    return [unit * width for width in widths]


def to_kohya_layers(
    state: dict[str, Tensor], alpha: float, locate: Callable[[str], OriginalLayer]
) -> dict[str, Tensor]:
    """The transformer's peft LoRA weights → kohya's ``lora_unet_`` entries (module
    docstring); ``locate``: a diffusers module name → its :class:`OriginalLayer` (ValueError
    for one the original layout has no place for)."""
    layers: dict[str, tuple[OriginalLayer, dict[str, tuple[Tensor, Tensor]]]] = {}
    for key in state:
        module, _, suffix = key.partition(".lora_")
        if suffix not in ("A.weight", "B.weight"):
            raise ValueError(f"export: {key} is not a plain LoRA weight; kohya holds LoRA only")
        layer = locate(module)
        pair = (state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"])
        layers.setdefault(layer.name, (layer, {}))[1][layer.part] = pair
    kohya = {}
    for original, (layer, factors) in layers.items():
        if not layer.members:
            down, up = next(iter(factors.values()))
        else:
            down, up = fuse_lora(factors, layer.members, _member_sizes(layer, factors))
        if layer.swapped:
            up = swap_scale_shift(up)
        name = "lora_unet_" + original.replace(".", "_")
        kohya[f"{name}.lora_down.weight"] = down.contiguous()
        kohya[f"{name}.lora_up.weight"] = up.contiguous()
        kohya[f"{name}.alpha"] = torch.tensor(alpha * len(factors))
    return kohya
