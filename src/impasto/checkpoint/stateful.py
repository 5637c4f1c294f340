"""Save and restore a run as one ``dict[str, Stateful]`` (torchtitan's checkpointer shape).

Every piece of run state (model parts, optimizer, LR schedule, EMA, counters, data position,
RNG streams) has ``state_dict()`` / ``load_state_dict()``. The checkpointer maps each entry to
files of the atomic checkpoint directory (:mod:`impasto.checkpoint.state`) by what its state
is, never by its name:

- a flat ``{name: Tensor}`` → ``NAME.safetensors`` (weights other tools can read);
- JSON values (numbers, strings, lists, dicts of them) → the ``NAME`` key of ``state.json``;
- anything else (optimizer and RNG states) → ``NAME.pt`` (read with ``weights_only=True``).

Entries load in the dict's order: the caller puts the RNG streams last, after every entry whose
loading may draw from them. The same dict is what ``torch.distributed.checkpoint`` takes, so a
sharded save plugs in here later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from impasto.checkpoint.state import CheckpointData, load_checkpoint, save_checkpoint

FORMAT = 2  # 1: before the Stateful checkpointer (the data position inside "train")


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def is_tensor_dict(state: Any) -> bool:
    return isinstance(state, dict) and all(
        isinstance(key, str) and isinstance(value, Tensor) for key, value in state.items()
    )


def is_json(state: Any) -> bool:
    try:
        json.dumps(state)
    except (TypeError, ValueError):
        return False
    return True


def save_states(
    root: Path,
    step: int,
    states: dict[str, Stateful],
    keep_last: int,
    texts: dict[str, str] | None = None,
    metadata: dict[str, dict[str, str]] | None = None,
) -> Path:
    """Write every entry's ``state_dict()`` as the checkpoint of ``step`` (atomically)."""
    data = CheckpointData(texts=dict(texts or {}), metadata=dict(metadata or {}))
    data.state["format"] = FORMAT
    for name, stateful in states.items():
        state = stateful.state_dict()
        if is_tensor_dict(state) and state:
            data.tensors[name] = state
        elif is_json(state):
            data.state[name] = state
        else:
            data.objects[name] = state
    return save_checkpoint(root, step, data, keep_last)


def read_states(path: Path) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path`` by name (older formats migrated)."""
    data = load_checkpoint(path)
    if data.state.get("format", 1) < 2:
        migrate_format_1(data)
    return {**data.objects, **data.state, **data.tensors}


def load_states(path: Path, states: dict[str, Stateful]) -> None:
    """Load the checkpoint at ``path`` into ``states``, in their order."""
    load_saved(path, states, read_states(path))


def load_saved(path: Path, states: dict[str, Stateful], saved: Mapping[str, Any]) -> None:
    """Load each entry of ``saved`` (read from the checkpoint at ``path``) into ``states``, in
    their order. A missing entry is a one-line error naming it."""
    for name, stateful in states.items():
        if name not in saved:
            raise ValueError(
                f"checkpoint {path}: no {name!r} state (it was written without it: was the "
                "config changed, e.g. ema.enabled or parts.*?); restore the config or use "
                "--no-resume"
            )
        try:
            stateful.load_state_dict(saved[name])
        except ValueError as error:
            raise ValueError(f"checkpoint {path}: {error}") from None
        except (KeyError, TypeError, IndexError, RuntimeError, AttributeError) as error:
            raise ValueError(
                f"checkpoint {path}: its {name!r} state does not fit this run "
                f"({type(error).__name__}: {str(error)[:200]}); restore the config it was "
                "written with, or start over with --no-resume"
            ) from None


def migrate_format_1(data: CheckpointData) -> None:
    """Checkpoints written before the Stateful checkpointer (in place): the data position lived
    in the train counters, and the EMA's update count in ``ema.pt`` beside its weights."""
    train = data.state.get("train", {})
    if "epoch" in train:
        data.state["data"] = {
            "epoch": train.pop("epoch"),
            "batch_in_epoch": train.pop("batch_in_epoch"),
        }
    if "ema" in data.objects:
        data.state["ema_state"] = data.objects.pop("ema")
    run = ("config_hash", "impasto_version", "lr")
    data.state["run"] = {key: data.state.pop(key) for key in run if key in data.state}
    data.state["lr_schedule"] = {}  # a function of the step and the config: nothing to load


class StatefulValue:
    """A Stateful view of plain getters and setters (for state kept by other objects)."""

    def __init__(self, get: Any, put: Any) -> None:
        self.state_dict, self.load_state_dict = get, put
