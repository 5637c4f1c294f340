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
from impasto.models.flux.single_file import load_transformer_file
from impasto.models.single_file.load import parameters_on_meta

SPEC = FamilySpec(
    parts=PART_NAMES,
    presets=tuple(PRESETS),
    options=FluxOptions,
    exports={"diffusers": write_diffusers_folder},
    lora_exports=LORA_EXPORTS,
    pipelines={"FluxPipeline": {"prediction_type": "flow"}},  # FLUX.1-dev, -schnell folders
)

FROZEN_ONLY = ("text_encoder_2",)  # T5-XXL: 4.7 B parameters read once per caption


def check_parts(parts: Any) -> None:
    """``parts.text_encoder_2`` (T5) may only be frozen: a one-line error otherwise."""
    if parts is None:
        return
    for name in FROZEN_ONLY:
        mode = parts.mode(name)
        if mode != "frozen":
            raise ValueError(
                f"parts.{name}: {mode}, but the flux family trains T5 frozen only; set "
                f"parts.{name}: frozen (or train parts.text_encoder, CLIP-L)"
            )


@register_backbone("flux")
def build_flux_backbone(config: Any) -> FluxBackbone:
    """FLUX.1 of ``config.model``: a preset or a diffusers folder."""
    model = config.model
    options = SPEC.read_options(model.options, "flux")
    check_parts(getattr(config, "parts", None))  # sampling builds from the model section alone
    if model.path is not None:
        own_weights = options.transformer is None
        components = load_flux_folder(model.path, options.text_length, own_weights)
    elif files_only(model, options):  # the preset's architecture, the files' weights
        with parameters_on_meta():
            components = PRESETS[model.preset](model.init_seed, options.text_length)
    else:
        components = PRESETS[model.preset](model.init_seed, options.text_length)
    if options.transformer is not None:  # a single transformer file (original layout)
        load_transformer_file(options.transformer, components.transformer)
    if model.vae is not None:  # another 16-channel VAE (model.vae; ae.safetensors)
        from impasto.models.vae_swap import load_vae

        components.vae = load_vae(model.vae, components.vae)
    load_text_files(components, model, options)  # CLIP-L, T5 files and T5's tokenizer
    return FluxBackbone(components, options)


register_family("flux")(SPEC)
