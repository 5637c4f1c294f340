"""Fault injection for the reliability tests, and the named write points a full disk is
reported at.

``IMPASTO_FAULT=POINT:N`` makes the process kill itself with SIGKILL the ``N``-th time it
reaches ``fault_point(POINT)`` (``tests/reliability`` uses it to stop runs inside a checkpoint
write, between its rename and its prune, or in a cache fill, moments a timer rarely hits).
``IMPASTO_FAULT=enospc@POINT:N`` instead makes the ``N``-th pass of ``POINT`` and every later
one raise ``OSError(ENOSPC)``, as a disk that fills up then and stays full: the run's one-line
stop on a full disk (issue #29) is tested at each of its writers. Passes are counted per
spec, so an in-process test that sets another ``SPEC`` counts afresh. Unset, a point costs
one comparison. The points:

- ``step``: an optimizer step is done (before logging, sampling and saving);
- ``checkpoint.file``: a checkpoint file is written into the temporary directory;
- ``checkpoint.commit``: the checkpoint is complete but not yet renamed into place;
- ``checkpoint.prune``: an old checkpoint is renamed aside but not yet deleted;
- ``cache.shard``: a cache shard is written and flushed but not yet renamed into place;
- the write points of :func:`writing`, one per file a run writes between two checkpoints:
  ``metrics.write`` (``metrics.jsonl``), ``tensorboard.write``, ``samples.write`` (a
  validation grid), ``bad_data.write`` (the bad-data report), ``lock.write`` (the run's lock
  file), ``wandb.write`` (the wandb run id).

A write that fails for want of space raises an ``OSError`` whose ``filename`` often is None
(``file.write()`` and ``close()`` do not know the file's name): :func:`writing` names it, so
that the trainer's one line says which file could not be written.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SPEC = os.environ.get("IMPASTO_FAULT", "")
ENOSPC_PREFIX = "enospc@"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_passes: dict[tuple[str, str], int] = {}  # process-wide on purpose: (spec, point) → passes


def fault_point(name: str, path: Path | str | None = None) -> None:
    """Kill this process (SIGKILL, as ``kill -9``) if ``IMPASTO_FAULT`` names this pass, or
    raise ``OSError(ENOSPC)`` for ``path`` from the named pass on (``enospc@``)."""
    if not SPEC:
        return
    point, _, count = SPEC.partition(":")
    enospc = point.startswith(ENOSPC_PREFIX)
    if point.removeprefix(ENOSPC_PREFIX) != name:
        return
    key = (SPEC, name)
    _passes[key] = _passes.get(key, 0) + 1
    if enospc and _passes[key] >= int(count or 1):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else str(path))
    if not enospc and _passes[key] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def is_disk_full_error(error: BaseException) -> bool:
    """An ``OSError`` for want of space (ENOSPC, or EDQUOT: a quota), itself or as the cause of
    the error a library wrapped it in."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        error = error.__cause__
    return False


@contextmanager
def writing(path: Path | str, point: str | None = None) -> Iterator[None]:
    """Around the writes of one file: a disk-full error from them (``write``, ``flush`` or
    ``close``) names ``path`` when it names no file. ``point``: the fault point it is
    (``IMPASTO_FAULT=enospc@POINT:N`` fails the N-th pass on)."""
    try:
        if point is not None:
            fault_point(point, path)
        yield
    except OSError as error:
        if error.errno in DISK_FULL_ERRNOS and not error.filename:
            error.filename = str(path)
        raise
