"""Train counters, the run directory, and the run's state as one dict of Stateful objects."""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from impasto.checkpoint.state import (
    DAMAGED_PREFIX,
    DamagedCheckpoint,
    list_checkpoints,
    remove_leftovers,
    set_aside,
)
from impasto.checkpoint.stateful import Stateful, StatefulValue, save_states
from impasto.checkpoint.trained import model_metadata
from impasto.config import Config, config_diff, config_hash, config_to_dict, config_to_yaml
from impasto.config.load import read_yaml
from impasto.data.skips import BAD_DATA_FILE
from impasto.logging import METRICS_FILE
from impasto.models.parts import Part, load_part
from impasto.train.ema import EMA
from impasto.train.rng import capture_rng_state, restore_rng_state
from impasto.train.step_metrics import TrainingClock
from impasto.version import __version__

CHECKPOINTS = "checkpoints"


@dataclass
class TrainState:
    """Counters that, with the weights, optimizer, data position and RNG, define where a run
    is (the data position is the data stream's own state)."""

    step: int = 0  # optimizer steps done
    samples_seen: int = 0
    images_attempted: int = 0
    images_bad: int = 0  # distinct unusable items: each name counts once, whenever met again
    nonfinite_in_row: int = 0
    steps_skipped: int = 0
    bad_names: set[str] = dataclasses.field(default_factory=set)  # the items images_bad counts

    def count_bad(self, names: Iterable[str]) -> int:
        """Count the names not counted before; returns how many were new."""
        new = set(names) - self.bad_names
        self.bad_names |= new
        self.images_bad += len(new)
        return len(new)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"bad_names": sorted(self.bad_names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):  # a counter the checkpoint lacks starts at 0
            if field.name != "bad_names":
                setattr(self, field.name, int(state.get(field.name, field.default)))
        self.bad_names = set(state.get("bad_names", ()))


def prepare_run_dir(config: Config, resume: bool, main: bool = True) -> Path:
    """Create the run directory and write the resolved config and its hash into it (``main``:
    this process does; the other ranks of a parallel run only name it).

    With ``resume=False`` an earlier run's outputs (checkpoints, metrics, grids, reports) move
    into ``previous-<time>/`` rather than deleted: starting over never destroys results. The
    caller holds the directory's lock (:mod:`impasto.train.run_lock`), so the ``.tmp-*``
    leftovers of saves and prunes that a kill interrupted are removed here.
    """
    run_dir = Path(config.train.output_dir)
    if not main:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    leftovers = remove_leftovers(run_dir / CHECKPOINTS)
    if leftovers:
        names = ", ".join(path.name for path in leftovers)
        print(f"impasto: removed what interrupted saves left behind: {names}")
    if not resume:
        archive_earlier_run(run_dir)
    (run_dir / "config.yaml").write_text(config_text(config), encoding="utf-8")
    return run_dir


# What a run writes into its directory, moved aside as a whole by --no-resume.
RUN_OUTPUTS = (CHECKPOINTS, METRICS_FILE, "tensorboard", "samples", BAD_DATA_FILE, "buckets.txt",
               "draftp-summary.json", "wandb", "wandb-run-id", "profile")  # fmt: skip


def archive_earlier_run(run_dir: Path) -> Path | None:
    """Move an earlier run's outputs (and its config) into a new ``previous-<time>/`` folder;
    says where. None when there was no earlier run."""
    earlier = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not earlier:
        return None
    stamp = time.strftime("previous-%Y%m%d-%H%M%S")
    archive, number = run_dir / stamp, 1
    while archive.exists():  # two starts over in one second
        number += 1
        archive = run_dir / f"{stamp}-{number}"
    archive.mkdir()
    if (run_dir / "config.yaml").exists():
        earlier.append(run_dir / "config.yaml")
    for path in earlier:
        shutil.move(str(path), str(archive / path.name))
    print(f"impasto: --no-resume: the earlier run ({', '.join(p.name for p in earlier)}) is "
          f"in {archive}")  # fmt: skip
    return archive


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


def run_info(
    config: Config, optimizer: torch.optim.Optimizer, clock: TrainingClock | None = None
) -> StatefulValue:
    """What the checkpoint records about the run (config hash, version, LRs) and, with
    ``clock``, its training time so far (``elapsed_s``), which a resumed run continues from:
    restoring changes nothing else (``check_resumable`` compares the configs).

    The training time lives here, not in :class:`TrainState`: wall time differs between a
    resumed and an uninterrupted run, and this record is the one part of a checkpoint that
    is not the run's bitwise state (the exact-resume tests compare the rest)."""

    def record() -> dict[str, Any]:
        lrs = [group["lr"] for group in optimizer.param_groups]
        info = {"config_hash": config_hash(config), "impasto_version": __version__, "lr": lrs}
        return info | ({"elapsed_s": clock.elapsed()} if clock is not None else {})

    def restore(saved: dict[str, Any]) -> None:
        if clock is not None:
            clock.resume(saved.get("elapsed_s", 0.0))

    return StatefulValue(record, restore)


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


def restore_newest(root: Path, group: Any, load: Callable[[Path], None]) -> Path | None:
    """``load`` the newest complete checkpoint under ``root`` and return its path (None when
    there is none). A damaged one (a file truncated or tampered with) is set aside as
    ``damaged-step-N`` and the one before it tried; when checkpoints exist but none loads,
    a one-line error rather than a silent start from scratch. ``group``: the run's ranks
    (rank 0 renames)."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        try:
            load(path)
            return path
        except DamagedCheckpoint as error:
            group.barrier()  # every rank is done reading it
            damaged.append(path.with_name(f"{DAMAGED_PREFIX}{path.name}"))
            if group.is_main:
                set_aside(path)
                problem = str(error).split("; ")[0]
                print(f"impasto: {problem}; set aside as {damaged[-1].name}")
            group.barrier()
    if damaged:
        raise ValueError(
            f"{root.parent}: no complete checkpoint left to resume from (set aside: "
            f"{', '.join(path.name for path in damaged)}); start over with --no-resume"
        )
    return None


def check_resumable(path: Path, config: Config) -> None:
    """Print how ``config`` differs from the one the checkpoint at ``path`` was written with;
    a change its state cannot follow (another optimizer) is a one-line error."""
    saved_file = path / "config.yaml"
    try:  # the strict reader: a tampered file (an alias bomb) fails fast, and compares as empty
        saved = read_yaml(saved_file) if saved_file.is_file() else {}
    except ValueError:
        saved = {}
    saved = saved if isinstance(saved, dict) else {}
    saved_optimizer = (saved.get("optim") or {}).get("name")
    if saved_optimizer is not None and saved_optimizer != config.optim.name:
        raise ValueError(
            f"optim.name: the checkpoint {path.name} was trained with {saved_optimizer}, this "
            f"config says {config.optim.name} (its state does not carry over); keep "
            f"optim.name: {saved_optimizer}, or start over with --no-resume"
        )
    changes = config_diff(saved, config_to_dict(config))
    if changes:
        print(f"impasto: resuming with a changed config: {'; '.join(changes)}")


def save_run(
    run_dir: Path,
    config: Config,
    step: int,
    states: dict[str, Stateful],
    header: dict[str, str],
    texts: Mapping[str, str] | None = None,
) -> Path:
    """Checkpoint ``states`` as step ``step``, with ``config.yaml`` and ``texts`` (file name →
    text, e.g. ``dataset.json``). Every weights file's header says what model it belongs to:
    ``header`` (the backbone's) and how the run trained it (the objective)."""
    metadata = header | model_metadata(config)
    return save_states(
        run_dir / CHECKPOINTS,
        step,
        states,
        config.checkpoint.keep_last,
        texts={"config.yaml": config_text(config), **(texts or {})},
        metadata={name: metadata for name in states},
    )
