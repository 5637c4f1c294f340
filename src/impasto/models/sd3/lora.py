"""Exporting an SD3.5 LoRA in the diffusers/PEFT layout (``pytorch_lora_weights.safetensors``),
which both ``StableDiffusion3Pipeline.load_lora_weights`` and ComfyUI's LoRA loader map
(``comfy/lora.py``: ``transformer.<diffusers name>`` for SD3 through
``comfy.utils.mmdit_to_diffusers``; ``text_encoder.text_model.encoder.layers.N.*`` for CLIP-L
and ``text_encoder_2.text_model.encoder.layers.N.*`` for CLIP-G), as diffusers'
train_dreambooth_lora_sd3.py writes it: through diffusers' own
``StableDiffusion3Pipeline.save_lora_weights``.

The LoRA scale alpha/rank is folded into the ``lora_B`` weights and the saved LoRA config's
alpha set to its rank (:func:`impasto.models.flux.lora.adapter_state`, the same rule as FLUX's
and SDXL's exports), so diffusers and ComfyUI both apply the trained strength. Kinds other than
plain LoRA (DoRA, LoHa, LoKr) are refused with one line.
"""

from __future__ import annotations

from pathlib import Path

from impasto.models.flux.lora import LORA_FILE, adapter_state
from impasto.models.sd3.backbone import Sd3Backbone

EXPORTED_PARTS = ("transformer", "text_encoder", "text_encoder_2")  # T5 trains frozen only


def save_sd3_lora(backbone: Sd3Backbone, out: str | Path) -> Path:
    """Write the adapters of the transformer (and of CLIP-L / CLIP-G, where they have one) to
    the folder ``out`` in diffusers' SD3 LoRA layout; returns the weights file."""
    adapters = {part: adapter_state(backbone.parts()[part], part) for part in EXPORTED_PARTS}
    if all(adapter is None for adapter in adapters.values()):
        raise ValueError("no adapter to export: the run trained no part with lora")
    from diffusers import StableDiffusion3Pipeline

    def layers(part: str) -> dict | None:
        return adapters[part][0] if adapters[part] else None

    def metadata(part: str) -> dict | None:
        return adapters[part][1] if adapters[part] else None

    root = Path(out)
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
