"""Rebuild the trained model of a checkpoint (for sampling, and exports from issue #5).

A checkpoint stores the trained weights and the resolved config; the frozen components are
rebuilt from ``model.*`` of that config (the preset, or the diffusers folder it was trained from).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file

from impasto.checkpoint.state import STATE_FILE, latest_checkpoint
from impasto.config import Config, build_config
from impasto.models import SDXLComponents, load_components


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest checkpoint of a run directory."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    newest = latest_checkpoint(path / "checkpoints")
    if newest is None:
        raise ValueError(
            f"{path}: neither a checkpoint (no {STATE_FILE}) nor a run directory with "
            "checkpoints/; pass RUN or RUN/checkpoints/step-XXXXXXXX"
        )
    return newest


def load_trained(path: str | Path) -> tuple[Config, SDXLComponents]:
    """The config and the components, with the trained UNet, of a checkpoint or run directory."""
    checkpoint = resolve_checkpoint(path)
    config_file = checkpoint / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"checkpoint {checkpoint}: no config.yaml; it was not written by impasto")
    config = build_config(yaml.safe_load(config_file.read_text(encoding="utf-8")))
    models = load_components(config.model.preset, config.model.path, seed=config.model.init_seed)
    weights = checkpoint / "unet.safetensors"
    try:
        state = load_file(weights)
    except (OSError, SafetensorError) as error:
        raise ValueError(
            f"checkpoint {checkpoint}: cannot read unet.safetensors ({error})"
        ) from None
    models.unet.load_state_dict(state)
    for module in (models.unet, models.vae, models.text_encoder, models.text_encoder_2):
        module.requires_grad_(False).eval()
    return config, models
