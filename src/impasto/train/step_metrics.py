"""What the loop measures besides the loss (issue #18), cheaply: host timers and device sums,
read on logging steps only (no host sync on the others).

Between two logging steps :class:`IntervalMeter` adds up the time the steps took, the part of
it spent waiting for the next batch, and the ``(sum, count)`` metrics of the method (e.g. the
loss per timestep bucket, :func:`~impasto.train.methods.time_bucket_metrics`) as device
tensors; a logging step reads them and starts over. :class:`TrainingClock` is the training
time over all the sessions of a run (resumes included).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor


class IntervalMeter:
    """Sums over the steps since the last logging step (module docstring)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step_s = 0.0  # the steps' wall time
        self.wait_s = 0.0  # of it, waiting for batches
        self.subsets: dict[str, Tensor] = {}  # name → [2] (sum, count), on the device

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time a wait for the data (around ``next(stream)``)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - started

    def add_subsets(self, metrics: dict[str, Tensor]) -> None:
        """Add one step's ``(sum, count)`` metrics (device adds only)."""
        for name, value in metrics.items():
            total = self.subsets.get(name)
            self.subsets[name] = value if total is None else total + value

    def data_wait(self) -> float:
        """The fraction of the interval's step time spent waiting for batches."""
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0


def subset_means(names: list[str], sums_and_counts: list[float]) -> dict[str, float]:
    """``name → sum / count`` from the flat ``[sum, count, sum, count, …]`` read on the host,
    leaving out the names whose count is 0 (no sample fell in them this interval)."""
    values = {}
    for number, name in enumerate(names):
        total, count = sums_and_counts[2 * number], sums_and_counts[2 * number + 1]
        if count > 0:
            values[name] = total / count
    return values


def group_lrs(optimizer: Any) -> dict[str, float]:
    """``lr/NAME`` of each part's param group when the parts train with several groups (the
    optimizer's groups carry the part's ``name``; a fused-backward optimizer has one group per
    parameter, the same LR per part); nothing for one group (``lr`` says it)."""
    lrs: dict[str, float] = {}
    for number, group in enumerate(optimizer.param_groups):
        lrs.setdefault(str(group.get("name", number)), float(group["lr"]))
    return {f"lr/{name}": lr for name, lr in lrs.items()} if len(lrs) > 1 else {}


class TrainingClock:
    """The run's training time: what the sessions before this one had at the checkpoint it
    resumed (:meth:`resume`, from the checkpoint's ``run`` record) plus this session's time
    since it started. ``now``: the clock (a test passes a fake one)."""

    def __init__(self, now: Any = time.perf_counter) -> None:
        self.now = now
        self.started = now()
        self.before = 0.0

    def elapsed(self) -> float:
        return self.before + self.now() - self.started

    def resume(self, elapsed: float) -> None:
        self.before = float(elapsed)
