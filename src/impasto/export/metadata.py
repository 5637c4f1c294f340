"""Header metadata of exported files: SAI model spec and kohya's ``ss_*`` training record.

A LoRA file's safetensors header is what ComfyUI's and A1111's LoRA browsers, Civitai and the
LoRA managers show about it: kohya sd-scripts' ``ss_*`` keys (written by ``train_network.py``;
every value a string, as kohya's ``{k: str(v)}``) and the model spec's ``modelspec.*`` keys.
The training record comes from the checkpoint: its ``state.json`` (step, data position) and,
when the trainer wrote one, its ``dataset.json`` (image count with repeats, steps per epoch,
completed epochs, tag frequencies per source).
"""

from __future__ import annotations

import datetime
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from impasto.checkpoint.state import STATE_FILE
from impasto.config import Config
from impasto.version import __version__

DATASET_FILE = "dataset.json"
SDXL_BASE_VERSION = "sdxl_base_v1-0"  # kohya's sdxl_model_util.MODEL_VERSION_SDXL_BASE_V1_0
KOHYA_LORA_MODULE = "networks.lora"  # kohya's --network_module for LoRA


@dataclass(frozen=True)
class TrainingRecord:
    """What a checkpoint says about the training that made it; None where it does not say."""

    step: int  # optimizer steps done
    epoch: int | None  # completed epochs
    num_images: int | None  # training images per epoch, counting repeats
    steps_per_epoch: int | None
    tag_frequency: dict[str, dict[str, int]] | None  # {source or subfolder: {tag: count}}
    started_at: float | None  # unix time the training session started


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is missing or unreadable (with a warning)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        warnings.warn(f"{path}: unreadable ({error}); its metadata is left out", stacklevel=3)
        return {}
    return data if isinstance(data, dict) else {}


def _count(value: Any) -> int | None:
    """``value`` if it is a non-negative int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _tag_frequency(value: Any) -> dict[str, dict[str, int]] | None:
    if not isinstance(value, dict):
        return None
    frequency = {}
    for source, tags in value.items():
        if not isinstance(tags, dict):
            return None
        counts = {str(tag): _count(count) for tag, count in tags.items()}
        if None in counts.values():
            return None
        frequency[str(source)] = counts
    return frequency


def _started_at(checkpoint: Path, state: dict[str, Any]) -> float | None:
    """When the session that wrote ``checkpoint`` started: ``state.json``'s ``run.started_at``
    if the trainer recorded it, else when the run wrote its ``config.yaml`` (at every start)
    provided that is not later than the checkpoint (a later start resumed after it)."""
    run = state.get("run") if isinstance(state.get("run"), dict) else {}
    started = run.get("started_at")
    if isinstance(started, int | float) and not isinstance(started, bool):
        return float(started)
    run_config = checkpoint.parent.parent / "config.yaml"
    if not run_config.is_file():
        return None
    started = run_config.stat().st_mtime
    return started if started <= (checkpoint / STATE_FILE).stat().st_mtime else None


def read_training_record(checkpoint: Path) -> TrainingRecord:
    """The training record of ``checkpoint`` (a checkpoint directory). ``dataset.json`` may be
    missing or hold keys unknown here; a field of the wrong type counts as missing."""
    state = _read_json(checkpoint / STATE_FILE)
    dataset = _read_json(checkpoint / DATASET_FILE)
    train = state.get("train", {}) if isinstance(state.get("train"), dict) else {}
    data = state.get("data", {}) if isinstance(state.get("data"), dict) else {}
    epoch = _count(dataset.get("epoch"))
    steps_per_epoch = _count(dataset.get("steps_per_epoch")) or None  # 0 says nothing
    return TrainingRecord(
        step=_count(train.get("step")) or 0,
        epoch=epoch if epoch is not None else _count(data.get("epoch")),
        num_images=_count(dataset.get("images")),
        steps_per_epoch=steps_per_epoch,
        tag_frequency=_tag_frequency(dataset.get("tag_frequency")),
        started_at=_started_at(checkpoint, state),
    )


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


def _part_lr(config: Config, part: str) -> float:
    return config.parts.lr(part) or config.optim.lr


def _learning_rates(config: Config, adapted: list[str]) -> dict[str, str]:
    """``ss_unet_lr`` / ``ss_text_encoder_lr`` of the parts that trained (kohya writes a list
    when SDXL's two encoders differ)."""
    rates = {}
    denoisers = [part for part in adapted if not part.startswith("text_encoder")]
    if denoisers:  # kohya's "unet" is the denoiser, a UNet or a transformer
        rates["ss_unet_lr"] = repr(_part_lr(config, denoisers[0]))
    encoders = [_part_lr(config, part) for part in adapted if part.startswith("text_encoder")]
    if encoders:
        same = len(set(encoders)) == 1
        rates["ss_text_encoder_lr"] = repr(encoders[0]) if same else repr(encoders)
    return rates


def _session(config: Config, record: TrainingRecord) -> dict[str, str]:
    """The ss_ keys of how long training ran and on what data, where the record says."""
    train = config.train
    metadata = {"ss_steps": str(record.step)}
    max_steps = train.max_steps
    if max_steps is None and train.max_epochs is not None and record.steps_per_epoch:
        max_steps = train.max_epochs * record.steps_per_epoch
    if max_steps is not None:
        metadata["ss_max_train_steps"] = str(max_steps)
    num_epochs = train.max_epochs
    if num_epochs is None and train.max_steps is not None and record.steps_per_epoch:
        num_epochs = math.ceil(train.max_steps / record.steps_per_epoch)
    if num_epochs is not None:
        metadata["ss_num_epochs"] = str(num_epochs)
    if record.epoch is not None:
        metadata["ss_epoch"] = str(record.epoch)
    if record.num_images is not None:
        metadata["ss_num_train_images"] = str(record.num_images)
    if record.tag_frequency is not None:
        metadata["ss_tag_frequency"] = json.dumps(record.tag_frequency)
    if record.started_at is not None:
        metadata["ss_training_started_at"] = repr(record.started_at)
    return metadata


def kohya_metadata(
    config: Config, record: TrainingRecord, output_name: str, adapted: list[str]
) -> dict[str, str]:
    """kohya's ``ss_*`` header of a LoRA exported from a run of ``config`` (``adapted``: the
    parts with adapters), in sd-scripts' names and value formats (``train_network.py``)."""
    lora, optim, objective = config.lora, config.optim, config.objective
    alpha = lora.rank if lora.alpha is None else lora.alpha
    model = config.model
    size = config.data.resolution
    comment = f"trained with impasto {__version__} ({objective.prediction_type}" + (
        ", zero terminal SNR)" if objective.zero_terminal_snr else ")"
    )
    return {
        "ss_base_model_version": SDXL_BASE_VERSION,
        "ss_v2": "False",
        "ss_sd_model_name": Path(model.path).name if model.path else str(model.preset),
        "ss_network_module": KOHYA_LORA_MODULE,
        "ss_network_dim": str(lora.rank),
        "ss_network_alpha": repr(float(alpha)),
        "ss_network_dropout": repr(float(lora.dropout)),
        "ss_output_name": output_name,
        "ss_training_comment": comment,
        "ss_resolution": f"({size}, {size})",  # kohya's str((width, height))
        "ss_learning_rate": repr(optim.lr),
        **_learning_rates(config, adapted),
        "ss_optimizer": optim.name,
        "ss_lr_scheduler": optim.lr_schedule,
        "ss_lr_warmup_steps": str(optim.warmup_steps),
        "ss_max_grad_norm": repr(optim.max_grad_norm),
        "ss_seed": str(config.train.seed),
        "ss_batch_size_per_device": str(config.data.batch_size),
        "ss_gradient_accumulation_steps": str(config.train.grad_accum_steps),
        "ss_mixed_precision": config.train.mixed_precision,
        "ss_noise_offset": repr(objective.noise_offset),
        "ss_zero_terminal_snr": str(objective.zero_terminal_snr),
        **_session(config, record),
    }
