"""Building the Wan family from ``config.model``: a preset (``tiny``, or the full-size ``1.3b``
and ``14b`` architectures; random, from ``model.init_seed``) or a local diffusers Wan2.1-T2V
folder (``model.path``), with the options of ``model.wan``; ``model.wan.transformer`` and
``text_encoder`` (umT5) load a network's weights from one file each, ``model.vae`` swaps the
video VAE (another ``AutoencoderKLWan`` folder, or ``wan_2.1_vae.safetensors``). With the three
files and no folder, the preset gives the architecture alone (parameters on the meta device)."""

from __future__ import annotations

from typing import Any

from impasto.models.backbone import (
    ClipBenchModel,
    FamilySpec,
    register_backbone,
    register_family,
)
from impasto.models.transformer_families import FamilyBuild, build_components
from impasto.models.wan.backbone import WanBackbone
from impasto.models.wan.components import PART_NAMES, PRESETS
from impasto.models.wan.files import (
    files_only,
    load_text_file,
    load_vae_setting,
    load_wan_folder,
    write_diffusers_folder,
)
from impasto.models.wan.lora import LORA_EXPORTS
from impasto.models.wan.options import MAX_TEXT_LENGTH, WanOptions
from impasto.models.wan.single_file import load_transformer_file, write_single_file

SPEC = FamilySpec(
    parts=PART_NAMES,
    presets=tuple(PRESETS),
    options=WanOptions,
    exports={"diffusers": write_diffusers_folder, "single-file": write_single_file},
    lora_exports=LORA_EXPORTS,
    pipelines={"WanPipeline": {"prediction_type": "flow"}},  # Wan2.1-T2V-*-Diffusers folders
    video=True,
    # impasto bench --model wan-video-1.3b | wan-video-14b: 33-frame clips at 512² (9 latent
    # frames of 32×32 patches: 9216 tokens), the LoRA preset's (configs/wan-t2v-lora.yaml)
    clip_bench={
        f"video-{size}": ClipBenchModel(preset=size, options={}, resolution=512, frames=(33,))
        for size in ("1.3b", "14b")
    },
)

BUILD = FamilyBuild(
    family="wan",
    spec=SPEC,
    frozen_part="text_encoder",  # umT5-XXL: 5.7 B parameters read once per caption
    frozen_name="umT5",
    frozen_way_out="and train parts.transformer",
    load_folder=lambda path, options: load_wan_folder(path, options.text_length),
    build_preset=lambda model, options: PRESETS[model.preset](
        model.init_seed, options.text_length or MAX_TEXT_LENGTH
    ),
    files_only=files_only,
    load_transformer_file=load_transformer_file,  # the original layout or diffusers' names
    load_text_files=load_text_file,  # umT5's file and tokenizer
    load_vae=load_vae_setting,  # another Wan 2.1 VAE: a folder or wan_2.1_vae.safetensors
)


@register_backbone("wan")
def build_wan_backbone(config: Any) -> WanBackbone:
    """Wan 2.1 of ``config.model``: a preset or a diffusers folder."""
    components, options = build_components(config, BUILD)
    # the length the tokenizer pads to: the option, or the folder's own (load_wan_folder)
    options = options.model_copy(update={"text_length": components.tokenizer.model_max_length})
    return WanBackbone(components, options)


register_family("wan")(SPEC)
