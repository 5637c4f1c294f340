"""An exported DiT: one folder that ``model.path`` and ``impasto sample`` read back exactly
(``impasto export RUN --format folder``).

::

    OUT/
      impasto-model.json          {"family": "dit", "objective": {...}, "resolution": 64,
                                   "transformer": DiTConfig}
      transformer.safetensors     the DiT's weights (key layout: docs/dit.md)
      vae/                        diffusers AutoencoderKL, or AutoencoderKLWan (a video DiT)
      text_encoder/, tokenizer/   transformers folders: SDXL's CLIP 1, or the single encoder
      text_encoder_2/, tokenizer_2/   SDXL's CLIP 2 (absent with a single encoder)

The record's ``objective`` and ``resolution`` say how the model samples
(:mod:`impasto.models.exported`), as the SDXL exports' scheduler does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from impasto.models.dit.backbone import DiTBackbone, DiTComponents
from impasto.models.dit.network import DiT, DiTConfig
from impasto.models.exported import RECORD_FILE, read_record, write_record

WEIGHTS_FILE = "transformer.safetensors"


def save_dit_folder(
    backbone: DiTBackbone, out: Path, record: dict[str, Any], dtype: torch.dtype
) -> Path:
    """Write the backbone's networks to the folder ``out`` with ``record`` and the DiT's
    config in its record file (the transformer's weights in ``dtype``; the other networks as
    they are: the exporter casts them)."""
    out.mkdir(parents=True, exist_ok=True)
    components = backbone.components
    transformer = components.transformer
    state = {name: tensor.detach().to("cpu", dtype).contiguous()
             for name, tensor in transformer.state_dict().items()}  # fmt: skip
    save_file(state, str(out / WEIGHTS_FILE), metadata={"impasto.family": "dit"})
    components.vae.save_pretrained(out / "vae", safe_serialization=True)
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        part = getattr(components, name)
        if part is not None:  # a single text encoder has no text_encoder_2, tokenizer_2
            part.save_pretrained(out / name)
    write_record(out, {**record, "transformer": transformer.config.to_dict()})
    return out


def vae_class(folder: Path) -> type[nn.Module]:
    """The diffusers class of the VAE saved in ``folder``: Wan 2.1's video VAE
    (``AutoencoderKLWan``) where its config names it, else ``AutoencoderKL``."""
    try:
        name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        name = None  # load_component says what is wrong with the folder
    return AutoencoderKLWan if name == "AutoencoderKLWan" else AutoencoderKL


def load_dit_folder(path: str | Path) -> DiTComponents:
    """The exported DiT at ``path``, float32, eval mode, offline."""
    from impasto.models.dit.text import load_text_folder
    from impasto.models.io import load_component

    root = Path(path)
    record = read_record(root, "dit")
    try:
        config = DiTConfig(**record["transformer"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"model.path {root}: {RECORD_FILE} has no valid transformer config ({error})"
        ) from None
    try:
        state = load_file(str(root / WEIGHTS_FILE))
    except (OSError, SafetensorError) as error:
        raise ValueError(f"model.path {root}: cannot read {WEIGHTS_FILE} ({error})") from None
    transformer = DiT(config)
    result = transformer.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if result.missing_keys or result.unexpected_keys:
        bad = (result.missing_keys or result.unexpected_keys)[0]
        raise ValueError(f"model.path {root}: {WEIGHTS_FILE} does not fit {RECORD_FILE} ({bad!r})")
    texts = load_text_folder(root, "model.path", cap=None)  # a single encoder's length as saved
    vae = load_component(vae_class(root / "vae"), root, "vae", torch_dtype=torch.float32)
    components = DiTComponents(transformer, vae, *texts)
    for module in components.networks().values():
        module.eval()
    return components
