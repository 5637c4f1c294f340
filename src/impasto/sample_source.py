"""The models ``impasto sample`` opens, and what says how to sample each.

An impasto run or checkpoint carries its config: its objective and its ``sample`` section (the
defaults of ``impasto sample``). An exported SDXL model says less, so its objective is read
from the file: a diffusers folder's ``scheduler/scheduler_config.json``; a single file's
``impasto.*`` header (:func:`impasto.checkpoint.trained.model_metadata`, the whole objective),
else ComfyUI's ``v_pred`` / ``ztsnr`` marker keys, else SAI's ``modelspec.prediction_type``.
Its sampling defaults are :class:`~impasto.config.schema.SampleConfig`'s own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from impasto.checkpoint.trained import is_run_checkpoint, load_trained
from impasto.config import Config
from impasto.config.schema import ModelConfig, ObjectiveConfig, SampleConfig
from impasto.models import SINGLE_FILE_SUFFIXES
from impasto.models.backbone import Backbone, build_backbone, pipeline_family
from impasto.models.exported import RECORD_FILE, is_model_folder, read_record
from impasto.models.markers import V_PRED_KEY, ZTSNR_KEY, marker_keys
from impasto.objectives import SCHEDULES

IMPASTO = "impasto."  # the prefix of model_metadata's header keys


@dataclass(frozen=True)
class SamplingModel:
    """A model opened for sampling, with what says how to sample it."""

    source: Path  # what was opened
    backbone: Backbone  # frozen, in eval mode
    objective: ObjectiveConfig  # how it was trained: prediction type, schedule, flow shift
    sample: SampleConfig  # the defaults: a run's section, else the section's own (and spacing)
    height: int  # the default image size in pixels
    width: int
    config: Config | None = None  # a run's config; None for an exported model


def open_model(path: str | Path, ema: bool = False) -> SamplingModel:
    """The model at ``path``: a run directory (its newest checkpoint), a checkpoint directory,
    a folder a family exported itself (``impasto-model.json``), a diffusers SDXL folder
    (``model_index.json``) or a single-file ``.safetensors``.
    ``ema``: a checkpoint's EMA weights (exported models have none)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: does not exist; check the path given to impasto sample")
    if is_run_checkpoint(path):
        return open_run(path, ema)
    if is_model_folder(path):
        _refuse_ema(path, ema)
        return open_model_folder(path)
    exported = (path / "model_index.json").is_file() or (
        path.suffix.lower() in SINGLE_FILE_SUFFIXES and path.is_file()
    )
    if not exported:
        raise ValueError(
            f"{path}: neither a checkpoint (no state.json), a run directory with checkpoints/, "
            "an exported model folder (impasto-model.json), a diffusers SDXL folder "
            "(model_index.json) nor a single-file .safetensors"
        )
    _refuse_ema(path, ema)
    return open_exported(path)


def _refuse_ema(path: Path, ema: bool) -> None:
    if ema:
        raise ValueError(
            f"--ema: {path} is an exported model, which holds one set of weights; export the "
            "run with --ema, or sample the run's checkpoint with --ema"
        )


def open_model_folder(path: Path) -> SamplingModel:
    """A folder a family exported itself (:mod:`impasto.models.exported`): its record names
    the family, the objective it was trained with and its size."""
    record = read_record(path)
    try:
        objective = ObjectiveConfig.model_validate(record.get("objective") or {})
        size = int(record.get("resolution") or 1024)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: {RECORD_FILE} holds no valid objective ({error})") from None
    model = ModelConfig(family=record["family"], path=str(path))
    backbone = build_backbone(_ModelSource(model, objective))
    for module in backbone.modules().values():
        module.requires_grad_(False).eval()
    return SamplingModel(path, backbone, objective, SampleConfig(), size, size)


def open_run(path: Path, ema: bool) -> SamplingModel:
    """A run's (or checkpoint's) trained model; its ``sample`` section gives the defaults."""
    config, backbone = load_trained(path, ema=ema)
    size = config.sample.resolution or config.data.resolution
    return SamplingModel(path, backbone, config.objective, config.sample, size, size, config)


@dataclass(frozen=True)
class _ModelSource:
    """What ``build_backbone`` reads of a config: the model section and the objective."""

    model: ModelConfig
    objective: ObjectiveConfig


def open_exported(path: Path) -> SamplingModel:
    """An exported SDXL model, sampled as the file says it was trained
    (:func:`exported_objective`); default size: the file's ``modelspec.resolution``, else
    the UNet's ``sample_size`` in pixels (diffusers' pipeline default: 1024 for SDXL). A
    diffusers folder of another family's pipeline (``FamilySpec.pipelines``) opens as that
    family, which samples on its own ladder."""
    family = pipeline_family(path) if path.is_dir() else None
    if family is not None:
        model = ModelConfig(family=family[0], path=str(path))
        objective = ObjectiveConfig.model_validate(dict(family[1]))
        backbone = build_backbone(_ModelSource(model, objective))
        for module in backbone.modules().values():
            module.requires_grad_(False).eval()
        height, width = _native_size(backbone)
        return SamplingModel(path, backbone, objective, SampleConfig(), height, width)
    objective, spacing, size = exported_objective(path)
    backbone = build_backbone(_ModelSource(ModelConfig(path=str(path)), objective))
    for module in backbone.modules().values():
        module.requires_grad_(False).eval()
    height, width = size or _native_size(backbone)
    return SamplingModel(path, backbone, objective, SampleConfig(spacing=spacing), height, width)


def _native_size(backbone: Backbone) -> tuple[int, int]:
    unet_config = getattr(backbone.denoiser(), "config", None)
    side = getattr(unet_config, "sample_size", None)
    if not isinstance(side, int):
        return 1024, 1024
    side *= backbone.latent_format()[1]
    return side, side


def exported_objective(path: Path) -> tuple[ObjectiveConfig, str | None, tuple[int, int] | None]:
    """How an exported model samples: (its objective, the timestep spacing it names or None,
    its image size (height, width) or None).

    A diffusers folder: its ``scheduler/scheduler_config.json`` (:func:`scheduler_objective`).
    A single file: impasto's ``impasto.*`` header (the whole objective), else ComfyUI's
    ``v_pred`` / ``ztsnr`` marker keys, else ``modelspec.prediction_type``; else SDXL's ε.
    """
    if path.is_dir():
        objective, spacing = scheduler_objective(path / "scheduler" / "scheduler_config.json")
        return objective, spacing, None
    metadata = _safetensors_metadata(path)
    size = _modelspec_size(metadata.get("modelspec.resolution"))
    impasto = {k.removeprefix(IMPASTO): v for k, v in metadata.items() if k.startswith(IMPASTO)}
    fields = {key: value for key, value in impasto.items() if key in ObjectiveConfig.model_fields}
    if not fields:
        markers = marker_keys(path)
        modelspec = metadata.get("modelspec.prediction_type", "epsilon")
        prediction = "v_prediction" if V_PRED_KEY in markers or modelspec == "v" else modelspec
        if prediction not in ("epsilon", "v_prediction"):
            raise ValueError(
                f"{path}: modelspec.prediction_type {modelspec!r}; impasto samples SDXL single "
                "files with epsilon or v (v_pred) prediction"
            )
        fields = {"prediction_type": prediction, "zero_terminal_snr": ZTSNR_KEY in markers}
    return _objective(fields, path), None, size


# diffusers' beta_schedule names → impasto's objective.schedule (the inverse of export's map)
DIFFUSERS_SCHEDULES = {"scaled_linear": "scaled_linear", "linear": "linear",
                       "squaredcos_cap_v2": "cosine"}  # fmt: skip
SPACINGS = ("leading", "trailing", "linspace")


def scheduler_objective(config_file: Path) -> tuple[ObjectiveConfig, str | None]:
    """The objective and timestep spacing a diffusers scheduler config describes: ``prediction_
    type``, ``rescale_betas_zero_snr``, the betas and ``timestep_spacing``; a
    ``FlowMatchEulerDiscreteScheduler`` is a flow model with its ``shift``. No file: SDXL's."""
    if not config_file.is_file():
        return ObjectiveConfig(), None
    try:
        scheduler = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_file}: cannot read the scheduler config ({error})") from None
    if not isinstance(scheduler, dict):
        raise ValueError(f"{config_file}: the scheduler config is not a JSON object")
    steps = scheduler.get("num_train_timesteps", 1000)
    if scheduler.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
        if scheduler.get("use_dynamic_shifting"):
            raise ValueError(
                f"{config_file}: dynamic shifting (use_dynamic_shifting) is not supported; "
                "impasto samples a flow model with one shift"
            )
        fields = {"prediction_type": "flow", "flow_shift": scheduler.get("shift", 1.0)}
        return _objective({**fields, "num_train_timesteps": steps}, config_file), None
    beta_schedule = scheduler.get("beta_schedule", "scaled_linear")
    if beta_schedule not in DIFFUSERS_SCHEDULES:
        raise ValueError(
            f"{config_file}: beta_schedule {beta_schedule!r} is not one impasto samples; "
            f"valid: {', '.join(DIFFUSERS_SCHEDULES)}"
        )
    fields = {
        "prediction_type": scheduler.get("prediction_type", "epsilon"),
        "zero_terminal_snr": scheduler.get("rescale_betas_zero_snr", False),
        "num_train_timesteps": steps,
        "schedule": DIFFUSERS_SCHEDULES[beta_schedule],
        "beta_start": scheduler.get("beta_start", 0.00085),
        "beta_end": scheduler.get("beta_end", 0.012),
    }
    spacing = scheduler.get("timestep_spacing")
    return _objective(fields, config_file), spacing if spacing in SPACINGS else None


def _objective(fields: dict[str, Any], where: Path) -> ObjectiveConfig:
    """An objective section from what a file says, or a one-line error naming the file."""
    try:
        objective = ObjectiveConfig(**fields)
    except ValueError as error:  # pydantic's ValidationError
        raise ValueError(
            f"{where}: cannot sample it as described ({_first_error(error)})"
        ) from None
    if objective.schedule not in SCHEDULES or objective.prediction_type not in PREDICTIONS:
        raise ValueError(
            f"{where}: prediction type {objective.prediction_type!r} with schedule "
            f"{objective.schedule!r} is not one impasto samples"
        )
    return objective


PREDICTIONS = ("epsilon", "v_prediction", "sample", "flow")


def _first_error(error: ValueError) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}"
    return str(error).splitlines()[0]


def _safetensors_metadata(path: Path) -> dict[str, str]:
    """The header metadata of a ``.safetensors`` file ({} for another kind: its loader
    reports what it cannot read)."""
    if path.suffix.lower() != ".safetensors":
        return {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError):
        return {}


def _modelspec_size(resolution: str | None) -> tuple[int, int] | None:
    """(height, width) of a ``modelspec.resolution`` ``"WIDTHxHEIGHT"``, or None."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", resolution or "")
    if match is None:
        return None
    width, height = int(match.group(1)), int(match.group(2))
    return (height, width) if width > 0 and height > 0 else None
