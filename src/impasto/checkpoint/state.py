"""Atomic, retained full-state checkpoints (DESIGN §6).

A checkpoint is a directory ``RUN/checkpoints/step-XXXXXXXX/`` holding:

- ``*.safetensors``: model weights, one file per trainable module, with string metadata in
  the safetensors header (what kind of model it is: ``impasto.prediction_type`` …);
- ``*.pt``: optimizer and RNG states (``torch.save``, read back with ``weights_only=True``);
- ``state.json``: counters, data position and anything else JSON-serialisable;
- ``config.yaml``: the resolved config, with its hash in ``state.json``.

Everything is written into ``.tmp-step-…`` first, flushed to disk, and renamed into place, so at
every instant the newest ``step-*`` directory is complete: a crash, a kill -9 or a full disk in
the middle of a save leaves the previous checkpoint loadable. ``state.json`` also lists every
other file's size, so a truncated file is found before anything is loaded from it
(:class:`DamagedCheckpoint`; the trainer then resumes from the previous checkpoint).

Space: a save first checks that the disk has room for it (:func:`check_free_space`) and turns a
disk that fills up during the write into one line (:class:`DiskFullError`; the run's other
files, which fail when the disk fills between two saves: :mod:`.space`). Old checkpoints are
pruned by renaming them to ``.tmp-pruned-…`` before deleting them, so a kill during the delete
leaves only a ``.tmp-*`` leftover, removed when the run next starts (:func:`remove_leftovers`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from impasto.faults import fault_point, is_disk_full_error
from impasto.permissions import apply_umask

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"
STATE_FILE = "state.json"
FILES_KEY = "files"  # in state.json: every other file's size in bytes
SPACE_MARGIN = 1.05  # a save needs its estimated size times this, plus SPACE_SLACK, free
SPACE_SLACK = 16 << 20


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files cannot be read back (truncated, tampered, missing): the
    trainer resumes from the previous complete one instead."""


class DiskFullError(ValueError):
    """No room on the disk for a checkpoint or another file of the run (one line; the
    previous checkpoint is intact). ``rank_0_reports``: every rank of a parallel run stops
    with this same line, and rank 0 alone prints it."""

    rank_0_reports = False


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
    """Write ``data`` as the checkpoint for ``step`` atomically, then prune to ``keep_last``.

    Raises :class:`DiskFullError` (one line) when the disk has no room for it, before or while
    writing; the previous checkpoints are untouched either way."""
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    check_free_space(root, final.name, checkpoint_bytes(data))
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    try:
        tmp.mkdir()
        for name, tensors in data.tensors.items():
            path = tmp / f"{name}.safetensors"
            save_file(_contiguous(tensors), path, metadata=data.metadata.get(name))
            fault_point("checkpoint.file")
        for name, obj in data.objects.items():
            torch.save(obj, tmp / f"{name}.pt")
            fault_point("checkpoint.file")
        for name, text in data.texts.items():
            (tmp / name).write_text(text, encoding="utf-8")
        # state.json last: its presence marks a complete checkpoint even without the rename.
        state = data.state | {FILES_KEY: file_sizes(tmp)}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
        apply_umask(tmp)  # safetensors writes 0600: teammates on a cluster could not read it
        _fsync_tree(tmp)
        commit_checkpoint(root, tmp, final)
    except BaseException as error:
        full = isinstance(error, Exception) and is_disk_full(error, root)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(root, final.name, checkpoint_bytes(data)) from None
        raise
    prune_checkpoints(root, keep_last)
    return final


def commit_checkpoint(root: Path, tmp: Path, final: Path) -> None:
    """Rename the written ``tmp`` into place as ``final`` (a re-saved step's old copy is moved
    aside first and dropped after) and flush the directory."""
    fault_point("checkpoint.commit")
    old = root / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints: each is renamed to a ``.tmp-*``
    name first, so a kill during the delete leaves a leftover that is never resumed from and
    is removed at the next start, never a half-deleted ``step-*``."""
    for old in list_checkpoints(root)[:-keep_last]:
        doomed = root / f"{TMP_PREFIX}pruned-{old.name}-{os.getpid()}"
        os.rename(old, doomed)
        _fsync_dir(root)
        fault_point("checkpoint.prune")
        shutil.rmtree(doomed, ignore_errors=True)


def file_sizes(directory: Path) -> dict[str, int]:
    return {file.name: file.stat().st_size for file in sorted(directory.iterdir())}


def checkpoint_bytes(data: CheckpointData) -> int:
    """About how many bytes ``data`` takes on disk (its tensors; the rest is small)."""
    tensors = sum(tensor_bytes(tensors) for tensors in data.tensors.values())
    return tensors + tensor_bytes(data.objects)


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in a nest of dicts, lists and tuples."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return 0


def check_free_space(root: Path, name: str, needed: int) -> None:
    """Raise :class:`DiskFullError` unless ``root``'s disk has room for ``needed`` bytes."""
    if shutil.disk_usage(root).free < needed * SPACE_MARGIN + SPACE_SLACK:
        raise disk_full(root, name, needed)


def is_disk_full(error: Exception, root: Path) -> bool:
    """Whether a failed write failed for want of space: ENOSPC / EDQUOT, or a writer that hides
    the errno (torch.save's zip writer says "unexpected pos") on a disk now (almost) full."""
    if is_disk_full_error(error):  # ENOSPC / EDQUOT, itself or as a wrapped cause
        return True
    if "No space left" in str(error) or "os error 28" in str(error):
        return True
    try:
        return shutil.disk_usage(root).free < SPACE_SLACK
    except OSError:
        return False


def disk_full(root: Path, name: str, needed: int) -> DiskFullError:
    free = free_text(root)
    previous = latest_checkpoint(root)
    kept = f"the previous checkpoint {previous.name} is intact" if previous else "nothing was lost"
    return DiskFullError(
        f"checkpoint {name}: not enough disk space in {root} (needs about "
        f"{human_bytes(needed * SPACE_MARGIN + SPACE_SLACK)}, {free}); {kept}; free some space "
        "(or lower checkpoint.keep_last) and run the same command again to resume"
    )


def free_text(path: Path) -> str:
    """How much space the disk holding ``path`` (or its nearest existing folder) has left."""
    try:
        while not path.exists() and path != path.parent:
            path = path.parent
        return f"{human_bytes(shutil.disk_usage(path).free)} free"
    except OSError:
        return "free space unknown"


def human_bytes(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def load_checkpoint(path: Path) -> CheckpointData:
    """Read every file of a checkpoint; a damaged one (truncated, unreadable, tampered: a
    ``.pt`` that is not plain tensors is refused unread) raises one-line
    :class:`DamagedCheckpoint`."""
    data = CheckpointData()
    sizes = expected_sizes(path)
    for file in sorted(path.iterdir()):
        try:
            if file.name in sizes and file.stat().st_size != sizes[file.name]:
                raise EOFError(f"{file.stat().st_size} bytes, {sizes[file.name]} written")
            if file.suffix == ".safetensors":
                data.tensors[file.stem] = load_file(file)
                with safe_open(file, framework="pt") as handle:
                    data.metadata[file.stem] = handle.metadata() or {}
            elif file.suffix == ".pt":
                data.objects[file.stem] = load_plain(file)
            elif file.name == STATE_FILE:
                data.state = json.loads(file.read_text(encoding="utf-8"))
                data.state.pop(FILES_KEY, None)
            else:
                data.texts[file.name] = file.read_text(encoding="utf-8")
        except (OSError, RuntimeError, ValueError, SafetensorError, EOFError, pickle.PickleError,
                AttributeError, ImportError, IndexError, KeyError, TypeError) as error:  # fmt: skip
            raise damaged(path, file.name, error) from None
    missing = sorted(set(sizes) - {file.name for file in path.iterdir()})
    if missing:
        raise damaged(path, missing[0], FileNotFoundError("missing"))
    return data


def load_plain(file: Path) -> Any:
    """A ``.pt`` file's tensors, lists and numbers (``weights_only``: anything else, such as a
    pickle that would run code, raises ``UnpicklingError`` unread). torch's notice about an
    unusual pickle protocol, which only a file impasto did not write triggers, is not shown:
    the file is reported as damaged instead."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        return torch.load(file, map_location="cpu", weights_only=True)


def expected_sizes(path: Path) -> dict[str, int]:
    """The file sizes ``state.json`` recorded when the checkpoint was written (older
    checkpoints recorded none)."""
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise damaged(path, STATE_FILE, error) from None
    sizes = state.get(FILES_KEY, {}) if isinstance(state, dict) else {}
    return sizes if isinstance(sizes, dict) else {}


def damaged(path: Path, name: str, error: BaseException) -> DamagedCheckpoint:
    why = (
        "refused: not plain tensors"
        if isinstance(error, pickle.PickleError)
        else type(error).__name__
    )
    if isinstance(error, EOFError) and str(error):
        why = f"truncated: {error}"
    if isinstance(error, FileNotFoundError):
        why = "missing"
    return DamagedCheckpoint(
        f"checkpoint {path}: {name} is damaged ({why}); delete this checkpoint to use the "
        "previous one, or start over with --no-resume"
    )


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the way (kept for inspection, never resumed from)."""
    aside = path.with_name(f"{DAMAGED_PREFIX}{path.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(path, aside)
    return aside


def remove_leftovers(root: Path) -> list[Path]:
    """Delete the ``.tmp-*`` leftovers of saves and prunes that a kill interrupted (they are
    never resumed from); only while this process holds the run directory's lock. Returns them."""
    found = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for leftover in found:
        shutil.rmtree(leftover, ignore_errors=True)
    return found


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
