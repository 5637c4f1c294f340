"""Loading FLUX.1 from a local diffusers folder (``model.path``), offline, float32: the layout
of ``black-forest-labs/FLUX.1-dev`` (``transformer/``, ``vae/``, ``text_encoder/`` (CLIP-L),
``text_encoder_2/`` (T5), ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``), safetensors
weights only (pickled weights can run code when loaded). ``save_flux_folder`` writes the same
layout, which ``FluxPipeline.from_pretrained`` reads too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from impasto.models.flux.components import DEV_SCHEDULER, FluxComponents
from impasto.models.transformer_families import (
    FP32_DIFFUSERS,
    FP32_TRANSFORMERS,
    SETTING,
    load_network,
    load_tokenizer,
    scheduler_config,
    transformer_from_config,
)

LAYOUT = (
    "expected a diffusers FLUX.1 folder (transformer/, vae/, text_encoder/, text_encoder_2/, "
    "tokenizer/, tokenizer_2/, scheduler/)"
)
NETWORKS: dict[str, tuple[Any, tuple[tuple[str, ...], dict[str, Any]]]] = {
    "transformer": (FluxTransformer2DModel, FP32_DIFFUSERS),
    "vae": (AutoencoderKL, FP32_DIFFUSERS),
    "text_encoder": (CLIPTextModel, FP32_TRANSFORMERS),
    "text_encoder_2": (T5EncoderModel, FP32_TRANSFORMERS),
}
"""subfolder → (class, its weight file names and from_pretrained's dtype keyword)."""


def load_flux_folder(
    path: str | Path, text_length: int, transformer_weights: bool = True
) -> FluxComponents:
    """The FLUX.1 diffusers folder ``path`` (module docstring), float32, eval mode, offline;
    T5 pads to ``text_length`` tokens. ``transformer_weights`` False: the transformer's
    architecture only, on the meta device (``model.flux.transformer`` brings the weights)."""
    root = Path(path)
    if root.suffix.lower() == ".safetensors":
        from impasto.models.flux.single_file import single_file_advice

        raise ValueError(single_file_advice(root, SETTING))
    if not root.is_dir():
        raise ValueError(f"{SETTING} {root}: not a folder; {LAYOUT}")
    names = [name for name in NETWORKS if transformer_weights or name != "transformer"]
    networks = {name: load_network(root, name, *NETWORKS[name], LAYOUT) for name in names}
    if not transformer_weights:
        networks["transformer"] = transformer_from_config(root, FluxTransformer2DModel, LAYOUT)
    tokenizer_2 = load_tokenizer(root, "tokenizer_2", T5Tokenizer, LAYOUT)
    tokenizer_2.model_max_length = text_length
    return FluxComponents(
        transformer=networks["transformer"],
        vae=networks["vae"],
        text_encoder=networks["text_encoder"],
        text_encoder_2=networks["text_encoder_2"],
        tokenizer=load_tokenizer(root, "tokenizer", CLIPTokenizer, LAYOUT),
        tokenizer_2=tokenizer_2,
        scheduler_config=scheduler_config(root, DEV_SCHEDULER, LAYOUT),
    )


TEXT_FILES = {"text_encoder": "text_encoders.clip_l.", "text_encoder_2": "text_encoders.t5xxl."}
"""The text encoders a ``model.flux.<part>`` file may replace, each one's prefix in a whole
checkpoint."""
TOKENIZER_RELEASE = "tokenizer_2/ of a FLUX.1 release (spiece.model, tokenizer.json)"


def files_only(model: Any, options: Any) -> bool:
    """Every network comes from a single file (transformer, ``model.vae``, both encoders):
    the preset then gives the architecture alone, its parameters on the meta device."""
    named = (options.transformer, model.vae, options.text_encoder, options.text_encoder_2)
    return model.path is None and all(path is not None for path in named)


def load_text_files(components: FluxComponents, model: Any, options: Any) -> None:
    """``model.flux.text_encoder`` (CLIP-L), ``text_encoder_2`` (T5) and ``tokenizer_2`` into
    ``components``, in place (:mod:`impasto.models.encoder_files`)."""
    from impasto.models.encoder_files import load_text_files as load_files

    load_files(components, options, "flux", TEXT_FILES)
    if options.tokenizer_2 is not None:
        components.tokenizer_2 = load_t5_tokenizer(options.tokenizer_2, options.text_length)
    elif options.text_encoder_2 is not None and model.path is None and model.preset != "tiny":
        raise ValueError(
            "model.flux.tokenizer_2: not set; model.flux.text_encoder_2 without model.path needs "
            f"T5's tokenizer: set it to {TOKENIZER_RELEASE}"
        )


def load_t5_tokenizer(path: str | Path, text_length: int) -> Any:
    """T5's tokenizer from the folder ``path`` (``model.flux.tokenizer_2``)."""
    from impasto.models.encoder_files import load_tokenizer_folder

    setting = "model.flux.tokenizer_2"
    return load_tokenizer_folder(path, setting, T5Tokenizer, text_length, TOKENIZER_RELEASE)


def save_flux_folder(components: FluxComponents, path: str | Path) -> Path:
    """Write ``components`` as a diffusers FLUX.1 folder (``FluxPipeline`` layout)."""
    from diffusers import FluxPipeline

    root = Path(path)
    pipeline = FluxPipeline(
        scheduler=components.scheduler(),
        vae=components.vae,
        text_encoder=components.text_encoder,
        tokenizer=components.tokenizer,
        text_encoder_2=components.text_encoder_2,
        tokenizer_2=components.tokenizer_2,
        transformer=components.transformer,
    )
    pipeline.save_pretrained(str(root), safe_serialization=True)
    return root


def write_diffusers_folder(
    backbone: Any, out: Path, record: dict[str, Any], dtype: torch.dtype
) -> Path:
    """``impasto export --format diffusers`` of a FLUX run (``FamilySpec.exports``): the
    rebuilt backbone (adapters merged, cast to ``dtype`` by the exporter) as a diffusers
    FLUX.1 folder, which ``FluxPipeline.from_pretrained`` and ``model.path`` read, with
    ``record`` beside it (``impasto-model.json``: the family and size, which ``impasto
    sample`` reads; the folder's scheduler config says how it samples)."""
    from impasto.models.exported import write_record

    root = save_flux_folder(backbone.components, out)
    write_record(root, record)
    return root
