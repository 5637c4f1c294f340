"""Building the FLUX family from ``config.model``: a preset (``tiny``, or the full-size ``dev``
and ``schnell`` architectures; random, from ``model.init_seed``) or a local diffusers FLUX.1
folder (``model.path``), with the options of ``model.flux``; ``model.flux.transformer``,
``text_encoder`` and ``text_encoder_2`` load a network's weights from one file each, ``model.vae``
swaps the VAE (BFL's ``ae.safetensors``). With all four files and no folder, the preset gives
the architecture alone (parameters on the meta device, nothing initialised)."""

from __future__ import annotations

from typing import Any

from impasto.models.backbone import FamilySpec, register_backbone, register_family
from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.components import PART_NAMES, PRESETS
from impasto.models.flux.files import (
    files_only,
    load_flux_folder,
    load_text_files,
    write_diffusers_folder,
)
from impasto.models.flux.lora import LORA_EXPORTS
from impasto.models.flux.options import FluxOptions
from impasto.models.flux.single_file import load_transformer_file, write_single_file
from impasto.models.transformer_families import FamilyBuild, build_components, swap_vae

SPEC = FamilySpec(
    parts=PART_NAMES,
    presets=tuple(PRESETS),
    options=FluxOptions,
    exports={"diffusers": write_diffusers_folder, "single-file": write_single_file},
    lora_exports=LORA_EXPORTS,
    pipelines={"FluxPipeline": {"prediction_type": "flow"}},  # FLUX.1-dev, -schnell folders
)

BUILD = FamilyBuild(
    family="flux",
    spec=SPEC,
    frozen_part="text_encoder_2",  # T5-XXL: 4.7 B parameters read once per caption
    frozen_name="T5",
    frozen_way_out="or train parts.text_encoder, CLIP-L",
    load_folder=lambda path, options: load_flux_folder(
        path, options.text_length, transformer_weights=options.transformer is None
    ),
    build_preset=lambda model, options: PRESETS[model.preset](model.init_seed, options.text_length),
    files_only=files_only,
    load_transformer_file=load_transformer_file,
    load_text_files=load_text_files,  # CLIP-L, T5 files and T5's tokenizer
    load_vae=swap_vae,  # another 16-channel VAE (model.vae; ae.safetensors)
)


@register_backbone("flux")
def build_flux_backbone(config: Any) -> FluxBackbone:
    """FLUX.1 of ``config.model``: a preset or a diffusers folder."""
    return FluxBackbone(*build_components(config, BUILD))


register_family("flux")(SPEC)
