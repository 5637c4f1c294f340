"""Train counters, the run directory, and the run's state as one dict of Stateful objects."""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from impasto.checkpoint.stateful import Stateful, StatefulValue, save_states
from impasto.checkpoint.trained import model_metadata
from impasto.config import Config, config_diff, config_hash, config_to_dict, config_to_yaml
from impasto.logging import METRICS_FILE
from impasto.models.parts import Part, load_part
from impasto.train.ema import EMA
from impasto.train.rng import capture_rng_state, restore_rng_state
from impasto.version import __version__

CHECKPOINTS = "checkpoints"


@dataclass
class TrainState:
    """Counters that, with the weights, optimizer, data position and RNG, define where a run
    is (the data position is the data stream's own state)."""

    step: int = 0  # optimizer steps done
    samples_seen: int = 0
    images_attempted: int = 0
    images_bad: int = 0
    nonfinite_in_row: int = 0
    steps_skipped: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for field in dataclasses.fields(self):  # a counter the checkpoint lacks starts at 0
            setattr(self, field.name, int(state.get(field.name, field.default)))


def prepare_run_dir(config: Config, resume: bool, main: bool = True) -> Path:
    """Create the run directory and write the resolved config and its hash into it (``main``:
    this process does; the other ranks of a parallel run only name it).

    With ``resume=False`` an earlier run's checkpoints and metrics are moved into
    ``previous-<time>/`` rather than deleted: starting over never destroys results.
    """
    run_dir = Path(config.train.output_dir)
    if not main:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    earlier = [run_dir / name for name in (CHECKPOINTS, METRICS_FILE, "tensorboard")]
    earlier = [path for path in earlier if path.exists()]
    if not resume and earlier:
        archive = run_dir / time.strftime("previous-%Y%m%d-%H%M%S")
        archive.mkdir()
        for path in earlier:
            shutil.move(str(path), str(archive / path.name))
    (run_dir / "config.yaml").write_text(config_text(config), encoding="utf-8")
    return run_dir


def config_text(config: Config) -> str:
    return f"# config_hash: {config_hash(config)}\n{config_to_yaml(config)}"


class RNGStreams:
    """Python's, NumPy's and torch's global generators (CPU and CUDA) as one Stateful; they
    are seeded with ``train.seed`` when a run starts."""

    def __init__(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)


def ema_states(ema: EMA) -> dict[str, StatefulValue]:
    """The EMA as two entries: its fp32 shadows (``ema.safetensors``, which ``impasto export
    --ema`` reads) and its update count."""

    def load_shadows(shadows: dict[str, torch.Tensor]) -> None:
        ema.load_state_dict({"shadows": shadows, "num_updates": ema.num_updates})

    def load_rest(state: dict[str, Any]) -> None:
        ema.num_updates = int(state["num_updates"])

    def rest() -> dict[str, Any]:
        state = ema.state_dict()
        return {"options": state["options"], "num_updates": state["num_updates"]}

    return {
        "ema": StatefulValue(lambda: ema.state_dict()["shadows"], load_shadows),
        "ema_state": StatefulValue(rest, load_rest),
    }


def run_info(config: Config, optimizer: torch.optim.Optimizer) -> StatefulValue:
    """What the checkpoint records about the run (config hash, version, LRs); a record only:
    restoring it changes nothing (``report_config_changes`` compares the configs)."""

    def record() -> dict[str, Any]:
        lrs = [group["lr"] for group in optimizer.param_groups]
        return {"config_hash": config_hash(config), "impasto_version": __version__, "lr": lrs}

    return StatefulValue(record, lambda saved: None)


def optimizer_by_name(optimizer: torch.optim.Optimizer, parts: dict[str, Part]) -> StatefulValue:
    """The optimizer's state keyed by parameter name (``part.parameter``) rather than by
    position, through ``torch.distributed.checkpoint.state_dict``: what a sharded checkpoint
    holds, so that it loads into any strategy and number of ranks (sharded moments are
    DTensors; the state is created first when the optimizer has not stepped yet)."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    root = torch.nn.ModuleDict({name: part.module for name, part in parts.items()})
    return StatefulValue(
        lambda: get_optimizer_state_dict(root, optimizer),
        lambda state: set_optimizer_state_dict(root, optimizer, state),
    )


def part_state(part: Part) -> StatefulValue:
    """A trained part's weights (the whole module, or its adapter); a one-line error when the
    checkpoint's do not fit."""
    return StatefulValue(part.state_dict, lambda state: load_part(part, state))


def report_config_changes(path: Path, config: Config) -> None:
    """Print how ``config`` differs from the one a checkpoint was written with."""
    saved_file = path / "config.yaml"
    saved_text = saved_file.read_text(encoding="utf-8") if saved_file.is_file() else ""
    saved = yaml.safe_load(saved_text) or {}
    changes = config_diff(saved, config_to_dict(config))
    if changes:
        print(f"impasto: resuming with a changed config: {'; '.join(changes)}")


def save_run(
    run_dir: Path, config: Config, step: int, states: dict[str, Stateful], header: dict[str, str]
) -> Path:
    """Checkpoint ``states`` as step ``step``. Every weights file's header says what model it
    belongs to: ``header`` (the backbone's) and how the run trained it (the objective)."""
    metadata = header | model_metadata(config)
    return save_states(
        run_dir / CHECKPOINTS,
        step,
        states,
        config.checkpoint.keep_last,
        texts={"config.yaml": config_text(config)},
        metadata={name: metadata for name in states},
    )
