"""Loading SD3.5 from a local diffusers folder (``model.path``), offline, float32: the layout of
``stabilityai/stable-diffusion-3.5-large`` and ``-medium`` (``transformer/``, ``vae/``,
``text_encoder/`` (CLIP-L), ``text_encoder_2/`` (CLIP-G), ``text_encoder_3/`` (T5),
``tokenizer/``, ``tokenizer_2/``, ``tokenizer_3/``, ``scheduler/``), safetensors weights only
(:mod:`impasto.models.transformer_families`). ``save_sd3_folder`` writes the same layout, which
``StableDiffusion3Pipeline.from_pretrained`` reads too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from impasto.models.sd3.components import SCHEDULER, Sd3Components
from impasto.models.transformer_families import (
    FP32_DIFFUSERS,
    FP32_TRANSFORMERS,
    check_folder,
    load_network,
    load_tokenizer,
    scheduler_config,
    transformer_from_config,
)

LAYOUT = (
    "expected a diffusers SD3.5 folder (transformer/, vae/, text_encoder/, text_encoder_2/, "
    "text_encoder_3/, tokenizer/, tokenizer_2/, tokenizer_3/, scheduler/)"
)
NETWORKS: dict[str, tuple[Any, tuple]] = {
    "transformer": (SD3Transformer2DModel, FP32_DIFFUSERS),
    "vae": (AutoencoderKL, FP32_DIFFUSERS),
    "text_encoder": (CLIPTextModelWithProjection, FP32_TRANSFORMERS),
    "text_encoder_2": (CLIPTextModelWithProjection, FP32_TRANSFORMERS),
    "text_encoder_3": (T5EncoderModel, FP32_TRANSFORMERS),
}
"""subfolder → (class, its weight files and from_pretrained's dtype keyword)."""


def load_sd3_folder(
    path: str | Path, text_length: int, transformer_weights: bool = True
) -> Sd3Components:
    """The SD3.5 diffusers folder ``path`` (module docstring), float32, eval mode, offline;
    T5 pads to ``text_length`` tokens. ``transformer_weights`` False: the transformer's
    architecture only, on the meta device (``model.sd3.transformer`` brings the weights)."""
    root = Path(path)
    if root.suffix.lower() == ".safetensors":
        from impasto.models.sd3.single_file import file_variant, single_file_advice

        if file_variant(root) is not None:  # an SD3 transformer: say which, and what else
            raise ValueError(single_file_advice(root, "model.path"))
    check_folder(root, "a diffusers SD3.5 folder", "model.sd3.transformer", LAYOUT)
    networks = {
        name: load_network(root, name, model_class, kind, LAYOUT)
        for name, (model_class, kind) in NETWORKS.items()
        if transformer_weights or name != "transformer"
    }
    if not transformer_weights:
        networks["transformer"] = transformer_from_config(root, SD3Transformer2DModel, LAYOUT)
    tokenizer_3 = load_tokenizer(root, "tokenizer_3", T5Tokenizer, LAYOUT)
    tokenizer_3.model_max_length = text_length
    return Sd3Components(
        **networks,
        tokenizer=load_tokenizer(root, "tokenizer", CLIPTokenizer, LAYOUT),
        tokenizer_2=load_tokenizer(root, "tokenizer_2", CLIPTokenizer, LAYOUT),
        tokenizer_3=tokenizer_3,
        scheduler_config=scheduler_config(root, SCHEDULER, LAYOUT),
    )


TEXT_FILES = {
    "text_encoder": "text_encoders.clip_l.",
    "text_encoder_2": "text_encoders.clip_g.",
    "text_encoder_3": "text_encoders.t5xxl.",
}
"""The text encoders a ``model.sd3.<part>`` file may replace, each one's prefix in a whole SD3
checkpoint."""
TOKENIZER_RELEASE = "tokenizer_3/ of an SD3.5 release (spiece.model, tokenizer.json)"


def files_only(model: Any, options: Any) -> bool:
    """Every network comes from a single file (transformer, ``model.vae``, the three
    encoders): the preset then gives the architecture alone, its parameters on meta."""
    named = (options.transformer, model.vae, *(getattr(options, part) for part in TEXT_FILES))
    return model.path is None and all(path is not None for path in named)


def load_text_files(components: Sd3Components, model: Any, options: Any) -> None:
    """``model.sd3.text_encoder`` (CLIP-L), ``text_encoder_2`` (CLIP-G), ``text_encoder_3``
    (T5) and ``tokenizer_3`` into ``components``, in place."""
    from impasto.models.encoder_files import load_text_files as load_files
    from impasto.models.encoder_files import load_tokenizer_folder

    load_files(components, options, "sd3", TEXT_FILES)
    if options.tokenizer_3 is not None:
        components.tokenizer_3 = load_tokenizer_folder(
            options.tokenizer_3, "model.sd3.tokenizer_3", T5Tokenizer, options.text_length,
            TOKENIZER_RELEASE,
        )  # fmt: skip
    elif options.text_encoder_3 is not None and model.path is None and model.preset != "tiny":
        raise ValueError(
            "model.sd3.tokenizer_3: not set; model.sd3.text_encoder_3 without model.path needs "
            f"T5's tokenizer: set it to {TOKENIZER_RELEASE}"
        )


def sd3_pipeline(components: Sd3Components) -> Any:
    """diffusers' ``StableDiffusion3Pipeline`` over ``components`` (shared, not copied)."""
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline(
        scheduler=components.scheduler(), vae=components.vae,
        text_encoder=components.text_encoder, tokenizer=components.tokenizer,
        text_encoder_2=components.text_encoder_2, tokenizer_2=components.tokenizer_2,
        text_encoder_3=components.text_encoder_3, tokenizer_3=components.tokenizer_3,
        transformer=components.transformer,
    )  # fmt: skip
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def save_sd3_folder(components: Sd3Components, path: str | Path) -> Path:
    """Write ``components`` as a diffusers SD3.5 folder (``StableDiffusion3Pipeline`` layout)."""
    root = Path(path)
    sd3_pipeline(components).save_pretrained(str(root), safe_serialization=True)
    return root


def write_diffusers_folder(
    backbone: Any, out: Path, record: dict[str, Any], dtype: torch.dtype
) -> Path:
    """``impasto export --format diffusers`` of an SD3.5 run (``FamilySpec.exports``): the
    rebuilt backbone (adapters merged, cast to ``dtype`` by the exporter) as a diffusers SD3.5
    folder, which ``StableDiffusion3Pipeline.from_pretrained`` and ``model.path`` read.
    ``record`` (the run's objective) is not written: the folder's scheduler config says how it
    samples."""
    return save_sd3_folder(backbone.components, out)
