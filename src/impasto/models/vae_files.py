"""VAE weight files: one safetensors file that carries its own config, plus a diffusers sidecar.

``save_vae_file(vae, out_file, info)`` writes ``out_file`` (the state dict, with the diffusers
config and the training record as safetensors metadata) and ``config.json`` beside it (the
diffusers config, with the training record under the private key ``_impasto_training``, which
diffusers ignores). Named ``diffusion_pytorch_model.safetensors``, the file and its sidecar form
a folder that ``AutoencoderKL.from_pretrained`` loads as is.
"""

from __future__ import annotations

import json
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

CONFIG_KEY = "config"
TRAINING_KEY = "impasto_training"
SIDECAR_NAME = "config.json"
SIDECAR_TRAINING_KEY = "_impasto_training"  # "_" keys are skipped by diffusers' from_config
DEMO_VAE_ASSET = ("assets", "demo_vae", "diffusion_pytorch_model.safetensors")


def save_vae_file(vae: AutoencoderKL, out_file: Path, training: dict[str, Any]) -> Path:
    """Write ``vae`` to ``out_file`` and its diffusers ``config.json`` beside it.

    Args:
        vae: the model; its ``config`` (``scaling_factor`` included) is stored with the weights.
        out_file: the ``.safetensors`` file to write; its folder is created.
        training: JSON-serialisable record of how the weights were made (command, PSNR, ...).

    Returns:
        The path of the sidecar ``config.json``.
    """
    out_file = Path(out_file)
    if out_file.suffix != ".safetensors":
        raise ValueError(f"vae: the output file must end in .safetensors, got {out_file}")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads(vae.to_json_string())  # also holds _class_name and _diffusers_version
    state_dict = {name: tensor.detach().contiguous() for name, tensor in vae.state_dict().items()}
    metadata = {CONFIG_KEY: json.dumps(config), TRAINING_KEY: json.dumps(training)}
    save_file(state_dict, out_file, metadata=metadata)
    sidecar = out_file.with_name(SIDECAR_NAME)
    sidecar_config = {**config, SIDECAR_TRAINING_KEY: training}
    sidecar.write_text(json.dumps(sidecar_config, indent=2) + "\n", encoding="utf-8")
    return sidecar


def read_vae_metadata(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(diffusers config, training record)`` stored in a file written by :func:`save_vae_file`."""
    from impasto.models.single_file.file_errors import check_safetensors

    path = Path(path)
    if not path.exists():
        raise ValueError(f"vae: {path} does not exist; train one with `impasto train-vae`")
    check_safetensors(path, "vae", f"vae: {path}")  # a folder, unreadable, truncated, ...
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"vae: cannot read {path} as safetensors ({error})") from None
    if CONFIG_KEY not in metadata:
        raise ValueError(f"vae: {path} has no VAE config in its metadata; was it made by impasto?")
    return json.loads(metadata[CONFIG_KEY]), json.loads(metadata.get(TRAINING_KEY, "{}"))


def load_vae_file(path: Path) -> AutoencoderKL:
    """Rebuild the ``AutoencoderKL`` saved by :func:`save_vae_file`, in eval mode, fp32.

    The global torch RNG is left as it was (building the module draws a throwaway init).
    """
    config, _ = read_vae_metadata(path)
    with torch.random.fork_rng(devices=[]):
        vae = AutoencoderKL.from_config(config)
    vae.load_state_dict(load_file(str(path)), strict=True)
    return vae.eval()


def load_demo_vae() -> AutoencoderKL:
    """The demo VAE shipped in the package (trained on the demo shapes, see docs/demo-vae.md)."""
    with as_file(files("impasto").joinpath(*DEMO_VAE_ASSET)) as path:
        return load_vae_file(path)
