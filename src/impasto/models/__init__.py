"""SDXL models: components, text/size conditioning, presets and diffusers-folder I/O."""

from __future__ import annotations

from pathlib import Path

from impasto.models.backbone import BACKBONES, Backbone, build_backbone, register_backbone
from impasto.models.components import (
    PromptEmbeds,
    SDXLComponents,
    add_time_ids,
    encode_prompts,
)
from impasto.models.io import load_diffusers, save_diffusers, sdxl_scheduler, to_pipeline
from impasto.models.presets import PRESETS, build_preset, build_tiny
from impasto.models.tokenizers import load_clip_tokenizers

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth")


def load_components(
    preset: str | None, path: str | None, seed: int = 0, allow_pickle: bool = False
) -> SDXLComponents:
    """Build the random preset ``preset``, or load ``path`` (exactly one): a diffusers SDXL
    folder, or a single-file SDXL checkpoint (``.safetensors``; pickles only with
    ``allow_pickle``).
    """
    if (preset is None) == (path is None):
        raise ValueError(
            "set exactly one of model.preset (one of "
            f"{sorted(PRESETS)}) and model.path (a diffusers SDXL folder or single file)"
        )
    if preset is not None:
        return build_preset(preset, seed)
    if Path(path).suffix.lower() in SINGLE_FILE_SUFFIXES:
        from impasto.models.single_file import load_single_file

        return load_single_file(path, allow_pickle=allow_pickle)
    return load_diffusers(path)


def load_model(config) -> SDXLComponents:
    """The components ``config.model`` names (a :class:`~impasto.config.Config`)."""
    model = config.model
    if model.path is not None:
        from impasto.models.markers import check_objective_fits

        objective = config.objective
        check_objective_fits(model.path, objective.prediction_type, objective.zero_terminal_snr)
    components = load_components(model.preset, model.path, model.init_seed, model.allow_pickle)
    if model.vae is not None:  # another VAE (e.g. an fp16-fix one)
        from impasto.models.vae_swap import load_vae

        components.vae = load_vae(model.vae, components.vae)
    return components


from impasto.models import dit, flux, sd3, sdxl, wan  # noqa: E402, F401  (register the families)

__all__ = [
    "BACKBONES",
    "PRESETS",
    "Backbone",
    "PromptEmbeds",
    "SDXLComponents",
    "add_time_ids",
    "build_backbone",
    "build_preset",
    "build_tiny",
    "encode_prompts",
    "load_clip_tokenizers",
    "load_components",
    "load_diffusers",
    "load_model",
    "register_backbone",
    "dit",
    "flux",
    "sdxl",
    "save_diffusers",
    "sdxl_scheduler",
    "to_pipeline",
]
