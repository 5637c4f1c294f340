"""Loading Wan 2.1 text-to-video from a local diffusers folder (``model.path``), offline,
float32: the layout of ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` and ``-14B-Diffusers``
(``transformer/``, ``vae/``, ``text_encoder/`` (umT5), ``tokenizer/``, ``scheduler/``),
safetensors weights only (:mod:`impasto.models.transformer_families`; the VAE through
:func:`impasto.models.video_autoencoder.load_video_vae`). ``save_wan_folder`` writes the same
layout, which ``WanPipeline.from_pretrained`` reads too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import WanTransformer3DModel
from transformers import AutoTokenizer, UMT5EncoderModel

from impasto.models.transformer_families import (
    FP32_DIFFUSERS,
    FP32_TRANSFORMERS,
    SETTING,
    check_folder,
    load_network,
    load_tokenizer,
)
from impasto.models.video_autoencoder import load_video_vae
from impasto.models.wan.components import SCHEDULER, SCHEDULER_CLASS, WanComponents
from impasto.models.wan.options import MAX_TEXT_LENGTH

LAYOUT = (
    "expected a diffusers Wan2.1-T2V folder (transformer/, vae/, text_encoder/, tokenizer/, "
    "scheduler/)"
)


def wan_scheduler_config(root: Path) -> dict[str, Any]:
    """``scheduler/scheduler_config.json`` (WanPipeline's UniPC) without its private keys;
    Wan2.1's 480p config where the folder has none."""
    file = root / "scheduler" / "scheduler_config.json"
    if not file.is_file():
        return dict(SCHEDULER)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{SETTING} {root}: cannot read {file.name} ({error})") from None
    if not isinstance(config, dict) or config.get("_class_name", SCHEDULER_CLASS) != (
        SCHEDULER_CLASS
    ):
        raise ValueError(f"{SETTING} {root}: scheduler/ is not a {SCHEDULER_CLASS}; {LAYOUT}")
    return {key: value for key, value in config.items() if not key.startswith("_")}


def load_wan_folder(path: str | Path, text_length: int | None) -> WanComponents:
    """The Wan2.1-T2V diffusers folder ``path`` (module docstring), float32, eval mode,
    offline; umT5 reads ``text_length`` tokens (None: the tokenizer's ``model_max_length``
    where it is at most 512 (an exported run's), else 512)."""
    root = Path(path)
    check_folder(root, "a diffusers Wan2.1-T2V folder", "model.path", LAYOUT)
    transformer = load_network(root, "transformer", WanTransformer3DModel, FP32_DIFFUSERS, LAYOUT)
    if not (root / "vae").is_dir():
        raise ValueError(f"{SETTING} {root}: no vae/ folder; {LAYOUT}")
    vae = load_video_vae(root, SETTING)
    text_encoder = load_network(root, "text_encoder", UMT5EncoderModel, FP32_TRANSFORMERS, LAYOUT)
    tokenizer = load_tokenizer(root, "tokenizer", AutoTokenizer, LAYOUT)
    if text_length is None:
        saved = getattr(tokenizer, "model_max_length", None)
        text_length = saved if isinstance(saved, int) and 0 < saved <= MAX_TEXT_LENGTH else None
    tokenizer.model_max_length = text_length or MAX_TEXT_LENGTH
    return WanComponents(transformer, vae, text_encoder, tokenizer, wan_scheduler_config(root))


TOKENIZER_RELEASE = "tokenizer/ of a Wan2.1 diffusers release (spiece.model, tokenizer.json)"


def files_only(model: Any, options: Any) -> bool:
    """Every network comes from a single file (transformer, ``model.vae``, umT5): the preset
    then gives the architecture alone, its parameters on the meta device."""
    named = (options.transformer, model.vae, options.text_encoder)
    return model.path is None and all(path is not None for path in named)


def load_text_file(components: WanComponents, model: Any, options: Any) -> None:
    """``model.wan.text_encoder`` (umT5) and ``model.wan.tokenizer`` into ``components``."""
    from impasto.models.encoder_files import load_text_files, load_tokenizer_folder

    load_text_files(components, options, "wan", {"text_encoder": ""})
    if options.tokenizer is not None:
        length = options.text_length or MAX_TEXT_LENGTH
        components.tokenizer = load_tokenizer_folder(
            options.tokenizer, "model.wan.tokenizer", AutoTokenizer, length, TOKENIZER_RELEASE
        )
    elif options.text_encoder is not None and model.path is None and model.preset != "tiny":
        raise ValueError(
            "model.wan.tokenizer: not set; model.wan.text_encoder without model.path needs "
            f"umT5's tokenizer: set it to {TOKENIZER_RELEASE}"
        )


def load_vae_setting(path: str | Path, like: Any) -> Any:
    """``model.vae``: a ``.safetensors`` file (:mod:`.vae_file`) or a diffusers folder."""
    if Path(path).suffix.lower() == ".safetensors":
        from impasto.models.wan.vae_file import load_wan_vae_file

        return load_wan_vae_file(path, like)
    return load_video_vae(path)


def wan_pipeline(components: WanComponents) -> Any:
    """diffusers' ``WanPipeline`` over ``components`` (shared, not copied)."""
    from diffusers import WanPipeline

    pipeline = WanPipeline(
        tokenizer=components.tokenizer, text_encoder=components.text_encoder,
        vae=components.vae, scheduler=components.scheduler(),
        transformer=components.transformer,
    )  # fmt: skip
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def save_wan_folder(components: WanComponents, path: str | Path) -> Path:
    """Write ``components`` as a diffusers Wan folder (``WanPipeline`` layout)."""
    root = Path(path)
    wan_pipeline(components).save_pretrained(str(root), safe_serialization=True)
    return root


def write_diffusers_folder(
    backbone: Any, out: Path, record: dict[str, Any], dtype: torch.dtype
) -> Path:
    """``impasto export --format diffusers`` of a Wan run (``FamilySpec.exports``): the rebuilt
    backbone (adapters merged, cast to ``dtype`` by the exporter) as a diffusers Wan folder,
    which ``WanPipeline.from_pretrained`` and ``model.path`` read. ``record`` is not written:
    the folder's scheduler config says how it samples."""
    return save_wan_folder(backbone.components, out)
