"""``impasto export``: a trained checkpoint in the formats other tools load (docs/formats.md).

- ``diffusers``: a ``StableDiffusionXLPipeline`` folder whose scheduler says how to sample the
  model (v-prediction, zero terminal SNR and trailing spacing, or flow matching with its shift).
- ``single-file``: one ``.safetensors`` in the original SGM layout (A1111, ComfyUI, Forge),
  with ComfyUI's ``v_pred`` / ``ztsnr`` marker keys and SAI model-spec metadata.
- ``lora-diffusers``: the adapters of a LoRA/DoRA run as ``pytorch_lora_weights.safetensors``,
  names that ``pipe.load_lora_weights`` and ComfyUI's LoRA loader both read (:mod:`export_lora`).
- ``lora-kohya``: the adapters of a LoRA run in kohya's layout (``lora_unet_…``, SGM names),
  one ``.safetensors`` that ComfyUI, A1111 and Forge load.

A LoRA run exports to the full-model formats only with ``merge=True`` (the adapters baked into
the base weights). LoRA files carry kohya's ``ss_*`` training metadata (:mod:`export_metadata`).

Memory (issue #17): the LoRA formats read the adapter tensors from the checkpoint and never build
the model. The full-model formats rebuild it one network at a time where the base model is a
file (:mod:`export_lowmem`), else whole in fp32; each network is cast to the export dtype in
place, parameter by parameter, and files are written one tensor at a time: no second copy of
the model is ever held. ``verbose`` reports the time and the process's peak memory.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
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
from impasto.export_lora import (
    adapter_parts,
    check_base_model,
    read_adapters,
    write_lora_diffusers,
    write_lora_kohya,
)
from impasto.export_lowmem import load_by_network, loads_by_network
from impasto.export_metadata import modelspec_metadata
from impasto.models import SDXLComponents
from impasto.models.io import save_diffusers, sdxl_scheduler
from impasto.models.lora_kohya import merge_kohya
from impasto.models.parts import merge_adapters
from impasto.models.sdxl import PART_NAMES as PARTS
from impasto.models.single_file import save_single_file
from impasto.models.single_file.file_errors import check_safetensors
from impasto.permissions import apply_umask

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "fp16"  # a key of DTYPES
    merge: bool = False  # bake a LoRA run's adapters into the full model
    merge_lora: str | None = None  # a kohya LoRA file to add to the full model
    lora_scale: float = 1.0  # its strength
    ema: bool = False  # export the EMA weights (ema.safetensors) instead of the live ones
    verbose: bool = False  # print the export's time and peak memory


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

    One network at a time where the base model allows (:mod:`export_lowmem`), else the whole
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


def export_lora_diffusers(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    adapters = read_adapters(checkpoint, ("lora", "dora"), "diffusers LoRA", options.ema)
    return write_lora_diffusers(adapters, out, DTYPES[options.dtype], _title(checkpoint))


def export_lora_kohya(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
    adapters = read_adapters(checkpoint, ("lora",), "kohya LoRA", options.ema)
    return write_lora_kohya(adapters, out, DTYPES[options.dtype], _title(checkpoint))


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
    started = time.perf_counter()
    path = apply_umask(EXPORTERS[fmt](checkpoint, out, options))
    if options.verbose:
        print(export_report(time.perf_counter() - started), file=sys.stderr)
    return path


def peak_memory_gb() -> float:
    """The process's peak resident memory so far (``ru_maxrss``, KiB on Linux), in GiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 30 if sys.platform == "darwin" else 1 << 20)  # macOS counts bytes


def export_report(seconds: float) -> str:
    """One line: how long an export took and the process's peak memory (which includes
    whatever the process did before the export; the CLI runs the export alone)."""
    return f"export: {seconds:.1f} s, peak memory {peak_memory_gb():.2f} GiB (max RSS)"
