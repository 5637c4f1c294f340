"""Sharded checkpoints of parallel runs, through ``torch.distributed.checkpoint`` (DCP).

A parallel run (``parallel.strategy`` ddp, fsdp or hsdp) saves ``RUN/checkpoints/step-N/``:

- ``__<rank>_0.distcp`` (one file per rank) and ``.metadata``: DCP's files, holding every
  entry whose state is not JSON: the trained weights (each rank its shards; a weight every
  rank holds whole is written once), the optimizer state (keyed by parameter name), the EMA,
  the RNG streams;
- ``state.json``: the JSON entries (counters, data position, LR schedule) and the model
  metadata the weights files of a one-process checkpoint carry in their headers; written
  last, by rank 0, so its presence marks a complete checkpoint (as in :mod:`.state`);
- ``config.yaml``.

Atomic like a one-process checkpoint: every rank writes into ``.tmp-step-N``, and rank 0
renames it into place once all of them have finished (a barrier). A disk without room for it,
before or during the write, stops every rank with the same one line (:class:`DiskFullError`;
rank 0 prints it). With ``async`` the ranks
stage their state in host memory and write it in a background thread while training goes
on; the rename happens at the first step at which every rank's writer has finished.

DCP reshards on load: a checkpoint saved on 4 ranks loads on 2, on 1, or into a one-process
run, because every tensor is stored with its global shape and each rank reads the region its
own weights cover. :func:`read_full` reads a whole checkpoint into one process (exports).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from impasto.checkpoint.state import (
    FILES_KEY,
    PREFIX,
    STATE_FILE,
    TMP_PREFIX,
    DiskFullError,
    _fsync_tree,
    check_free_space,
    checkpoint_dir,
    commit_checkpoint,
    damaged,
    disk_full,
    expected_sizes,
    file_sizes,
    is_disk_full,
    prune_checkpoints,
)
from impasto.checkpoint.stateful import FORMAT, Stateful, is_json, load_saved
from impasto.distributed import RunGroup
from impasto.permissions import apply_umask

LAYOUT = "sharded"
METADATA_FILE = ".metadata"  # DCP's
MODEL_METADATA_KEY = "model_metadata"


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at ``path`` was written by a parallel run (DCP files)."""
    return (path / METADATA_FILE).is_file()


@dataclass
class PendingSave:
    """A save whose DCP files are being written; made complete by :meth:`ShardedCheckpointer.
    finish`."""

    step: int
    tmp: Path
    state: dict[str, Any]
    texts: dict[str, str]
    needed: int  # bytes, over all ranks
    future: Future | None = None


class ShardedCheckpointer:
    """Saves a run's Stateful dict as sharded checkpoints under ``root`` (every rank calls every
    method at the same step: each is collective)."""

    def __init__(self, root: Path, group: RunGroup, keep_last: int, background: bool) -> None:
        self.root, self.group, self.keep_last, self.background = root, group, keep_last, background
        self.pending: PendingSave | None = None
        # A background writer runs its collectives (DCP's plan exchange) in its own thread:
        # on a group of its own (gloo), so they never interleave with the training's.
        self.writer_group = None
        if background and group.world > 1:
            import torch.distributed as dist

            self.writer_group = dist.new_group(backend="gloo")

    def save(
        self,
        step: int,
        states: dict[str, Stateful],
        texts: dict[str, str],
        model_metadata: dict[str, dict[str, str]],
    ) -> Path | None:
        """Write ``states`` as the checkpoint of ``step``; its path, or None while it is being
        written in the background (``async``)."""
        self.wait()
        tmp = self.root / f"{TMP_PREFIX}{PREFIX}{step:08d}"
        distributed, state = split_states(states)
        (needed,) = self.group.sum(written_bytes(distributed, self.group.is_main))
        problem = None
        if self.group.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                check_free_space(self.root, tmp.name.removeprefix(TMP_PREFIX), needed)
                tmp.mkdir()
            except DiskFullError as error:
                problem = str(error)
        # Rank 0's verdict on every rank, before any rank's DCP writer makes the folder too
        # (a rank 0 slower than its peers then found it made, and stopped the run).
        self.stop_if_full(self.group.gather(problem)[0])
        state |= {"format": FORMAT, "layout": LAYOUT, MODEL_METADATA_KEY: model_metadata}
        pending = PendingSave(step, tmp, state, texts, needed)
        import torch.distributed.checkpoint as dcp

        if self.background:
            pending.future = dcp.async_save(
                distributed, checkpoint_id=str(tmp), process_group=self.writer_group
            )
            self.pending = pending
            return None
        self.written(pending, lambda: dcp.save(distributed, checkpoint_id=str(tmp)))
        self.pending = pending
        return self.finish()

    def poll(self) -> Path | None:
        """Complete a background save once every rank has written its files (a host flag
        all-reduce; call it at the same step on every rank). The checkpoint's path, or None."""
        if self.pending is None:
            return None
        future = self.pending.future
        (busy,) = self.group.any(future is not None and not future.done())
        return None if busy else self.finish()

    def wait(self) -> Path | None:
        """Finish a pending save (blocking)."""
        return None if self.pending is None else self.finish()

    def finish(self) -> Path:
        pending, self.pending = self.pending, None
        if pending.future is not None:
            self.written(pending, pending.future.result)  # a writer's error, on every rank
        self.group.barrier()  # every rank's files are on disk
        final = checkpoint_dir(self.root, pending.step)
        problem = None
        if self.group.is_main:
            try:
                commit(self.root, pending, final, self.keep_last)
            except Exception as error:
                if not is_disk_full(error, self.root):
                    raise
                problem = str(self.disk_full(pending))
        # Rank 0's verdict on every rank; the checkpoint is in place for every rank.
        self.stop_if_full(self.group.gather(problem)[0])
        return final

    def written(self, pending: PendingSave, write: Callable[[], object]) -> None:
        """Run DCP's ``write`` of ``pending`` (every rank). DCP gathers the ranks' errors and
        raises them on every rank as one ``CheckpointException``: one that a full disk caused
        becomes :class:`DiskFullError` (and the partial files are removed)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            write()
        except CheckpointException as error:
            failures = [failure for failure, _ in error.failures.values()]
            if not any(isinstance(f, Exception) and is_disk_full(f, self.root) for f in failures):
                raise
            self.stop_if_full(str(self.disk_full(pending)))

    def disk_full(self, pending: PendingSave) -> DiskFullError:
        """The line for ``pending``, whose partial files rank 0 removes first."""
        if self.group.is_main:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        return disk_full(self.root, checkpoint_dir(self.root, pending.step).name, pending.needed)

    def stop_if_full(self, problem: str | None) -> None:
        """Raise :class:`DiskFullError` with ``problem`` (rank 0's line, which every rank
        has), if any; printed by rank 0 alone."""
        if problem is None:
            return
        error = DiskFullError(problem)
        error.rank_0_reports = not self.group.is_main
        raise error


def commit(root: Path, pending: PendingSave, final: Path, keep_last: int) -> None:
    """Rank 0: write the JSON state and texts, flush, rename into place, prune old ones."""
    tmp = pending.tmp
    for name, text in pending.texts.items():
        (tmp / name).write_text(text, encoding="utf-8")
    state = pending.state | {FILES_KEY: file_sizes(tmp)}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
    apply_umask(tmp)
    _fsync_tree(tmp)
    commit_checkpoint(root, tmp, final)
    prune_checkpoints(root, keep_last)


def written_bytes(value: Any, main: bool) -> int:
    """About the bytes this rank writes of ``value``: its shards of the sharded tensors
    (DTensors), and on rank 0 the tensors every rank holds whole (DCP writes those once)."""
    if isinstance(value, Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value if main else None
        return 0 if local is None else local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(written_bytes(item, main) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(written_bytes(item, main) for item in value)
    return 0


def split_states(states: dict[str, Stateful]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the entries DCP writes, the JSON entries of ``state.json``), by what each state is."""
    distributed, plain = {}, {}
    for name, stateful in states.items():
        state = stateful.state_dict()
        if is_json(state):
            plain[name] = state
        else:
            distributed[name] = state
    return distributed, plain


def load_sharded(path: Path, states: dict[str, Stateful]) -> None:
    """Load the sharded checkpoint at ``path`` into ``states`` (in their order), resharding to
    this run's ranks and strategy. A missing entry is a one-line error naming it."""
    import torch.distributed.checkpoint as dcp

    state = read_json_state(path)
    saved = dcp_keys(path)
    # DCP loads in place: into each entry's current state (this rank's shards).
    distributed = {
        name: stateful.state_dict()
        for name, stateful in states.items()
        if name not in state and name in saved
    }
    try:
        dcp.load(distributed, checkpoint_id=str(path))
    except (RuntimeError, ValueError, KeyError, OSError) as error:
        raise ValueError(
            f"checkpoint {path}: the sharded state does not fit this run "
            f"({one_line(error)}); restore the config it was written with, or use --no-resume"
        ) from None
    load_saved(path, states, {**state, **distributed})


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def read_json_state(path: Path) -> dict[str, Any]:
    """``state.json`` of a sharded checkpoint, once every file it lists has the size it was
    written with (else :class:`DamagedCheckpoint`)."""
    sizes = expected_sizes(path)
    for name, size in sizes.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            actual = f"{file.stat().st_size} bytes" if file.is_file() else "missing"
            raise damaged(path, name, EOFError(f"{actual}, {size} written"))
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    state.pop(FILES_KEY, None)
    return state


def dcp_keys(path: Path) -> set[str]:
    """The top-level entries of a DCP checkpoint (from its metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except (OSError, RuntimeError, ValueError, EOFError) as error:
        raise damaged(path, METADATA_FILE, error) from None
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def read_full(path: Path, names: set[str] | None = None) -> dict[str, Any]:
    """The entries ``names`` (default: all) of a sharded checkpoint as whole tensors and
    objects, in this one process (no process group; any number of ranks wrote it), with the
    JSON entries. Only the named entries are read (an export skips the optimizer's moments)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    full: dict[str, Any] = {}
    try:
        _load_state_dict(
            full,
            storage_reader=FileSystemReader(str(path)),
            planner=_EmptyStateDictLoadPlanner(keys=names),
            no_dist=True,
        )
    except (OSError, RuntimeError, ValueError, EOFError) as error:
        raise ValueError(
            f"checkpoint {path}: the sharded files are unreadable ({one_line(error)}); delete "
            "this checkpoint to use the previous one"
        ) from None
    return {**full, **read_json_state(path)}


def read_weights(path: Path, names: set[str]) -> dict[str, dict[str, Tensor]]:
    """The weights entries ``names`` of a sharded checkpoint (those it has), each a flat
    ``{name: Tensor}`` of whole CPU tensors, as a one-process checkpoint's files hold them."""
    saved = dcp_keys(path)
    full = read_full(path, names & saved)
    return {
        name: {key: tensor.contiguous() for key, tensor in full[name].items()}
        for name in names & saved
    }


def read_model_metadata(path: Path) -> dict[str, dict[str, str]]:
    """Each weights entry's model metadata (what a one-process checkpoint's headers say)."""
    return read_json_state(path).get(MODEL_METADATA_KEY, {})
