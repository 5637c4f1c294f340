"""Train state, run directory and the mapping between a live run and its checkpoint files."""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from impasto import __version__
from impasto.checkpoint import CheckpointData, latest_checkpoint, load_checkpoint, save_checkpoint
from impasto.checkpoint.trained import model_metadata
from impasto.config import Config, config_diff, config_hash, config_to_dict, config_to_yaml
from impasto.logging import METRICS_FILE
from impasto.train.ema import EMA
from impasto.train.parts import Part, load_part_weights
from impasto.train.rng import capture_rng_state, restore_rng_state

CHECKPOINTS = "checkpoints"
EMA_FILE = "ema"  # ema.safetensors (the shadow weights) and ema.pt (options, update count)


@dataclass
class TrainState:
    """Counters that, with the weights, optimizer and RNG, define where a run is."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch of the next micro-batch
    batch_in_epoch: int = 0  # index of the next micro-batch within its epoch
    samples_seen: int = 0
    images_attempted: int = 0
    images_bad: int = 0
    nonfinite_in_row: int = 0
    steps_skipped: int = 0


def prepare_run_dir(config: Config, resume: bool) -> Path:
    """Create the run directory and write the resolved config and its hash into it.

    With ``resume=False`` an earlier run's checkpoints and metrics are moved into
    ``previous-<time>/`` rather than deleted: starting over never destroys results.
    """
    run_dir = Path(config.train.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    earlier = [run_dir / name for name in (CHECKPOINTS, METRICS_FILE, "tensorboard")]
    earlier = [path for path in earlier if path.exists()]
    if not resume and earlier:
        archive = run_dir / time.strftime("previous-%Y%m%d-%H%M%S")
        archive.mkdir()
        for path in earlier:
            shutil.move(str(path), str(archive / path.name))
    (run_dir / "config.yaml").write_text(_config_text(config), encoding="utf-8")
    return run_dir


def _config_text(config: Config) -> str:
    return f"# config_hash: {config_hash(config)}\n{config_to_yaml(config)}"


def save_train_checkpoint(
    run_dir: Path,
    config: Config,
    state: TrainState,
    modules: dict[str, Part],
    optimizer: torch.optim.Optimizer,
    ema: EMA | None = None,
) -> Path:
    """Write a complete checkpoint of the run (``ema.safetensors`` too when EMA is on)."""
    data = CheckpointData(
        tensors={name: module.state_dict() for name, module in modules.items()},
        objects={"optimizer": optimizer.state_dict(), "rng": capture_rng_state()},
        state={
            "train": dataclasses.asdict(state),
            "config_hash": config_hash(config),
            "impasto_version": __version__,
            "lr": [group["lr"] for group in optimizer.param_groups],
        },
        texts={"config.yaml": _config_text(config)},
        metadata={"unet": model_metadata(config)},
    )
    if ema is not None:
        ema_state = ema.state_dict()
        data.tensors[EMA_FILE] = ema_state.pop("shadows")
        data.objects[EMA_FILE] = ema_state
    return save_checkpoint(run_dir / CHECKPOINTS, state.step, data, config.checkpoint.keep_last)


def restore_train_checkpoint(
    run_dir: Path,
    config: Config,
    modules: dict[str, Part],
    optimizer: torch.optim.Optimizer,
    ema: EMA | None = None,
) -> tuple[TrainState, Path] | None:
    """Load the newest complete checkpoint of ``run_dir`` into the live objects, if any."""
    path = latest_checkpoint(run_dir / CHECKPOINTS)
    if path is None:
        return None
    data = load_checkpoint(path)
    load_part_weights(modules, data.tensors, f"checkpoint {path}")
    optimizer.load_state_dict(data.objects["optimizer"])
    if ema is not None:
        if EMA_FILE not in data.tensors:
            raise ValueError(
                f"checkpoint {path}: no EMA weights (ema.enabled was off); set it off to resume, "
                "or start over with --no-resume"
            )
        ema.load_state_dict({"shadows": data.tensors[EMA_FILE], **data.objects[EMA_FILE]})
    restore_rng_state(data.objects["rng"])
    saved = yaml.safe_load(data.texts.get("config.yaml", "")) or {}
    changes = config_diff(saved, config_to_dict(config))
    if changes:
        print(f"impasto: resuming with a changed config: {'; '.join(changes)}")
    return TrainState(**data.state["train"]), path
