"""Atomic, retained full-state checkpoints (DESIGN §6).

A checkpoint is a directory ``RUN/checkpoints/step-XXXXXXXX/`` holding:

- ``*.safetensors``: model weights, one file per trainable module, with string metadata in
  the safetensors header (what kind of model it is: ``impasto.prediction_type`` …);
- ``*.pt``: optimizer and RNG states (``torch.save``, read back with ``weights_only=True``);
- ``state.json``: counters, data position and anything else JSON-serialisable;
- ``config.yaml``: the resolved config, with its hash in ``state.json``.

Everything is written into ``.tmp-step-…`` first, flushed to disk, and renamed into place, so at
every instant the newest ``step-*`` directory is complete: a crash, a kill -9 or a full disk in
the middle of a save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
STATE_FILE = "state.json"


@dataclass
class CheckpointData:
    """What a checkpoint holds, by file: name → contents."""

    tensors: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # → NAME.safetensors
    objects: dict[str, Any] = field(default_factory=dict)  # → NAME.pt
    state: dict[str, Any] = field(default_factory=dict)  # → state.json
    texts: dict[str, str] = field(default_factory=dict)  # → NAME (e.g. config.yaml)
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)  # NAME.safetensors header


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    found = [p for p in found if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(root: Path, step: int, data: CheckpointData, keep_last: int) -> Path:
    """Write ``data`` as the checkpoint for ``step`` atomically, then prune to ``keep_last``."""
    root.mkdir(parents=True, exist_ok=True)
    remove_partial_checkpoints(root)
    final = checkpoint_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    try:
        tmp.mkdir()
        for name, tensors in data.tensors.items():
            path = tmp / f"{name}.safetensors"
            save_file(_contiguous(tensors), path, metadata=data.metadata.get(name))
        for name, obj in data.objects.items():
            torch.save(obj, tmp / f"{name}.pt")
        for name, text in data.texts.items():
            (tmp / name).write_text(text, encoding="utf-8")
        # state.json last: its presence marks a complete checkpoint even without the rename.
        (tmp / STATE_FILE).write_text(json.dumps(data.state, indent=2), encoding="utf-8")
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step: move the old copy aside first, drop it after
            os.rename(final, root / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}")
        os.rename(tmp, final)
        _fsync_dir(root)
        remove_partial_checkpoints(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> CheckpointData:
    """Read every file of a checkpoint; a damaged file raises one-line :class:`ValueError`."""
    data = CheckpointData()
    for file in sorted(path.iterdir()):
        try:
            if file.suffix == ".safetensors":
                data.tensors[file.stem] = load_file(file)
                with safe_open(file, framework="pt") as handle:
                    data.metadata[file.stem] = handle.metadata() or {}
            elif file.suffix == ".pt":
                data.objects[file.stem] = torch.load(file, map_location="cpu", weights_only=True)
            elif file.name == STATE_FILE:
                data.state = json.loads(file.read_text(encoding="utf-8"))
            else:
                data.texts[file.name] = file.read_text(encoding="utf-8")
        except (OSError, RuntimeError, ValueError, SafetensorError, EOFError) as error:
            raise ValueError(
                f"checkpoint {path}: {file.name} is unreadable ({type(error).__name__}); "
                "delete this checkpoint to resume from the previous one, or use --no-resume"
            ) from None
    return data


def remove_partial_checkpoints(root: Path) -> None:
    """Delete ``.tmp-*`` leftovers of saves that were interrupted (they are never resumed from)."""
    if root.is_dir():
        for partial in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(partial, ignore_errors=True)


def _contiguous(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: t.detach().contiguous().cpu() for name, t in tensors.items()}


def _fsync_tree(directory: Path) -> None:
    for file in directory.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
