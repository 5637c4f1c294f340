"""A disk that fills up between two checkpoints (issue #29): one line, and every rank stops.

A save checks for room and reports a full disk itself (:mod:`.state`). Between two saves the
disk can fill up anyway, and then another file of the run cannot be written: the metrics
append, TensorBoard's events, a validation grid, the bad-data report, the lock file. Such a
write stops the run with one line that names the file, the newest complete checkpoint (which
nothing after it touches) and what to do::

    not enough disk space to write RUN/metrics.jsonl (0 bytes free); the checkpoint
    step-00000400 is intact; free some space and run the same command again to resume from it

Rank 0 writes these files while the other ranks of a parallel run wait in the step's
collectives, so rank 0 keeps its error (:meth:`DeferredDiskFull.deferred`) until the end of
the step, where the ranks agree to stop with the same flags as a signal's; every rank then
raises the line and rank 0 alone prints it (``DiskFullError.rank_0_reports``). Any other
error passes unchanged.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from impasto.checkpoint.state import DiskFullError, free_text, latest_checkpoint
from impasto.faults import is_disk_full_error

if TYPE_CHECKING:
    from impasto.distributed import RunGroup


def full_between_saves(error: BaseException, run_dir: Path, root: Path) -> DiskFullError:
    """The line for a write that failed for want of space outside a save: the file (from the
    error, as :func:`~impasto.faults.writing` names it; else ``run_dir``) and the newest
    complete checkpoint under ``root``."""
    while not isinstance(error, OSError) and error.__cause__ is not None:
        error = error.__cause__
    path = Path(getattr(error, "filename", None) or run_dir)
    newest = latest_checkpoint(root)
    if newest is None:
        kept = "no checkpoint yet; free some space and run the same command again to start over"
    else:
        kept = (
            f"the checkpoint {newest.name} is intact; free some space and run the same command "
            "again to resume from it"
        )
    quota = getattr(error, "errno", None) == errno.EDQUOT
    room = "over the disk quota" if quota else free_text(path)
    return DiskFullError(f"not enough disk space to write {path} ({room}); {kept}")


@contextmanager
def disk_full_is_one_line(run_dir: Path, root: Path) -> Iterator[None]:
    """Around a whole run (one process): a write that fails for want of space in the block
    raises :func:`full_between_saves`'s line."""
    try:
        yield
    except Exception as error:
        if not is_disk_full_error(error):
            raise
        raise full_between_saves(error, run_dir, root) from error


class DeferredDiskFull:
    """The first write of this rank that failed for want of space, kept until the ranks agree
    to stop (at the end of the step, :attr:`failed` among the flags of ``RunGroup.any``)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Keep a disk-full error of the block instead of raising it (the first one names the
        file); any other error is raised."""
        try:
            yield
        except Exception as error:
            if not is_disk_full_error(error):
                raise
            self.error = self.error or error

    def check(self, group: RunGroup, run_dir: Path, root: Path) -> None:
        """Every rank: stop if a write failed on any rank (one flag all-reduce)."""
        (failed,) = group.any(self.failed)
        if failed:
            raise self.stop(group, run_dir, root)

    def stop(self, group: RunGroup, run_dir: Path, root: Path) -> DiskFullError:
        """Every rank, once they agreed that one has a failed write: the line of the first
        rank with one, which every rank raises and rank 0 alone prints."""
        line = None if self.error is None else str(full_between_saves(self.error, run_dir, root))
        line = next(text for text in group.gather(line) if text is not None)
        stop = DiskFullError(line)
        stop.rank_0_reports = not group.is_main
        stop.__cause__ = self.error
        return stop
