"""One trainer per run directory: an exclusive lock held for the whole run (issue #16).

Two trainers on one output directory corrupt each other: one deletes the other's checkpoint in
progress, both append to ``metrics.jsonl``, the second resumes the first's checkpoints. The
first takes ``RUN/.impasto.lock`` with ``flock``; a second one stops with one line naming the
holder (pid, host, start time).

Stale locks need no clean-up: the kernel drops a ``flock`` when its holder dies, kill -9
included, so a lock file left behind by a dead run is simply taken over. On a filesystem
without ``flock`` (some network mounts) the lock is the file's existence instead, created
with ``O_EXCL``; a file whose holder ran on this host and is gone is stale and replaced, one
from another host is reported with the command that removes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from impasto.faults import is_disk_full_error, writing

if TYPE_CHECKING:
    from impasto.checkpoint.space import DeferredDiskFull

LOCK_FILE = ".impasto.lock"
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirInUse(ValueError):
    """Another live process holds the run directory."""


def lock_run_dir(
    run_dir: Path, group: Any, writes: DeferredDiskFull | None = None
) -> RunLock | None:
    """Rank 0 of ``group`` (a :class:`~impasto.distributed.RunGroup`) locks the run
    directory; when it cannot, every rank stops with its line. ``writes``: a
    :class:`~impasto.checkpoint.space.DeferredDiskFull` that keeps a full disk's error (the
    lock file's holder record) for the caller to stop every rank with."""
    lock, problem = None, None
    if group.is_main:
        try:
            with writes.deferred() if writes is not None else contextlib.nullcontext():
                make_run_dir(run_dir)
                lock = RunLock(run_dir).acquire()
        except ValueError as error:
            problem = str(error)
    (problem,) = group.gather(problem)[:1]
    if problem is not None:
        raise RunDirInUse(problem)
    return lock


# The descriptors of the locks this process holds. A forked child (a data-loader worker)
# shares each one's open file, and with it the flock, which would outlive this process while
# the child runs: the child closes its copies at once (the lock stays with this process).
_HELD: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def make_run_dir(run_dir: Path) -> None:
    """Create ``train.output_dir``; a folder that cannot be made (a read-only mount, a
    pseudo-filesystem such as /proc, no permission) is one line naming the key (issue #29).
    A full disk is left to the caller (:mod:`impasto.checkpoint.space`)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if is_disk_full_error(error):
            raise
        where = f": {error.filename}" if error.filename and Path(error.filename) != run_dir else ""
        raise ValueError(
            f"train.output_dir: cannot create {run_dir} ({error.strerror or error}{where}); "
            "choose a folder you can write to"
        ) from None


class RunLock:
    """The lock on ``run_dir``, held from :meth:`acquire` until :meth:`release` (or until the
    process ends, however it ends)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        self._exclusive_file = False  # the O_EXCL fallback: the file itself is the lock
        self._finalizer: weakref.finalize | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirInUse(in_use_message(self.path, read_holder(self.path))) from None
        except OSError as error:
            os.close(fd)
            if error.errno not in UNSUPPORTED:
                raise
            self._acquire_exclusive_file()
            return self
        try:
            write_holder(fd, self.path)
        except BaseException:  # a full disk: the lock is not kept (a later try takes it)
            os.close(fd)
            raise
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        _HELD.add(fd)
        return self

    def _acquire_exclusive_file(self) -> None:
        """The fallback without ``flock``: create the file exclusively; replace a stale one."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if not is_stale(holder):
                    raise RunDirInUse(in_use_message(self.path, holder, fallback=True)) from None
                self.path.unlink(missing_ok=True)
                continue
            try:
                write_holder(fd, self.path)
            except BaseException:
                self.path.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
            self._exclusive_file = True
            self._finalizer = weakref.finalize(self, self.path.unlink, missing_ok=True)
            return
        raise RunDirInUse(in_use_message(self.path, read_holder(self.path), fallback=True))

    def release(self) -> None:
        """Give the directory up (the lock file stays: unlinking a flocked file would let a
        third process lock a new file while a second still waits on the old one)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        _HELD.discard(self._fd)
        self._fd = None
        self._exclusive_file = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def write_holder(fd: int, path: Path) -> None:
    """Record who holds the lock (for the message a second trainer prints) in ``path``, open
    as ``fd``."""
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with writing(path, "lock.write"):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)


def read_holder(path: Path) -> dict[str, object]:
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(holder, dict):
            return holder
    return {}


def is_stale(holder: dict[str, object]) -> bool:
    """A holder that ran on this host and is no longer alive (or an unreadable record)."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return True
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def is_locked(run_dir: Path) -> bool:
    """Whether a trainer holds the run's lock now: a shared ``flock`` that fails while the
    trainer's exclusive one is held (released at once); where ``flock`` is missing, the
    lock file's holder, if alive."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:  # no flock here: the trainer's fallback wrote who holds it
        holder = read_holder(path)
        return bool(holder) and not is_stale(holder)
    finally:
        os.close(fd)


def in_use_message(path: Path, holder: dict[str, object], fallback: bool = False) -> str:
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    if holder.get("started"):
        who += f", since {holder['started']}"
    fix = "wait for it to finish, stop it, or set another train.output_dir"
    if fallback:
        fix += f" (if no such process runs any more, delete {path})"
    return f"train.output_dir {path.parent} is in use by another impasto run ({who}); {fix}"
