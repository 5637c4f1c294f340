"""Fault injection for the reliability tests: kill -9 at a named point of a run.

``IMPASTO_FAULT=POINT:N`` makes the process kill itself with SIGKILL the ``N``-th time it
reaches ``fault_point(POINT)`` (``tests/reliability`` uses it to stop runs inside a checkpoint
write, between its rename and its prune, or in a cache fill, moments a timer rarely hits).
Unset, a point costs one comparison. The points:

- ``step``: an optimizer step is done (before logging, sampling and saving);
- ``checkpoint.file``: a checkpoint file is written into the temporary directory;
- ``checkpoint.commit``: the checkpoint is complete but not yet renamed into place;
- ``checkpoint.prune``: an old checkpoint is renamed aside but not yet deleted;
- ``cache.shard``: a cache shard is written and flushed but not yet renamed into place.
"""

from __future__ import annotations

import os
import signal

SPEC = os.environ.get("IMPASTO_FAULT", "")
_passes: dict[str, int] = {}  # process-wide on purpose: counts passes of each point


def fault_point(name: str) -> None:
    """Kill this process (SIGKILL, as ``kill -9``) if ``IMPASTO_FAULT`` names this pass."""
    if not SPEC:
        return
    point, _, count = SPEC.partition(":")
    if point != name:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
