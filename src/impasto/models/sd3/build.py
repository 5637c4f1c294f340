"""Building the SD3.5 family from ``config.model``: a preset (``tiny``, or the full-size
``medium`` and ``large`` architectures; random, from ``model.init_seed``) or a local diffusers
SD3.5 folder (``model.path``), with the options of ``model.sd3``; ``model.sd3.transformer``
and ``text_encoder`` / ``_2`` / ``_3`` load a network's weights from one file each, ``model.vae``
swaps the VAE (a separate file, or the checkpoint's ``first_stage_model.*``). With every file
and no folder, the preset gives the architecture alone (parameters on the meta device)."""

from __future__ import annotations

import os
import warnings
from typing import Any

from impasto.models.backbone import FamilySpec, register_backbone, register_family
from impasto.models.sd3.backbone import Sd3Backbone
from impasto.models.sd3.components import PART_NAMES, PRESETS
from impasto.models.sd3.files import (
    files_only,
    load_sd3_folder,
    load_text_files,
    write_diffusers_folder,
)
from impasto.models.sd3.lora import LORA_EXPORTS
from impasto.models.sd3.options import Sd3Options
from impasto.models.sd3.single_file import load_transformer_file, write_single_file
from impasto.models.transformer_families import FamilyBuild, build_components, swap_vae

SPEC = FamilySpec(
    parts=PART_NAMES,
    presets=tuple(PRESETS),
    options=Sd3Options,
    exports={"diffusers": write_diffusers_folder, "single-file": write_single_file},
    lora_exports=LORA_EXPORTS,
    # SD3, SD3.5 Large / Medium folders; trained (and sampled, scheduler/) at shift 3
    pipelines={"StableDiffusion3Pipeline": {"prediction_type": "flow", "flow_shift": 3.0}},
)
TRAINING_SHIFT = 3.0  # SD3.5's scheduler shift, which diffusers' SD3 scripts train at too

BUILD = FamilyBuild(
    family="sd3",
    spec=SPEC,
    frozen_part="text_encoder_3",
    frozen_name="T5",
    frozen_way_out="or train parts.text_encoder / text_encoder_2, the CLIPs",
    load_folder=lambda path, options: load_sd3_folder(
        path, options.text_length, transformer_weights=options.transformer is None
    ),
    build_preset=lambda model, options: PRESETS[model.preset](model.init_seed, options.text_length),
    files_only=files_only,
    load_transformer_file=load_transformer_file,
    load_text_files=load_text_files,  # CLIP-L, CLIP-G, T5 files, T5's tokenizer
    load_vae=swap_vae,  # another 16-channel VAE (model.vae)
)


def shift_advice(config: Any) -> str | None:
    """The one-line warning for a training run of the sd3 family left at the generic
    ``objective.flow_shift: 1.0``: SD3.5 was trained, and samples (its scheduler), at 3.0;
    None when the shift was set (or the run is not a flow run)."""
    objective = getattr(config, "objective", None)
    if objective is None or getattr(objective, "prediction_type", None) != "flow":
        return None
    if objective.flow_shift != 1.0 or objective.flow_shift_resolution is not None:
        return None
    return (
        "objective.flow_shift is 1.0 (no shift), but SD3.5 trains and samples at shift "
        f"{TRAINING_SHIFT} (its scheduler; diffusers' SD3 scripts): set objective.flow_shift: "
        f"{TRAINING_SHIFT} unless you mean kohya's --training_shift default of 1.0"
    )


@register_backbone("sd3")
def build_sd3_backbone(config: Any) -> Sd3Backbone:
    """SD3.5 of ``config.model``: a preset or a diffusers folder."""
    advice = shift_advice(config) if getattr(config, "train", None) is not None else None
    if advice is not None and os.environ.get("RANK", "0") == "0":
        warnings.warn(advice, stacklevel=2)
    return Sd3Backbone(*build_components(config, BUILD))


register_family("sd3")(SPEC)
