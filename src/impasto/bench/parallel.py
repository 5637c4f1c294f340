"""``impasto bench --parallel ddp|fsdp``: the trainer's step on several processes (one per
visible GPU, or ``--nproc`` CPU processes on gloo), against one process in the same run."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from impasto.bench.step import (
    VARIANTS,
    ImpastoStep,
    bench_config,
    free_memory,
    show_value,
    sync_device,
    synthetic_batch,
)
from impasto.config import Config
from impasto.distributed import run_group
from impasto.models.presets import reusing_preset_builds
from impasto.precision import resolve_device


def time_each_step(
    step: Callable[[], None], device: torch.device, warmup: int, steps: int
) -> tuple[list[float], float | None]:
    """(seconds of each step, peak memory GiB or None on CPU) after ``warmup`` untimed steps.

    Each step ends with a device sync, so one step's time is its own (a little less overlap
    than :func:`impasto.bench.time_steps`, which syncs once): the parallel bench needs the
    spread per step and the step time of the slowest rank, step by step."""
    for _ in range(warmup):
        step()
    sync_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync_device(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


@dataclass(frozen=True)
class ParallelRequest:
    """What every rank of a parallel bench needs: plain values, so it pickles into the workers
    :func:`launch_ranks` spawns (each builds its own configs from them)."""

    strategy: str
    model: str
    resolution: int
    batch: int  # per rank
    steps: int
    warmup: int
    rounds: int
    precision: str
    device: str
    overrides: tuple[str, ...] = ()
    variants: tuple[str, ...] = ("default",)

    def config(self, variant: str, strategy: str) -> Config:
        """``variant``'s config under ``strategy`` (none: the one-process baseline)."""
        updates = VARIANTS[variant] | {"parallel.strategy": strategy}
        return bench_config(
            self.model, self.resolution, self.batch, self.precision, self.device,
            self.overrides, updates,
        )  # fmt: skip


@dataclass(frozen=True)
class ParallelRow:
    """One variant: the one-process baseline and the parallel run, medians and spreads over
    the timed steps; ``speedup`` = parallel / baseline samples/s, ``efficiency`` = speedup /
    world."""

    name: str
    baseline_step_ms: float
    baseline_min_ms: float
    baseline_max_ms: float
    baseline_samples_per_s: float
    baseline_peak_memory_gib: float | None
    step_ms: float
    min_ms: float
    max_ms: float
    samples_per_s: float  # global: batch × world per step
    peak_memory_gib: list[float] | None  # per rank, CUDA only
    speedup: float
    efficiency: float


def run_parallel_bench(request: ParallelRequest, nproc: int | None = None) -> dict[str, Any] | None:
    """Time the trainer's step under ``request.strategy`` against the same step in one process.

    Under ``torchrun`` (``WORLD_SIZE`` set) this process is one rank of the job; otherwise it
    launches ``nproc`` ranks on this machine with torch's elastic launcher (the engine of
    ``torchrun --standalone``): one per visible GPU, or 2 CPU processes on gloo. Every rank
    times every step; a step's time is the slowest rank's, and the report counts global
    samples (batch × world per step).

    The baseline is the same config with ``parallel.strategy: none``, timed by rank 0 alone
    while the others wait at a barrier: same process, device and thread count as rank 0 of
    the parallel run, but no collectives (DDP and FSDP cannot run on one rank of several).
    Baseline and parallel run are timed one after the other, not interleaved step by step
    (they need different process groups' worth of state and a fresh model each), so drift
    between them is not evened out: the report gives the median and the min-max spread of each
    over its timed steps (pooled over ``rounds``), to judge the ratio against."""
    for variant in request.variants:  # one-line config errors here, not from inside a worker
        request.config(variant, request.strategy)
        request.config(variant, "none")
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            raise ValueError(
                f"bench: --nproc {nproc} but torchrun started {world} processes; leave --nproc "
                "out under torchrun (its --nproc-per-node sets the world)"
            )
        return bench_rank(request)
    return launch_ranks(request, nproc)


def launch_ranks(request: ParallelRequest, nproc: int | None) -> dict[str, Any]:
    """Start ``nproc`` ranks of :func:`bench_rank` on this machine and return rank 0's report."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    device = resolve_device(request.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and device.index is not None:
        raise ValueError(
            f"bench: --parallel runs one process per GPU, but --device {request.device} names "
            "one; use --device cuda (or auto) and CUDA_VISIBLE_DEVICES to pick the GPUs"
        )
    if nproc is None:
        nproc = gpus or 2
    if nproc < 1:
        raise ValueError(f"bench: --nproc {nproc}; use 1 or more processes")
    if gpus and nproc > gpus:
        raise ValueError(
            f"bench: --nproc {nproc} but {gpus} GPU(s) are visible; use at most {gpus} (one "
            "process per GPU)"
        )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # torchrun --standalone: a free port, this machine only
        run_id=f"impasto-bench-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
    )
    return elastic_launch(config, bench_rank)(request)[0]


def bench_rank(request: ParallelRequest) -> dict[str, Any] | None:
    """One rank of the parallel bench (a launched worker, or a process of a torchrun job);
    returns the report on rank 0, None on the others."""
    parallel = request.config(request.variants[0], request.strategy).parallel
    with run_group(parallel, request.device) as group:  # parallel.strategy: request.strategy
        device = group.device
        if device.type == "cpu" and group.world > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # as torchrun does: ranks share the cores, 1 thread each
        batch = request.batch
        baseline: dict[str, list[float]] = {name: [] for name in request.variants}
        timed: dict[str, list[float]] = {name: [] for name in request.variants}
        base_peaks: dict[str, float | None] = {}
        peaks: dict[str, list[float | None]] = {}
        data = None
        # One process: build the random model once (several would each hold a copy in RAM).
        reuse = reusing_preset_builds() if group.world == 1 else contextlib.nullcontext()
        with reuse:
            for _ in range(request.rounds):
                for name in request.variants:
                    if group.is_main:
                        step = ImpastoStep(request.config(name, "none"), device)
                        data = data or synthetic_batch(step.unet.config, batch, request.resolution)
                        step.prepare(data)
                        seconds, base_peaks[name] = time_each_step(
                            step, device, request.warmup, request.steps
                        )
                        baseline[name] += seconds
                        del step
                        free_memory(device)
                    group.barrier()
                    step = ImpastoStep(request.config(name, request.strategy), device, group)
                    data = data or synthetic_batch(step.unet.config, batch, request.resolution)
                    step.prepare(data)
                    seconds, peak = time_each_step(step, device, request.warmup, request.steps)
                    del step
                    free_memory(device)
                    every_rank = group.gather((seconds, peak))
                    per_rank = [times for times, _ in every_rank]
                    timed[name] += [max(times) for times in zip(*per_rank, strict=True)]
                    peaks[name] = [p for _, p in every_rank]
        if not group.is_main:
            return None
        rows = [
            parallel_row(
                name, baseline[name], timed[name], batch, group.world, base_peaks[name], peaks[name]
            )
            for name in request.variants
        ]
        return {
            "model": request.model,
            "resolution": request.resolution,
            "batch": request.batch,
            "precision": request.precision,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "strategy": request.strategy,
            "world": group.world,
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "steps": request.steps,
            "rounds": request.rounds,
            "rows": [asdict(row) for row in rows],
        }


def parallel_row(
    name: str,
    baseline: list[float],
    timed: list[float],
    batch: int,
    world: int,
    base_peak: float | None,
    peaks: list[float | None],
) -> ParallelRow:
    """A variant's row from its per-step seconds (baseline on one process; parallel: the
    slowest rank's, step by step)."""
    base, step = statistics.median(baseline), statistics.median(timed)
    base_rate, rate = batch / base, batch * world / step
    return ParallelRow(
        name=name,
        baseline_step_ms=base * 1e3,
        baseline_min_ms=min(baseline) * 1e3,
        baseline_max_ms=max(baseline) * 1e3,
        baseline_samples_per_s=base_rate,
        baseline_peak_memory_gib=base_peak,
        step_ms=step * 1e3,
        min_ms=min(timed) * 1e3,
        max_ms=max(timed) * 1e3,
        samples_per_s=rate,
        peak_memory_gib=None if None in peaks else peaks,
        speedup=rate / base_rate,
        efficiency=rate / base_rate / world,
    )


def format_parallel_report(report: dict[str, Any]) -> str:
    """The parallel report as a table: per variant, the baseline's row and the parallel run's."""
    world, strategy = report["world"], report["strategy"]
    threads = f", {report['threads']} thread(s) per process" if report["threads"] else ""
    lines = [
        f"impasto bench: {report['model']} at {report['resolution']}², batch {report['batch']} "
        f"per rank, {report['precision']}, {report['device']}; strategy {strategy}, world "
        f"{world}{threads}; median and min-max of {report['rounds']} round(s) of "
        f"{report['steps']} steps",
        "baseline: the same step in one process (strategy none), timed on rank 0 just before "
        "the parallel run (not interleaved)",
        f"{'variant':<14} {'run':<9} {'step ms':>9} {'min ms':>9} {'max ms':>9} "
        f"{'samples/s':>10} {'speedup':>8} {'efficiency':>10}  peak GiB per rank",
    ]
    for row in report["rows"]:
        peaks = row["peak_memory_gib"]
        lines += [
            f"{row['name']:<14} {'none ×1':<9} {row['baseline_step_ms']:>9.1f} "
            f"{row['baseline_min_ms']:>9.1f} {row['baseline_max_ms']:>9.1f} "
            f"{row['baseline_samples_per_s']:>10.2f} {1:>8.3f} {1:>10.1%}  "
            f"{show_value(row['baseline_peak_memory_gib'], '.2f')}",
            f"{row['name']:<14} {f'{strategy} ×{world}':<9} {row['step_ms']:>9.1f} "
            f"{row['min_ms']:>9.1f} {row['max_ms']:>9.1f} {row['samples_per_s']:>10.2f} "
            f"{row['speedup']:>8.3f} {row['efficiency']:>10.1%}  "
            f"{'n/a' if peaks is None else ' '.join(f'{peak:.2f}' for peak in peaks)}",
        ]
    return "\n".join(lines)
