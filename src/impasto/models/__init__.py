"""SDXL models: components, text/size conditioning, presets and diffusers-folder I/O."""

from __future__ import annotations

from impasto.models.components import (
    PromptEmbeds,
    SDXLComponents,
    add_time_ids,
    encode_prompts,
)
from impasto.models.io import load_diffusers, save_diffusers, sdxl_scheduler, to_pipeline
from impasto.models.presets import PRESETS, build_preset, build_tiny
from impasto.models.tokenizers import load_clip_tokenizers


def load_components(preset: str | None, path: str | None, seed: int = 0) -> SDXLComponents:
    """Build the random preset ``preset`` or load the diffusers folder ``path`` (exactly one)."""
    if (preset is None) == (path is None):
        raise ValueError(
            "set exactly one of model.preset (one of "
            f"{sorted(PRESETS)}) and model.path (a diffusers SDXL folder)"
        )
    if preset is not None:
        return build_preset(preset, seed)
    return load_diffusers(path)


__all__ = [
    "PRESETS",
    "PromptEmbeds",
    "SDXLComponents",
    "add_time_ids",
    "build_preset",
    "build_tiny",
    "encode_prompts",
    "load_clip_tokenizers",
    "load_components",
    "load_diffusers",
    "save_diffusers",
    "sdxl_scheduler",
    "to_pipeline",
]
