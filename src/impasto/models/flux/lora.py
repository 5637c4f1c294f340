"""Exporting a FLUX LoRA in the diffusers/PEFT layout (``pytorch_lora_weights.safetensors``),
which both ``FluxPipeline.load_lora_weights`` and ComfyUI's LoRA loader map
(``comfy/lora.py``: ``transformer.<diffusers name>`` for FLUX, and
``text_encoder.text_model.encoder.layers.N.*`` for CLIP-L), as diffusers'
train_dreambooth_lora_flux.py writes it: through diffusers' own
``FluxPipeline.save_lora_weights``.

- transformer: peft's names under ``transformer.``, e.g.
  ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``;
- CLIP-L: peft's names under ``text_encoder.`` with the ``text_model.`` level that
  transformers 5 dropped from ``CLIPTextModel`` (ComfyUI maps nothing without it).

The LoRA scale alpha/rank is folded into the ``lora_B`` weights (as impasto's SDXL exports do):
ComfyUI applies alpha/rank only where the file holds ``<layer>.alpha`` tensors, which
diffusers' PEFT loader does not take; with the scale in the weights (and the saved LoRA
config's alpha equal to its rank) both apply the trained strength. Kinds other than plain LoRA
(DoRA, LoHa, LoKr) are refused with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor

from impasto.models.flux.backbone import FluxBackbone
from impasto.models.parts import ADAPTER_NAME
from impasto.models.single_file.keymap import clip_text_model_key

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
    from diffusers import FluxPipeline

    transformer, text_encoder = adapters["transformer"], adapters["text_encoder"]
    root = Path(out)
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
