"""The progress display of a run: a smoothed loss, and an ETA that counts the validations and
checkpoints still to come (issue #17). Pure functions and small classes of host floats: nothing
here reads a tensor, so the display never adds a host sync and never changes a number the run
computes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Literal

from tqdm import tqdm

STEP_SMOOTHING = 0.98  # per step: the smoothed loss and s/step average about the last 50 steps
TIMED_STEPS_FOR_ESTIMATE = 5  # steps timed before the one-line estimate of the run's length

Timed = Literal["validation", "save"]
"""What :class:`RunClock` times apart from the training steps."""


class Smoother:
    """An exponential moving average with TensorBoard's bias correction: after values
    ``v_1 .. v_n`` it is ``sum_i (1 - w) w^(n-i) v_i / (1 - w^n)``, so the first value is
    itself (no pull towards 0). Non-finite values are left out, as TensorBoard does.
    ``weight``: the weight ``w`` of the past, in [0, 1)."""

    def __init__(self, weight: float) -> None:
        if not 0 <= weight < 1:
            raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
        self.weight = weight
        self.accumulated = 0.0
        self.count = 0

    def update(self, value: float) -> float | None:
        """Add ``value``; returns the smoothed value (None while no finite value came)."""
        if math.isfinite(value):
            self.accumulated = self.accumulated * self.weight + (1 - self.weight) * value
            self.count += 1
        return self.value

    @property
    def value(self) -> float | None:
        if self.count == 0:
            return None
        return self.accumulated / (1 - self.weight**self.count)


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded), rounded to the second."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def count_due(after: int, upto: int, every: int, final: bool) -> int:
    """How many steps ``s`` with ``after < s <= upto`` are due: ``s`` a multiple of ``every``
    (0: never), or (``final``) ``s == upto`` (the run's last step)."""
    if every <= 0 or upto <= after:
        return 0
    due = upto // every - after // every
    return due + (1 if final and upto % every else 0)


@dataclass(frozen=True)
class Schedule:
    """When a run validates and saves: as ``Trainer.should_sample`` and ``should_save`` say
    (validation every ``sample_every`` steps and at the last step, 0: never; a checkpoint every
    ``save_every`` steps and, with ``save_final``, at the last)."""

    total_steps: int
    sample_every: int
    save_every: int
    save_final: bool

    def validations_after(self, step: int) -> int:
        return count_due(step, self.total_steps, self.sample_every, final=True)

    def saves_after(self, step: int) -> int:
        return count_due(step, self.total_steps, self.save_every, self.save_final)


def remaining_seconds(
    step: int, schedule: Schedule, step_s: float, validation_s: float, save_s: float
) -> float:
    """Time left after ``step``: the remaining steps at ``step_s`` each, plus the remaining
    validations and checkpoints at ``validation_s`` and ``save_s`` each."""
    steps = max(0, schedule.total_steps - step)
    validations = schedule.validations_after(step) * validation_s
    return steps * step_s + validations + schedule.saves_after(step) * save_s


class RunClock:
    """Wall time of a run's training steps, validations and checkpoint saves, kept apart.

    A step's time is the wall time from its start to the next step's start, less the
    validation and save time in between: on a GPU the loop queues work asynchronously, so
    that interval (not the time ``step()`` takes to return) is what a step costs. The first
    step of a process is warm-up (kernel selection, compilation, allocator growth) and counts
    only until a second one is timed. Steps average with :class:`Smoother`; validations and
    saves by their mean. Before the first validation is measured, it is estimated as
    ``validation_steps`` training steps (see ``impasto.train.summary.validation_cost``).
    """

    def __init__(self, schedule: Schedule, validation_steps: float, smoothing: float) -> None:
        self.schedule = schedule
        self.validation_steps = validation_steps
        self.step_s = Smoother(smoothing)
        self.warmup_s: float | None = None
        self.totals: dict[Timed, float] = {"validation": 0.0, "save": 0.0}
        self.counts: dict[Timed, int] = {"validation": 0, "save": 0}
        self.extra_s = 0.0  # validation and save time since the current step started
        self.step_started: float | None = None
        self.num_timed = 0

    def start_step(self) -> None:
        """A step starts: the one before it (if any) is timed now."""
        now = time.perf_counter()
        if self.step_started is not None:
            self.add_step(now - self.step_started - self.extra_s)
        self.step_started, self.extra_s = now, 0.0

    def add_step(self, seconds: float) -> None:
        self.num_timed += 1
        if self.num_timed == 1:
            self.warmup_s = seconds
        else:
            self.step_s.update(seconds)

    @contextmanager
    def timing(self, kind: Timed) -> Iterator[None]:
        """Time a ``validation`` or a ``save`` (kept out of the step times)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.totals[kind] += elapsed
            self.counts[kind] += 1
            self.extra_s += elapsed

    def seconds_per_step(self) -> float | None:
        smoothed = self.step_s.value
        return self.warmup_s if smoothed is None else smoothed

    def mean(self, kind: Timed) -> float | None:
        return self.totals[kind] / self.counts[kind] if self.counts[kind] else None

    def remaining(self, step: int) -> float | None:
        """Seconds left after ``step`` (None until a step is timed); a save not measured yet
        counts 0."""
        step_s = self.seconds_per_step()
        if step_s is None:
            return None
        validation_s = self.mean("validation")
        if validation_s is None:
            validation_s = self.validation_steps * step_s
        return remaining_seconds(step, self.schedule, step_s, validation_s, self.mean("save") or 0)


def estimate_line(clock: RunClock, step: int, elapsed_s: float) -> str:
    """The one line printed once the first steps are timed: the time per step, and the
    session's expected length (``elapsed_s`` so far plus what remains after ``step``)."""
    total = elapsed_s + (clock.remaining(step) or 0.0)
    return (
        f"impasto: ~{clock.seconds_per_step():.3g} s/step; estimated total "
        f"{format_duration(total)} (incl. validation and checkpoints)"
    )


def step_line(
    step: int,
    total: int,
    values: dict[str, float],
    smoothed: float | None,
    remaining_s: float | None,
) -> str:
    """The line a logging step prints without a progress bar::

        impasto: step 250/3000 loss 0.1234 avg 0.1301 lr 1.90e-03 grad 0.41 41.2 img/s
        data 2% MFU 38.1% mem 21.3 GiB eta 0:10:02

    (on one line; the parts a step lacks are left out)."""
    parts = [f"impasto: step {step}/{total}", f"loss {values['loss']:.4f}"]
    if smoothed is not None:
        parts.append(f"avg {smoothed:.4f}")
    parts.append(f"lr {values['lr']:.2e}")
    optional = (
        ("grad_norm", "grad {:.3g}"),
        ("samples_per_s", "{:.3g} img/s"),
        ("data_wait", "data {:.0%}"),
        ("mfu", "MFU {:.1%}"),
        ("peak_memory_gib", "mem {:.3g} GiB"),
    )
    parts += [form.format(values[key]) for key, form in optional if key in values]
    if remaining_s is not None:
        parts.append(f"eta {format_duration(remaining_s)}")
    return " ".join(parts)


class RunProgress:
    """What a run shows while it trains: the tqdm bar (``bar``: rank 0 with
    ``log.progress_bar``) with the raw and smoothed loss of the last logging step, the LR and
    an ETA from :class:`RunClock` in place of tqdm's own (which averages step intervals only);
    and (``main``) one line with the estimated length once the first steps are timed.

    ``log_every``: steps between logged losses; the loss smoother's weight per logged value is
    ``STEP_SMOOTHING ** log_every``, so it averages about the same number of steps whatever
    the logging interval."""

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"

    def __init__(
        self, clock: RunClock, initial: int, main: bool, bar: bool, log_every: int
    ) -> None:
        total = clock.schedule.total_steps
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        bar_format=self.BAR_FORMAT, disable=not (main and bar))  # fmt: skip
        self.clock, self.main = clock, main
        self.loss = Smoother(STEP_SMOOTHING**log_every)
        self.postfix: dict[str, str] = {}
        self.started = time.perf_counter()
        # The estimate waits for TIMED_STEPS_FOR_ESTIMATE steps after the warm-up one.
        self.estimate_after = max(1, min(TIMED_STEPS_FOR_ESTIMATE + 1, total - initial - 1))

    def timing(self, kind: Timed) -> AbstractContextManager[None]:
        """Time a ``validation`` or a ``save`` (:meth:`RunClock.timing`)."""
        return self.clock.timing(kind)

    def start_step(self, step: int) -> None:
        """Step ``step + 1`` starts (``step`` are done)."""
        self.clock.start_step()
        if self.main and self.clock.num_timed == self.estimate_after:  # once
            elapsed = time.perf_counter() - self.started
            self.write(estimate_line(self.clock, step, elapsed))

    def log(self, step: int, values: dict[str, float]) -> None:
        """A logging step's host values: the loss (raw and smoothed) and the LR in the bar;
        without a bar (``log.progress_bar: false``: batch jobs, log files), one line
        (:func:`step_line`)."""
        smoothed = self.loss.update(values["loss"])
        self.postfix["loss"] = f"{values['loss']:.4f}"
        if smoothed is not None:
            self.postfix["avg"] = f"{smoothed:.4f}"
        self.postfix["lr"] = f"{values['lr']:.2e}"
        if self.main and self.bar.disable:
            remaining = self.clock.remaining(step)
            print(step_line(step, self.clock.schedule.total_steps, values, smoothed, remaining))

    def advance(self, step: int) -> None:
        """Step ``step`` is done, with its validation and save."""
        remaining = self.clock.remaining(step)
        if remaining is not None:
            self.postfix["eta"] = format_duration(remaining)
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar (the caller is rank 0)."""
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
