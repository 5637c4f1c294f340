"""SIGTERM and SIGINT: the trainer's main process owns shutdown, whenever the signal comes.

Slurm cancels a job, or ends it at its time limit, by sending SIGTERM to every process of the
job (the data-loader workers too, which ignore it: see :mod:`impasto.data`), then SIGKILL after
a grace period; spot instances and Ctrl-C do much the same. What the trainer does:

- during start-up (loading models, scanning data, filling the cache): stop at once with
  :class:`Interrupted`; nothing has been trained since the newest checkpoint, so nothing is
  lost, and the CLI prints one line and exits 130;
- while training: finish the current step, save a checkpoint, exit 130;
- a second SIGINT while it finishes the step stops at once (the newest checkpoint is kept).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class Interrupted(KeyboardInterrupt):
    """A signal stopped the process at once; the message says what was kept."""


# Process-wide, as signals are: the Interrupted raised by a handler, kept because library code
# it passes through may turn it into another error (torch's C++ wraps it in a ValueError).
_raised: list[Interrupted] = []


def raised_interrupt() -> Interrupted | None:
    """The Interrupted a signal handler raised since :func:`forget_interrupts`, if one did."""
    return _raised[-1] if _raised else None


def forget_interrupts() -> None:
    """Start a command afresh (the CLI, before each command it runs)."""
    _raised.clear()


def _interrupt(message: str) -> Interrupted:
    _raised.append(Interrupted(message))
    return _raised[-1]


class StopRequest:
    """Handles SIGTERM / SIGINT from :meth:`install` to :meth:`restore`: raising
    :class:`Interrupted` at once until :meth:`defer` (start-up), then setting ``requested``
    for the loop to save and stop at the end of the step."""

    def __init__(self) -> None:
        self.requested = False
        self.deferred = False
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def defer(self) -> None:
        """From now on a signal asks the loop to save and stop after its step."""
        self.deferred = True

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.deferred:
            raise _interrupt(
                f"{name} received during start-up; stopped before training (nothing new to "
                "save; run the same command again to continue)"
            )
        if self.requested and signum == signal.SIGINT:
            raise _interrupt(
                f"second {name}: stopped at once without saving this step (the newest "
                "checkpoint is kept; run the same command again to resume from it)"
            )
        self.requested = True
        print(f"\nimpasto: {name} received; saving after this step", flush=True)

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()
