"""Building the DiT family from ``config.model``: a preset (a size, randomly initialised), or an
exported DiT folder (:mod:`impasto.models.dit.files`); text encoders from ``model.text_encoder``
and the autoencoder from ``model.vae`` where given.

Presets: ``tiny`` takes the demo's tiny random CLIP encoders (with the demo's larger initial
weights, docs/demo.md) and the shipped demo VAE, so it trains on a CPU in minutes. The others
take random full-size SDXL text encoders (benchmarks) unless ``model.text_encoder`` names an
SDXL folder, and the demo VAE unless ``model.vae`` names another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from impasto.models.backbone import FamilySpec, register_backbone, register_family
from impasto.models.dit.backbone import PART_NAMES, DiTBackbone, DiTComponents
from impasto.models.dit.files import save_dit_folder
from impasto.models.dit.network import DiT, DiTConfig
from impasto.models.dit.options import DiTOptions
from impasto.models.dit.sizes import SIZES
from impasto.models.exported import read_record
from impasto.models.presets import DEMO_TEXT_INITIALIZER_FACTOR, tiny_text_encoders
from impasto.models.tokenizers import (
    TOKENIZER_2_PAD_TOKEN,
    TOKENIZER_PAD_TOKEN,
    load_clip_tokenizers,
)
from impasto.models.vae_files import load_demo_vae

SPEC = FamilySpec(
    parts=PART_NAMES,
    presets=tuple(SIZES),
    options=DiTOptions,
    reads_text_encoder=True,
    exports={"folder": save_dit_folder},
    tensor_parallel=True,
)


def text_dims(text_encoder: nn.Module, text_encoder_2: nn.Module) -> tuple[int, int]:
    """(features of a text token, of the pooled text) under SDXL's conditioning."""
    hidden = text_encoder.config.hidden_size + text_encoder_2.config.hidden_size
    return hidden, text_encoder_2.config.projection_dim


def random_sdxl_text_encoders() -> tuple[nn.Module, nn.Module]:
    """SDXL's CLIP-L and OpenCLIP bigG architectures, randomly initialised."""
    from impasto.models.single_file.configs import sdxl_base_configs

    configs = sdxl_base_configs()
    return (
        CLIPTextModel(CLIPTextConfig.from_dict(configs.text_encoder)),
        CLIPTextModelWithProjection(CLIPTextConfig.from_dict(configs.text_encoder_2)),
    )


def load_text_encoders(
    path: str | Path, setting: str = "model.text_encoder"
) -> tuple[nn.Module, nn.Module, Any, Any]:
    """The two CLIP encoders and tokenizers of a folder in the diffusers SDXL layout (an SDXL
    folder or an exported DiT), float32, offline; ``setting`` names the config key in errors."""
    from impasto.models.io import TRANSFORMERS_DTYPE_KWARG, load_component, load_tokenizer

    root = Path(path)
    for sub in ("text_encoder", "text_encoder_2"):
        if not (root / sub / "config.json").is_file():
            raise ValueError(
                f"{setting} {root}: no {sub}/config.json; it needs the diffusers SDXL layout "
                "(text_encoder/ and text_encoder_2/ inside)"
            )
    fp32 = {TRANSFORMERS_DTYPE_KWARG: torch.float32}
    return (
        load_component(CLIPTextModel, root, "text_encoder", **fp32),
        load_component(CLIPTextModelWithProjection, root, "text_encoder_2", **fp32),
        load_tokenizer(root, "tokenizer", TOKENIZER_PAD_TOKEN),
        load_tokenizer(root, "tokenizer_2", TOKENIZER_2_PAD_TOKEN),
    )


def build_preset(
    size: str, options: DiTOptions, seed: int, text_encoder: str | None, vae: AutoencoderKL
) -> DiTComponents:
    """A randomly initialised DiT of ``size`` over ``vae``, with its text encoders; the
    global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if text_encoder is not None:
            encoder, encoder_2, tokenizer, tokenizer_2 = load_text_encoders(text_encoder)
        else:
            if size == "tiny":
                encoder, encoder_2 = tiny_text_encoders(DEMO_TEXT_INITIALIZER_FACTOR)
            else:
                encoder, encoder_2 = random_sdxl_text_encoders()
            tokenizer, tokenizer_2 = load_clip_tokenizers()
        text_dim, pooled_dim = text_dims(encoder, encoder_2)
        config = DiTConfig(
            size=size, block=options.block, patch_size=options.patch_size,
            in_channels=int(vae.config.latent_channels), text_dim=text_dim,
            pooled_dim=pooled_dim, qk_norm=options.qk_norm, position=options.position,
            max_grid=options.max_grid,
        )  # fmt: skip
        transformer = DiT(config)
    for module in (transformer, vae, encoder, encoder_2):
        module.eval()
    return DiTComponents(transformer, vae, encoder, encoder_2, tokenizer, tokenizer_2)


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
        vae = load_demo_vae()
        if model.vae is not None:
            from impasto.models.vae_swap import load_vae

            vae = load_vae(model.vae, vae)
        components = build_preset(model.preset, options, model.init_seed, model.text_encoder, vae)
    return DiTBackbone(components, options.attention)


register_family("dit")(SPEC)
