"""LoRA exports: a checkpoint's adapter tensors renamed for the tools that load them, read
straight from the checkpoint's files; the model they adapt is never built (a LoRA export of a
full-size SDXL run holds megabytes, not the 14 GB base model).

``lora-diffusers`` (``OUT/pytorch_lora_weights.safetensors``) uses names that both diffusers'
``load_lora_weights`` and ComfyUI's LoRA loader map (``comfy/lora.py``, ``model_lora_keys_unet``
and ``model_lora_keys_clip``):

- text encoders: peft's names under the transformers module path with ``text_model.``, e.g.
  ``text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight`` (ComfyUI maps
  ``text_encoder.text_model.encoder.layers.N.*`` and ``text_encoder_2.…``, nothing without
  ``text_model.``);
- UNet: diffusers' attention-processor names, e.g.
  ``unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.down.weight``
  and, for other layers, ``unet.<module>.lora.down.weight``. ComfyUI maps a diffusers UNet
  attention layer only as ``unet.<…>.attn1.processor.to_q`` (its ``.to_`` → ``.processor.to_``
  rule), so peft's ``unet.<…>.attn1.to_q.lora_A.weight`` would be dropped; diffusers reads the
  processor names (``convert_unet_state_dict_to_peft``: ``.processor.`` dropped,
  ``to_q_lora.down`` → ``to_q.lora_A``) as long as no UNet key is in peft's ``lora_A`` form.

The LoRA scale alpha/rank is folded into the ``up`` (``lora_B``) weights: ComfyUI applies a
LoRA at alpha/rank only when the file has ``<layer>.alpha`` tensors, and diffusers refuses a
file with a key that does not contain "lora"; with the scale in the weights both apply the
trained strength. ``lora-kohya`` keeps kohya's names and ``.alpha`` tensors (:mod:`lora_kohya`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from impasto.checkpoint.trained import (
    is_run_checkpoint,
    model_metadata,
    read_checkpoint_config,
    read_weights,
    resolve_checkpoint,
)
from impasto.config import Config
from impasto.export.metadata import kohya_metadata, modelspec_metadata, read_training_record
from impasto.models import SINGLE_FILE_SUFFIXES
from impasto.models.lora_kohya import to_kohya
from impasto.models.parts import ADAPTER_NAME
from impasto.models.presets import build_preset
from impasto.models.sdxl import PART_NAMES
from impasto.models.single_file import clip_text_model_key, read_configs, write_safetensors

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
DORA_MAGNITUDE = "lora_magnitude_vector"  # peft's DoRA magnitude, one per adapted layer
_FACTORS = {"lora_A.weight": "down", "lora_B.weight": "up"}  # peft -> diffusers' old names
_ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v")


def adapter_parts(config: Config, parts: tuple[str, ...] = PART_NAMES) -> list[str]:
    """The parts a run trains through adapters (``parts.<name>: lora``), in model order
    (``parts``: the family's; SDXL's by default)."""
    return [name for name in parts if config.parts.mode(name) == "lora"]


@dataclass(frozen=True)
class Adapters:
    """A checkpoint's adapter weights: per adapted part, peft's state dict
    (``get_peft_model_state_dict`` names: ``<module>.lora_A.weight``, ``.lora_B.weight``,
    ``.lora_magnitude_vector``)."""

    config: Config
    checkpoint: Path
    states: dict[str, dict[str, Tensor]]

    @property
    def alpha(self) -> float:
        lora = self.config.lora
        return float(lora.rank if lora.alpha is None else lora.alpha)


def _parameter_name(peft_key: str) -> str:
    """The trainer's parameter name (EMA keys) of a peft state-dict key."""
    if peft_key.endswith(DORA_MAGNITUDE):
        return f"{peft_key}.{ADAPTER_NAME}.weight"
    return f"{peft_key.removesuffix('.weight')}.{ADAPTER_NAME}.weight"


def _ema_states(checkpoint: Path, states: dict[str, dict[str, Tensor]]) -> dict:
    """``states`` with each tensor replaced by its EMA shadow (``ema.safetensors``, keys
    ``part.parameter``)."""
    shadows = read_weights(checkpoint, {"ema"}).get("ema")
    if shadows is None:
        raise ValueError(
            f"checkpoint {checkpoint}: no ema.safetensors; the run trained without ema.enabled"
        )
    averaged = {}
    for part, state in states.items():
        averaged[part] = {}
        for key in state:
            name = f"{part}.{_parameter_name(key)}"
            if name not in shadows:
                raise ValueError(
                    f"checkpoint {checkpoint}: ema.safetensors does not fit the model ({name!r})"
                )
            averaged[part][key] = shadows[name]
    return averaged


def read_adapters(
    path: str | Path, kinds: tuple[str, ...], fmt: str, ema: bool,
    parts: tuple[str, ...] | None = None,
) -> Adapters:  # fmt: skip
    """The adapter weights of the checkpoint (or run's newest) ``path``, from its files alone;
    one-line ValueError when the run trained no adapters or another kind than ``kinds``.
    ``parts``: the family's parts (a family's own LoRA formats); None: an SDXL run's."""
    checkpoint = resolve_checkpoint(path)
    config = read_checkpoint_config(checkpoint)
    if parts is None and config.model.family != "sdxl":
        raise ValueError(
            f"export: the formats here are SDXL's; this run trained model.family "
            f"{config.model.family!r}"
        )
    adapted = adapter_parts(config, PART_NAMES if parts is None else parts)
    if not adapted:
        raise ValueError("export: this run trained no adapters (parts.* = lora); nothing to export")
    if config.lora.kind not in kinds:
        raise ValueError(
            f"export: the {fmt} format holds {'/'.join(kinds)} only, not {config.lora.kind}"
        )
    states = read_weights(checkpoint, set(adapted))
    for name in adapted:
        if name not in states:
            raise ValueError(
                f"checkpoint {checkpoint}: no {name}.safetensors; it was not written by this run"
            )
    states = {name: states[name] for name in adapted}
    if ema:
        states = _ema_states(checkpoint, states)
    return Adapters(config, checkpoint, states)


def check_base_model(
    config: Config, checkpoint: Path, settings: tuple[str, ...] = ("model.path", "model.vae")
) -> None:
    """A one-line ``ValueError`` when a path the run's config names for the model it started
    from (``settings``: ``model.path``, ``model.vae``) does not exist: the export rebuilds the
    model from it (issue #29). The way out is to put it back: the checkpoint's config.yaml is
    hashed in its state.json, so pointing the setting elsewhere there is not one."""
    for setting in settings:
        value = getattr(config.model, setting.removeprefix("model."))
        if value is None or Path(value).exists():
            continue
        kind = "file" if Path(value).suffix.lower() in SINGLE_FILE_SUFFIXES else "folder"
        raise ValueError(
            f"{setting} {value}: does not exist; the export rebuilds the model of {checkpoint} "
            f"from it: put the {kind} back there (a symlink will do)"
        )


def unet_config_of(config: Config) -> dict[str, Any]:
    """The config of the UNet ``config`` trains, from config files and file headers only (kohya
    names follow the UNet's block layout; no weight is read)."""
    model = config.model
    if model.path is None:
        # On the meta device a preset costs nothing; one that loads shipped weights (the demo
        # VAE) copies them into meta tensors, a no-op torch warns about.
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore", UserWarning)
            return dict(build_preset(model.preset, model.init_seed).unet.config)
    path = Path(model.path)
    if is_run_checkpoint(path):
        return unet_config_of(read_checkpoint_config(resolve_checkpoint(path)))
    if path.suffix.lower() in SINGLE_FILE_SUFFIXES:
        return dict(read_configs(path).unet)
    config_file = path / "unet" / "config.json"
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        reason = "it does not exist" if isinstance(error, FileNotFoundError) else str(error)
        raise ValueError(
            f"model.path {path}: cannot read unet/config.json ({reason}); the export's kohya "
            "names need the base UNet's block layout, from a diffusers SDXL folder"
        ) from None


def _attention_projection(module: str) -> tuple[str, str] | None:
    """(attention module, projection) of a diffusers attention projection, e.g.
    ``…attn1.to_out.0`` → (``…attn1``, ``to_out``); None for other layers."""
    if module.endswith(".to_out.0"):
        return module.removesuffix(".to_out.0"), "to_out"
    parent, _, leaf = module.rpartition(".")
    return (parent, leaf) if leaf in _ATTENTION_PROJECTIONS else None


def diffusers_layout_key(part: str, peft_key: str) -> str:
    """The ``lora-diffusers`` name of a peft key of ``part`` (see the module docstring)."""
    module, _, leaf = peft_key.partition(".lora_")
    leaf = "lora_" + leaf
    if leaf not in _FACTORS and leaf != DORA_MAGNITUDE:
        raise ValueError(f"export: {peft_key} is not a LoRA or DoRA weight")
    if part != "unet":
        # transformers' load_adapter names the DoRA magnitude ``lora_magnitude_vector.weight``
        suffix = f"{leaf}.weight" if leaf == DORA_MAGNITUDE else leaf
        return f"{part}.{clip_text_model_key(module)}.{suffix}"
    attention = _attention_projection(module)
    if attention is None:
        name = f"unet.{module}"
        return f"{name}.lora.{_FACTORS[leaf]}.weight" if leaf in _FACTORS else f"{name}.{leaf}"
    name = f"unet.{attention[0]}.processor.{attention[1]}"
    return f"{name}_lora.{_FACTORS[leaf]}.weight" if leaf in _FACTORS else f"{name}.{leaf}"


def lora_metadata(adapters: Adapters, title: str, output_name: str) -> dict[str, str]:
    """The header of a LoRA file: SAI model-spec, ``impasto.*`` (how the model samples),
    kohya's ``ss_*`` and the adapter kind."""
    return _metadata(adapters, title, output_name)


def _metadata(adapters: Adapters, title: str, output_name: str) -> dict[str, str]:
    config = adapters.config
    record = read_training_record(adapters.checkpoint)
    return {
        **modelspec_metadata(config, title, lora=True),
        **model_metadata(config),
        **kohya_metadata(config, record, output_name, list(adapters.states)),
        "impasto.lora_kind": config.lora.kind,
    }


def write_lora_diffusers(
    adapters: Adapters, out: str | Path, dtype: torch.dtype, title: str
) -> Path:
    """Write ``OUT/pytorch_lora_weights.safetensors`` in the layout above, in ``dtype``."""
    scale = adapters.alpha / adapters.config.lora.rank
    tensors = {}
    for part, state in adapters.states.items():
        for key, tensor in state.items():
            if key.endswith(".lora_B.weight"):
                tensor = tensor.float() * scale  # alpha/rank into the up weights (see above)
            tensors[diffusers_layout_key(part, key)] = tensor
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **_metadata(adapters, title, out.name)}
    metadata["impasto.lora_alpha_in_weights"] = "true"  # the up weights hold alpha/rank
    write_safetensors(out / LORA_WEIGHTS_NAME, tensors, dtype=dtype, metadata=metadata)
    return out / LORA_WEIGHTS_NAME


def write_lora_kohya(adapters: Adapters, out: str | Path, dtype: torch.dtype, title: str) -> Path:
    """Write one ``.safetensors`` in kohya's layout (:mod:`impasto.models.lora_kohya`)."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"export: {out}: a kohya LoRA is one file; give a .safetensors name")
    unet_config = None
    if "unet" in adapters.states:
        check_base_model(adapters.config, adapters.checkpoint, ("model.path",))
        unet_config = unet_config_of(adapters.config)
    tensors = {}
    for part, state in adapters.states.items():
        tensors |= to_kohya(part, state, adapters.alpha, unet_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = _metadata(adapters, title, out.stem)
    write_safetensors(out, tensors, dtype=dtype, metadata=metadata)
    return out
