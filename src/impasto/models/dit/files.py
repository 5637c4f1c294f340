"""An exported DiT: one folder that ``model.path`` and ``impasto sample`` read back exactly.

::

    OUT/
      dit.json                    {"family": "dit", "transformer": DiTConfig, "sampling": {...}}
      transformer.safetensors     the DiT's weights (key layout: docs/dit.md)
      vae/                        diffusers AutoencoderKL (config.json + safetensors)
      text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/   transformers CLIP folders

``sampling`` records how the model samples (prediction type, flow shift), as the SDXL
exports' scheduler does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from impasto.models.dit.backbone import DiTComponents
from impasto.models.dit.network import DiT, DiTConfig

CONFIG_FILE = "dit.json"
WEIGHTS_FILE = "transformer.safetensors"
LAYOUT = f"an exported DiT folder holds {CONFIG_FILE}, {WEIGHTS_FILE}, vae/ and text_encoder*/"


def is_dit_folder(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def save_dit_folder(
    components: DiTComponents, out: str | Path, sampling: dict[str, Any], dtype: torch.dtype
) -> Path:
    """Write ``components`` to the folder ``out`` (weights in ``dtype``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    transformer = components.transformer
    state = {name: tensor.detach().to("cpu", dtype).contiguous()
             for name, tensor in transformer.state_dict().items()}  # fmt: skip
    save_file(state, str(out / WEIGHTS_FILE), metadata={"impasto.family": "dit"})
    components.vae.save_pretrained(out / "vae", safe_serialization=True)
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        getattr(components, name).save_pretrained(out / name)
    record = {"family": "dit", "transformer": transformer.config.to_dict(), "sampling": sampling}
    (out / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return out


def read_dit_record(path: str | Path) -> dict[str, Any]:
    """``dit.json`` of an exported DiT folder; one-line ValueError if missing or unreadable."""
    file = Path(path) / CONFIG_FILE
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"model.path {path}: no {CONFIG_FILE}; {LAYOUT}") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"model.path {path}: cannot read {CONFIG_FILE} ({error})") from None
    if not isinstance(record, dict) or record.get("family") != "dit":
        raise ValueError(f"model.path {path}: {CONFIG_FILE} is not a DiT's; {LAYOUT}")
    return record


def load_dit_folder(path: str | Path) -> DiTComponents:
    """The exported DiT at ``path``, float32, eval mode, offline."""
    from impasto.models.dit.build import load_text_encoders
    from impasto.models.io import load_component

    root = Path(path)
    record = read_dit_record(root)
    try:
        config = DiTConfig(**record["transformer"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"model.path {root}: {CONFIG_FILE} has no valid transformer config ({error})"
        ) from None
    try:
        state = load_file(str(root / WEIGHTS_FILE))
    except (OSError, SafetensorError) as error:
        raise ValueError(f"model.path {root}: cannot read {WEIGHTS_FILE} ({error})") from None
    transformer = DiT(config)
    result = transformer.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if result.missing_keys or result.unexpected_keys:
        bad = (result.missing_keys or result.unexpected_keys)[0]
        raise ValueError(f"model.path {root}: {WEIGHTS_FILE} does not fit {CONFIG_FILE} ({bad!r})")
    encoder, encoder_2, tokenizer, tokenizer_2 = load_text_encoders(root, "model.path")
    vae = load_component(AutoencoderKL, root, "vae", torch_dtype=torch.float32)
    components = DiTComponents(transformer, vae, encoder, encoder_2, tokenizer, tokenizer_2)
    for module in components.networks().values():
        module.eval()
    return components
