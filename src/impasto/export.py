"""``impasto export``: a trained checkpoint in the formats other tools load (docs/formats.md).

- ``diffusers``: a ``StableDiffusionXLPipeline`` folder whose scheduler says how to sample the
  model (v-prediction, zero terminal SNR and trailing spacing, or flow matching with its shift).
- ``single-file``: one ``.safetensors`` in the original SGM layout (A1111, ComfyUI, Forge),
  with ComfyUI's ``v_pred`` / ``ztsnr`` marker keys and SAI model-spec metadata.
- ``lora-diffusers``: the adapters of a LoRA/DoRA run as ``pytorch_lora_weights.safetensors``,
  what ``pipe.load_lora_weights`` reads.
- ``lora-kohya``: the adapters of a LoRA run in kohya's layout (``lora_unet_…``, SGM names),
  one ``.safetensors`` that ComfyUI, A1111 and Forge load.

A LoRA run exports to the full-model formats only with ``merge=True`` (the adapters baked into
the base weights).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusionXLPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from impasto.checkpoint.trained import load_trained, model_metadata
from impasto.config import Config
from impasto.models import SDXLComponents
from impasto.models.io import save_diffusers, sdxl_scheduler
from impasto.models.lora_kohya import merge_kohya, to_kohya
from impasto.models.parts import ADAPTER_NAME, merge_adapters
from impasto.models.sdxl import PART_NAMES as PARTS
from impasto.models.single_file import save_single_file
from impasto.permissions import apply_umask

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "fp16"  # a key of DTYPES
    merge: bool = False  # bake a LoRA run's adapters into the full model
    merge_lora: str | None = None  # a kohya LoRA file to add to the full model
    lora_scale: float = 1.0  # its strength
    ema: bool = False  # export the EMA weights (ema.safetensors) instead of the live ones


LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


def scheduler_for(config: Config):
    """The diffusers scheduler that samples a model trained with ``config.objective``."""
    objective = config.objective
    if objective.is_flow:
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=objective.num_train_timesteps, shift=objective.flow_shift
        )
    scheduler = sdxl_scheduler()
    changes = {
        "num_train_timesteps": objective.num_train_timesteps,
        "beta_start": objective.beta_start,
        "beta_end": objective.beta_end,
        "beta_schedule": {"cosine": "squaredcos_cap_v2"}.get(
            objective.schedule, objective.schedule
        ),
        "prediction_type": objective.prediction_type,
    }
    if objective.zero_terminal_snr:
        changes |= {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
    return type(scheduler).from_config(scheduler.config, **changes)


def adapter_parts(config: Config) -> list[str]:
    return [name for name in PARTS if getattr(config.parts, name) == "lora"]


def sdxl_trained(checkpoint: str | Path, ema: bool = False) -> tuple[Config, SDXLComponents]:
    """The run's config and SDXL components: every export format here is SDXL's (another
    family brings its own exporter)."""
    config, backbone = load_trained(checkpoint, ema=ema)
    if backbone.family != "sdxl":
        raise ValueError(
            f"export: the formats here are SDXL's; this run trained model.family "
            f"{backbone.family!r}"
        )
    return config, backbone.components


def _full_model(config: Config, models: SDXLComponents, options: ExportOptions, fmt: str) -> None:
    """Make ``models`` a plain SDXL model: merge the run's adapters, then ``merge_lora``."""
    adapters = adapter_parts(config)
    if adapters and not options.merge:
        raise ValueError(
            f"export: this run trained {config.lora.kind} adapters ({', '.join(adapters)}); "
            "export them with --format lora-kohya or lora-diffusers, or add --merge to bake "
            f"them into a {fmt}"
        )
    for name in adapters:
        merge_adapters(getattr(models, name))
    if options.merge_lora:
        try:
            tensors = load_file(options.merge_lora)
        except (OSError, SafetensorError) as error:
            raise ValueError(f"export: cannot read {options.merge_lora} ({error})") from None
        merge_kohya(models, tensors, options.lora_scale)


def export_diffusers(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    config, models = sdxl_trained(checkpoint, ema=options.ema)
    _full_model(config, models, options, "diffusers folder")
    for name in (*PARTS, "vae"):
        getattr(models, name).to(DTYPES[options.dtype])
    save_diffusers(models, out, scheduler=scheduler_for(config))
    return Path(out)


def _adapter_states(
    checkpoint: str | Path, kinds: tuple[str, ...], fmt: str, ema: bool = False
) -> tuple[Config, SDXLComponents, dict[str, dict]]:
    """The run's config, models and peft adapter weights per adapted part (EMA ones with
    ``ema``)."""
    config, models = sdxl_trained(checkpoint, ema=ema)
    adapters = adapter_parts(config)
    if not adapters:
        raise ValueError("export: this run trained no adapters (parts.* = lora); nothing to export")
    if config.lora.kind not in kinds:
        raise ValueError(
            f"export: the {fmt} format holds {'/'.join(kinds)} only, not {config.lora.kind}"
        )
    states = {
        name: peft.get_peft_model_state_dict(getattr(models, name), adapter_name=ADAPTER_NAME)
        for name in adapters
    }
    return config, models, states


def export_lora_diffusers(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    config, models, states = _adapter_states(
        checkpoint, ("lora", "dora"), "diffusers LoRA", options.ema
    )
    layers = {}
    for name, state in states.items():
        state = convert_state_dict_to_diffusers(state)
        layers[f"{name}_lora_layers"] = {k: v.to(DTYPES[options.dtype]) for k, v in state.items()}
    StableDiffusionXLPipeline.save_lora_weights(out, weight_name=LORA_WEIGHTS_NAME, **layers)
    return Path(out) / LORA_WEIGHTS_NAME


def modelspec_metadata(config: Config, title: str, lora: bool) -> dict[str, str]:
    """SAI model-spec 1.0 header fields (github.com/Stability-AI/ModelSpec), as kohya writes."""
    objective = config.objective
    prediction = {"epsilon": "epsilon", "v_prediction": "v"}.get(
        objective.prediction_type, objective.prediction_type
    )
    size = config.data.resolution
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "stable-diffusion-xl-v1-base" + ("/lora" if lora else ""),
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.title": title,
        "modelspec.resolution": f"{size}x{size}",
        "modelspec.prediction_type": prediction,
        "modelspec.date": datetime.date.today().isoformat(),
    }


def sampling_marker_keys(config: Config) -> dict[str, torch.Tensor]:
    """The keys ComfyUI reads from an SDXL checkpoint to sample it right: ``v_pred`` switches to
    v-prediction and ``ztsnr`` to zero terminal SNR (comfy/supported_models.py, SDXL)."""
    objective = config.objective
    keys = {}
    if objective.prediction_type == "v_prediction":
        keys["v_pred"] = torch.tensor([])
    if objective.zero_terminal_snr:
        keys["ztsnr"] = torch.tensor([])
    return keys


def _title(checkpoint: str | Path) -> str:
    return Path(checkpoint).resolve().name


def export_single_file(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    config, models = sdxl_trained(checkpoint, ema=options.ema)
    _full_model(config, models, options, "single file")
    metadata = modelspec_metadata(config, _title(checkpoint), lora=False) | model_metadata(config)
    save_single_file(
        models,
        out,
        dtype=DTYPES[options.dtype],
        extra_keys=sampling_marker_keys(config),
        metadata=metadata,
    )
    return Path(out)


def export_lora_kohya(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    config, models, states = _adapter_states(checkpoint, ("lora",), "kohya LoRA", options.ema)
    alpha = config.lora.rank if config.lora.alpha is None else config.lora.alpha
    tensors = {}
    for name, state in states.items():
        tensors |= to_kohya(name, getattr(models, name), state, alpha)
    tensors = {key: value.to(DTYPES[options.dtype]).contiguous() for key, value in tensors.items()}
    metadata = modelspec_metadata(config, _title(checkpoint), lora=True) | model_metadata(config)
    metadata |= {"ss_network_dim": str(config.lora.rank), "ss_network_alpha": repr(alpha)}
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"export: {out}: a kohya LoRA is one file; give a .safetensors name")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out, metadata=metadata)
    return out


# name → exporter(checkpoint, out, options); the LoRA formats ignore the merge options.
EXPORTERS = {
    "diffusers": export_diffusers,
    "single-file": export_single_file,
    "lora-diffusers": export_lora_diffusers,
    "lora-kohya": export_lora_kohya,
}
FORMATS = tuple(EXPORTERS)


def export_checkpoint(
    checkpoint: str | Path, fmt: str, out: str | Path, options: ExportOptions | None = None
) -> Path:
    """Write the model of ``checkpoint`` (a checkpoint or run directory) as ``fmt`` to ``out``."""
    options = options or ExportOptions()
    if fmt not in EXPORTERS:
        raise ValueError(f"export: unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if options.dtype not in DTYPES:
        raise ValueError(f"export: unknown dtype {options.dtype!r}; valid: {', '.join(DTYPES)}")
    if options.merge_lora and fmt.startswith("lora-"):
        raise ValueError(
            "export: --merge-lora adds a LoRA to a full model (diffusers, single-file)"
        )
    return apply_umask(EXPORTERS[fmt](checkpoint, out, options))
