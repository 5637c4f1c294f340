"""Network configs for single-file checkpoints: SDXL base's (shipped) or the file's own.

A single file (SGM / A1111 / ComfyUI layout) holds weights only, so the architecture comes from
elsewhere: for a checkpoint from the wild, the configs of
``stabilityai/stable-diffusion-xl-base-1.0`` (``unet/``, ``vae/``, ``text_encoder/`` and
``text_encoder_2/config.json``, shipped in ``impasto/assets/sdxl``); for a file impasto wrote,
the configs it stored in the safetensors metadata, so that other architectures (the ``tiny``
preset) round-trip too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib.resources import files
from typing import Any

from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from impasto.models.components import SDXLComponents
from impasto.models.tokenizers import load_clip_tokenizers

CONFIGS_METADATA_KEY = "impasto.configs"  # safetensors metadata entry written by save_single_file
COMPONENT_NAMES = ("unet", "vae", "text_encoder", "text_encoder_2")


@dataclass(frozen=True)
class ComponentConfigs:
    """Plain-JSON configs of the four networks (diffusers ``config`` / transformers ``to_dict``)."""

    unet: dict[str, Any]
    vae: dict[str, Any]
    text_encoder: dict[str, Any]
    text_encoder_2: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> ComponentConfigs:
        """Parse :meth:`to_json` output; raise ``ValueError`` if it is not that."""
        try:
            fields = json.loads(text)
            return cls(**{name: dict(fields[name]) for name in COMPONENT_NAMES})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed {CONFIGS_METADATA_KEY} metadata ({err})") from err


def sdxl_base_configs() -> ComponentConfigs:
    """The configs of SDXL 1.0 base, read from ``impasto/assets/sdxl/<component>_config.json``."""
    asset_dir = files("impasto") / "assets" / "sdxl"
    return ComponentConfigs(
        **{
            name: json.loads((asset_dir / f"{name}_config.json").read_text(encoding="utf-8"))
            for name in COMPONENT_NAMES
        }
    )


def _public(config: dict[str, Any]) -> dict[str, Any]:
    """Drop diffusers' private entries (``_class_name``, ``_use_default_values``, ...)."""
    return {key: value for key, value in config.items() if not key.startswith("_")}


def configs_of(components: SDXLComponents) -> ComponentConfigs:
    """The configs ``components`` were built from, as plain JSON-able dicts."""
    return ComponentConfigs(
        unet=_public(dict(components.unet.config)),
        vae=_public(dict(components.vae.config)),
        text_encoder=json.loads(components.text_encoder.config.to_json_string()),
        text_encoder_2=json.loads(components.text_encoder_2.config.to_json_string()),
    )


def build_components(configs: ComponentConfigs) -> SDXLComponents:
    """Randomly initialised networks from ``configs`` plus the bundled CLIP tokenizers.

    Builds on the current default device: under ``with torch.device("meta"):`` nothing is
    allocated, which is how the full-size SDXL key map is checked without 10 GB of memory.
    """
    tokenizer, tokenizer_2 = load_clip_tokenizers()
    return SDXLComponents(
        unet=UNet2DConditionModel.from_config(_public(configs.unet)),
        vae=AutoencoderKL.from_config(_public(configs.vae)),
        text_encoder=CLIPTextModel(CLIPTextConfig.from_dict(configs.text_encoder)),
        text_encoder_2=CLIPTextModelWithProjection(
            CLIPTextConfig.from_dict(configs.text_encoder_2)
        ),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
    )
