"""SDXL's exporters, registered under ``model.family`` ``sdxl`` (the formats are described in
:mod:`impasto.export` and docs/formats.md): the full-model formats ``diffusers`` and
``single-file`` with what they need (the run's model rebuilt as a plain SDXL in the export
dtype, one network at a time where :mod:`impasto.export.lowmem` allows; the scheduler that
samples it; ComfyUI's marker keys), and the LoRA formats ``lora-diffusers`` and ``lora-kohya``
over :mod:`impasto.export.lora`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors import SafetensorError
from safetensors.torch import load_file

from impasto.checkpoint.trained import (
    load_trained,
    model_metadata,
    read_checkpoint_config,
    resolve_checkpoint,
)
from impasto.config import Config
from impasto.export.base import DTYPES, ExportOptions, register_exporter
from impasto.export.lora import (
    adapter_parts,
    check_base_model,
    read_adapters,
    write_lora_diffusers,
    write_lora_kohya,
)
from impasto.export.lowmem import load_by_network, loads_by_network
from impasto.export.metadata import modelspec_metadata
from impasto.models import SDXLComponents
from impasto.models.io import save_diffusers, sdxl_scheduler
from impasto.models.lora_kohya import merge_kohya
from impasto.models.parts import merge_adapters
from impasto.models.sdxl import PART_NAMES as PARTS
from impasto.models.single_file import save_single_file
from impasto.models.single_file.file_errors import check_safetensors


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


def _sdxl_config(config: Config) -> Config:
    if config.model.family != "sdxl":
        raise ValueError(
            f"export: the formats here are SDXL's; this run trained model.family "
            f"{config.model.family!r}"
        )
    return config


MERGE_LORA_OPTION = "--merge-lora"


def _merge_lora(models: SDXLComponents, options: ExportOptions) -> None:
    check_safetensors(options.merge_lora, MERGE_LORA_OPTION)  # read again: it may have changed
    try:
        tensors = load_file(options.merge_lora)
    except (OSError, SafetensorError) as error:  # what safetensors refuses beyond the header
        raise ValueError(f"{MERGE_LORA_OPTION} {options.merge_lora}: {error}") from None
    merge_kohya(models, tensors, options.lora_scale)


def full_model(
    checkpoint: str | Path, options: ExportOptions, fmt: str
) -> tuple[Config, SDXLComponents]:
    """The run's config and its model as a plain SDXL in the export dtype: the run's adapters
    merged (a LoRA run needs ``options.merge``), then ``merge_lora`` added.

    One network at a time where the base model allows (:mod:`impasto.export.lowmem`), else the whole
    model in fp32, cast in place network by network, parameter by parameter.
    """
    path = resolve_checkpoint(checkpoint)
    config = _sdxl_config(read_checkpoint_config(path))
    if options.merge_lora:  # before the model is built: a wrong path is found in a second
        check_safetensors(options.merge_lora, MERGE_LORA_OPTION)
    check_base_model(config, path)
    adapters = adapter_parts(config)
    if adapters and not options.merge:
        raise ValueError(
            f"export: this run trained {config.lora.kind} adapters ({', '.join(adapters)}); "
            "export them with --format lora-kohya or lora-diffusers, or add --merge to bake "
            f"them into a {fmt}"
        )
    dtype = DTYPES[options.dtype]
    if loads_by_network(path, config, options.ema, bool(options.merge_lora)):
        return config, load_by_network(path, config, dtype)
    config, backbone = load_trained(path, ema=options.ema)
    models = backbone.components
    for name in adapters:
        merge_adapters(getattr(models, name))
    if options.merge_lora:
        _merge_lora(models, options)
    for name in (*PARTS, "vae"):
        getattr(models, name).to(dtype)
    return config, models


@register_exporter("sdxl", "diffusers")
def export_diffusers(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    config, models = full_model(checkpoint, options, "diffusers folder")
    save_diffusers(models, out, scheduler=scheduler_for(config))
    return Path(out)


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


@register_exporter("sdxl", "single-file")
def export_single_file(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    config, models = full_model(checkpoint, options, "single file")
    metadata = modelspec_metadata(config, _title(checkpoint), lora=False) | model_metadata(config)
    save_single_file(
        models,
        out,
        dtype=DTYPES[options.dtype],
        extra_keys=sampling_marker_keys(config),
        metadata=metadata,
    )
    return Path(out)


# The LoRA formats ignore the merge options.
@register_exporter("sdxl", "lora-diffusers")
def export_lora_diffusers(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    adapters = read_adapters(checkpoint, ("lora", "dora"), "diffusers LoRA", options.ema)
    return write_lora_diffusers(adapters, out, DTYPES[options.dtype], _title(checkpoint))


@register_exporter("sdxl", "lora-kohya")
def export_lora_kohya(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    adapters = read_adapters(checkpoint, ("lora",), "kohya LoRA", options.ema)
    return write_lora_kohya(adapters, out, DTYPES[options.dtype], _title(checkpoint))
