"""Graceful stop on SIGTERM/SIGINT: finish the current step, save, exit (DESIGN §6).

Slurm and spot instances send SIGTERM before killing a job; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopRequest:
    """Context manager whose ``requested`` turns true on the first SIGTERM or SIGINT."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nimpasto: {signal.Signals(signum).name} received; saving after this step")

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
