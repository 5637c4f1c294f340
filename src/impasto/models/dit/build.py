"""Building the DiT family from ``config.model``: a preset (a size, randomly initialised), or an
exported DiT folder (:mod:`impasto.models.dit.files`); text encoders from ``model.text_encoder``
and the autoencoder from ``model.vae`` where given.

Presets: ``tiny`` takes the demo's tiny random CLIP encoders (with the demo's larger initial
weights, docs/demo.md) and the shipped demo VAE, so it trains on a CPU in minutes. The others
take random full-size SDXL text encoders (benchmarks) unless ``model.text_encoder`` names a
text folder (an SDXL folder's CLIP pair, or one transformers encoder:
:mod:`impasto.models.dit.text`), and the demo VAE unless ``model.vae`` names another.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKL
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from impasto.models import autoencoder
from impasto.models.backbone import FamilySpec, register_backbone, register_family
from impasto.models.dit.backbone import PART_NAMES, DiTBackbone, DiTComponents
from impasto.models.dit.files import save_dit_folder
from impasto.models.dit.network import DiT, DiTConfig
from impasto.models.dit.options import DiTOptions
from impasto.models.dit.sizes import CLIP_BENCH, SIZES
from impasto.models.dit.text import (
    TextEncoders,
    check_pair_length,
    load_text_folder,
    text_dims,
)
from impasto.models.exported import read_record
from impasto.models.presets import DEMO_TEXT_INITIALIZER_FACTOR, tiny_text_encoders
from impasto.models.tokenizers import load_clip_tokenizers
from impasto.models.vae_files import load_demo_vae

SPEC = FamilySpec(
    parts=PART_NAMES,
    presets=tuple(SIZES),
    options=DiTOptions,
    reads_text_encoder=True,
    exports={"folder": save_dit_folder},
    tensor_parallel=True,
    context_parallel=True,
    pipeline_parallel=True,
    video=True,
    clip_bench=CLIP_BENCH,
)


def random_sdxl_text_encoders() -> tuple[nn.Module, nn.Module]:
    """SDXL's CLIP-L and OpenCLIP bigG architectures, randomly initialised."""
    from impasto.models.single_file.configs import sdxl_base_configs

    configs = sdxl_base_configs()
    return (
        CLIPTextModel(CLIPTextConfig.from_dict(configs.text_encoder)),
        CLIPTextModelWithProjection(CLIPTextConfig.from_dict(configs.text_encoder_2)),
    )


def default_text_encoders(size: str, options: DiTOptions) -> TextEncoders:
    """A preset's own text encoders (no ``model.text_encoder``): SDXL's CLIP pair, tiny or
    full-size, random, from the global RNG."""
    check_pair_length(options.text_length)
    if size == "tiny":
        encoder, encoder_2 = tiny_text_encoders(DEMO_TEXT_INITIALIZER_FACTOR)
    else:
        encoder, encoder_2 = random_sdxl_text_encoders()
    return TextEncoders(encoder, encoder_2, *load_clip_tokenizers())


def build_preset(
    size: str, options: DiTOptions, seed: int, text_encoder: str | None, vae: AutoencoderKL
) -> DiTComponents:
    """A randomly initialised DiT of ``size`` over ``vae``, with its text encoders; the
    global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if text_encoder is not None:
            texts = load_text_folder(text_encoder, "model.text_encoder", options.text_length)
        else:
            texts = default_text_encoders(size, options)
        text_dim, pooled_dim = text_dims(texts)
        config = DiTConfig(
            size=size, block=options.block, patch_size=options.patch_size,
            in_channels=autoencoder.latent_format(vae)[0], text_dim=text_dim,
            pooled_dim=pooled_dim, qk_norm=options.qk_norm, position=options.position,
            max_grid=options.max_grid,
            text_tokens=options.text_length if texts.encoder_2 is not None else None,
            frame_patch=options.frame_patch, attention=options.attention,
        )  # fmt: skip
        transformer = DiT(config)
    components = DiTComponents(transformer, vae, *texts)
    for module in components.networks().values():
        module.eval()
    return components


def load_autoencoder(path: str | None, kind: str) -> nn.Module:
    """``model.dit.autoencoder``'s VAE: ``image``, the demo VAE or ``model.vae`` (a diffusers
    ``AutoencoderKL``); ``video``, the demo video VAE or ``model.vae`` (Wan 2.1's
    ``AutoencoderKLWan`` folder)."""
    if kind == "video":
        from impasto.models import video_autoencoder

        if path is None:
            return video_autoencoder.load_demo_video_vae()
        return video_autoencoder.load_video_vae(path)
    vae = load_demo_vae()
    if path is not None:
        from impasto.models.vae_swap import load_vae

        vae = load_vae(path, vae)
    return vae


def check_objective_fits(path: str, prediction_type: str) -> None:
    """Refuse to continue an exported DiT with another prediction type than it learned (it
    would unlearn its target within steps, as an SDXL v-pred file trained on ε)."""
    trained = (read_record(path, "dit").get("objective") or {}).get("prediction_type")
    if trained is not None and trained != prediction_type:
        raise ValueError(
            f"model.path {path}: this DiT was trained with prediction_type {trained}, the "
            f"config says {prediction_type}; set objective.prediction_type: {trained}"
        )


@register_backbone("dit")
def build_dit_backbone(config: Any) -> DiTBackbone:
    """The DiT of ``config.model``: a preset, or an exported DiT folder (``model.path``)."""
    from impasto.models.dit.files import load_dit_folder

    model = config.model
    options = SPEC.read_options(model.options, "dit")
    if model.path is not None:
        check_objective_fits(model.path, config.objective.prediction_type)
        components = load_dit_folder(model.path)
    else:
        vae = load_autoencoder(model.vae, options.autoencoder)
        components = build_preset(model.preset, options, model.init_seed, model.text_encoder, vae)
    parts = getattr(config, "parts", None)  # sampling builds from the model section alone
    check_parts_exist(components, (parts.model_extra if parts is not None else None) or {})
    return DiTBackbone(components, options.kernel)


def check_parts_exist(components: DiTComponents, named: dict[str, Any]) -> None:
    """A ``parts.<name>`` of a part this DiT lacks (``text_encoder_2`` beside one text
    encoder) is a one-line error, not a silent no-op."""
    for key in named:
        name = key.removesuffix("_lr")
        if name in PART_NAMES and name not in components.parts():
            raise ValueError(
                f"parts.{key}: this DiT has one text encoder, so no {name}; its parts: "
                f"{', '.join(components.parts())}; remove parts.{key}"
            )


register_family("dit")(SPEC)
