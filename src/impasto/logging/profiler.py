"""``log.profile``: trace a few training steps with ``torch.profiler`` (issue #18).

The schedule skips ``wait`` steps, warms up for ``warmup`` (recorded, then discarded: the first
steps pay for kernel selection and allocator growth) and records ``active`` steps, once. The
trace goes to ``RUN/profile/*.pt.trace.json`` (open it in Perfetto, https://ui.perfetto.dev,
or ``chrome://tracing``); at the end of the run the ops that took the most time are printed.
Rank 0 only: the other ranks run unprofiled.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

if TYPE_CHECKING:
    from impasto.config.schema import ProfileConfig

PROFILE_DIR = "profile"
TABLE_ROWS = 15


class StepProfiler:
    """Profiles the steps of ``profile``'s window; ``profile`` None or not ``main``: does
    nothing. Call :meth:`step` after every training step and :meth:`close` at the end."""

    def __init__(self, profile_config: ProfileConfig | None, run_dir: Path, main: bool) -> None:
        self.profiler: profile | None = None
        self.num_steps = 0
        self.stopped = False
        if profile_config is None or not main:
            return
        wait, warmup, active = profile_config.wait, profile_config.warmup, profile_config.active
        self.first, self.last = wait + warmup + 1, wait + warmup + active  # counted from 1
        activities = [ProfilerActivity.CPU]
        self.sort_by = "self_cpu_time_total"
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            self.sort_by = "self_device_time_total"  # the kernels' own time on the GPU
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(run_dir / PROFILE_DIR)),
            record_shapes=False,
            with_stack=False,
        )
        self.profiler.start()

    def step(self) -> None:
        """A training step finished. Outside the window a counter; the profiler itself works
        (and may wait for the device) only at the window's edges."""
        if self.profiler is None or self.stopped:
            return
        self.profiler.step()
        self.num_steps += 1
        if self.num_steps == self.last:  # the window is written: stop paying for the profiler
            self.stop()

    def stop(self) -> None:
        if self.profiler is not None and not self.stopped:
            self.profiler.stop()  # in the active window, this writes the trace of its steps
            self.stopped = True

    def table(self) -> str | None:
        """The top ops of the recorded steps by self time; None when no step was recorded (the
        run ended before the window)."""
        if self.profiler is None or self.num_steps < self.first:
            return None
        return self.profiler.key_averages().table(sort_by=self.sort_by, row_limit=TABLE_ROWS)

    def close(self) -> None:
        """Stop, and print the top ops (or why there are none)."""
        if self.profiler is None:
            return
        self.stop()
        table = self.table()
        window = f"steps {self.first}-{min(self.last, self.num_steps)} of this session"
        if table is None:
            print(f"impasto: profile: the run ended before step {self.first}; nothing recorded")
            return
        print(f"impasto: profile of {window} (trace in {PROFILE_DIR}/):\n{table}")
