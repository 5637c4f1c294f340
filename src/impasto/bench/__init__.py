"""``impasto bench``: the training step's speed and memory against the plain diffusers step.

Both steps train the same randomly initialised model on the same synthetic batch (latents and
text embeddings as a cache provides them, so no VAE or text encoder runs), in the same process:

- ``diffusers``: what the diffusers SDXL training script does per step: DDPM noising, UNet
  forward (under bf16 autocast when the precision asks for it), MSE against the noise,
  backward, gradient clipping at 1, ``torch.optim.AdamW`` step, ``zero_grad``;
- each impasto variant: the trainer's own step (:class:`~impasto.train.setup.StepSetup`:
  objective, timestep sampling, loss, optimizer, memory options) with config overrides.

FLOPs of one forward + backward are counted once with ``torch.utils.flop_counter``; TFLOP/s and
MFU (against the device's dense bf16 peak) follow from the step time. On a CPU only the ratios
mean something. Each variant builds a fresh model (same seed) and frees it before the next;
``rounds`` repeats the whole sequence and reports the median, which evens out drift.

``parallel`` (``ddp``, ``fsdp``) times the trainer's step on several processes instead, one per
visible GPU (or ``nproc`` CPU processes on gloo): see :mod:`impasto.bench.parallel`.

A model of another family, named ``FAMILY-PRESET``, has no diffusers baseline: its step is
timed packed against padded, per image token (:mod:`impasto.bench.packed`); ``estimate``
counts its FLOPs and memory on the meta device without timing. A family's video models
(``FAMILY-NAME``, its ``clip_bench``) are timed alike on clips (``frames``: their frame counts).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from impasto.bench.diffusers_step import DiffusersStep, count_flops
from impasto.bench.packed import family_preset, model_names, run_packed_bench
from impasto.bench.report import check_report_file, format_report
from impasto.bench.step import (
    VARIANTS,
    ImpastoStep,
    bench_config,
    free_memory,
    synthetic_batch,
    time_steps,
)
from impasto.logging.flops import peak_tflops
from impasto.models.presets import reusing_preset_builds
from impasto.precision import resolve_device
from impasto.train.checks import check_config

DEFAULT_RESOLUTION = {"tiny": 64, "demo": 64, "sdxl": 1024}

PARALLEL_STRATEGIES = ("ddp", "fsdp")
"""What ``--parallel`` can ask for (``none``, the default, is the one-process bench)."""


@dataclass(frozen=True)
class BenchRow:
    name: str
    step_ms: float | None  # None: the variant did not run (``error`` says why)
    images_per_s: float | None
    tflops: float | None
    mfu: float | None
    peak_memory_gib: float | None
    vs_diffusers: float | None
    error: str | None = None
    rounds_ms: list[float] | None = None  # each round's step time (the spread of the median)


def run_bench(
    model: str = "tiny",
    resolution: int | None = None,
    batch: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    rounds: int | None = None,
    precision: str = "auto",
    variants: Sequence[str] = ("default",),
    device: str = "auto",
    overrides: Sequence[str] = (),
    parallel: str = "none",
    nproc: int | None = None,
    estimate: bool = False,
    frames: Sequence[int] | None = None,
) -> dict[str, Any] | None:
    """Time the diffusers step and each variant; returns a JSON-able report. With ``parallel``
    (ddp, fsdp): :func:`run_parallel_bench` (its report; None on the ranks other than 0). A
    ``FAMILY-PRESET`` model: :func:`~impasto.bench.packed.run_packed_bench` (left-out
    ``batch``, ``steps``, ``warmup`` and ``rounds`` take its defaults; ``frames``: a video
    model's clips, one shape per frame count)."""
    if parallel not in ("none", *PARALLEL_STRATEGIES):
        raise ValueError(
            f"bench: unknown --parallel {parallel!r}; valid: {', '.join(PARALLEL_STRATEGIES)} "
            "(or leave it out for one process)"
        )
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise ValueError(f"bench: unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    if model not in model_names():
        raise ValueError(f"bench: unknown --model {model!r}; valid: {', '.join(model_names())}")
    named = family_preset(model)
    if named is not None:
        if parallel != "none":
            raise ValueError(f"bench: --parallel is not built for {model} yet; leave it out")
        given = {"steps": steps, "warmup": warmup, "rounds": rounds}
        return run_packed_bench(
            *named, resolution, batch, precision=precision, variants=tuple(variants),
            device=device, overrides=tuple(overrides), estimate=estimate,
            frames=None if frames is None else tuple(frames),
            **{key: value for key, value in given.items() if value is not None},
        )  # fmt: skip
    if estimate:
        raise ValueError(f"bench: --estimate is for FAMILY-PRESET models, not {model}")
    if frames is not None:
        raise ValueError(f"bench: --frames is for the video models, not {model}; leave it out")
    batch, steps = batch or 2, steps or 10
    warmup, rounds = 3 if warmup is None else warmup, rounds or 1
    resolution = resolution or DEFAULT_RESOLUTION.get(model, 1024)
    base = bench_config(model, resolution, batch, precision, device, overrides)
    check_config(base)  # the user's --model and --set names; the variants' are impasto's own
    if base.parallel.strategy != "none":
        raise ValueError(
            f"bench: parallel.strategy {base.parallel.strategy} is set with --set; choose the "
            "strategy with --parallel ddp|fsdp instead (it also starts the processes)"
        )
    if parallel != "none":
        from impasto.bench.parallel import ParallelRequest, run_parallel_bench

        request = ParallelRequest(
            parallel, model, resolution, batch, steps, warmup, rounds, precision, device,
            tuple(overrides), tuple(variants),
        )  # fmt: skip
        return run_parallel_bench(request, nproc)
    target = resolve_device(base.train.device)
    configs = {"diffusers": base} | {
        name: bench_config(model, resolution, batch, precision, device, overrides, VARIANTS[name])
        for name in variants
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    peaks: dict[str, float | None] = {}
    out_of_memory: set[str] = set()  # variants that did not fit: reported, not retried
    flops, data = None, None
    with reusing_preset_builds():  # one random model, copied for every variant and round
        for _ in range(rounds):
            for name, config in configs.items():
                if name in out_of_memory:
                    continue
                try:
                    step = (DiffusersStep if name == "diffusers" else ImpastoStep)(config, target)
                    if data is None:
                        data = synthetic_batch(step.unet.config, batch, resolution)
                    step.prepare(data)
                    if flops is None:
                        flops = count_flops(step)
                    seconds, peaks[name] = time_steps(step, target, warmup, steps)
                    times[name].append(seconds)
                except torch.OutOfMemoryError:
                    if name == "diffusers":  # no baseline, no ratios
                        raise ValueError(
                            f"bench: the plain diffusers step does not fit at batch {batch} and "
                            f"{resolution}² on {target}; lower --batch or --resolution"
                        ) from None
                    out_of_memory.add(name)
                step = None  # drop the model (also after an error) before the next one is built
                free_memory(target)
    peak_flops = peak_tflops(target)
    baseline = statistics.median(times["diffusers"])
    rows = []
    for name, measured in times.items():
        if name in out_of_memory:
            rows.append(BenchRow(name, None, None, None, None, None, None, "out of memory"))
            continue
        seconds = statistics.median(measured)
        tflops = flops / seconds / 1e12 if target.type == "cuda" else None
        rows.append(
            BenchRow(
                name=name,
                step_ms=seconds * 1e3,
                images_per_s=batch / seconds,
                tflops=tflops,
                mfu=None if tflops is None or peak_flops is None else tflops / peak_flops,
                peak_memory_gib=peaks[name],
                vs_diffusers=baseline / seconds,
                rounds_ms=[value * 1e3 for value in measured],
            )
        )
    return {
        "model": model,
        "resolution": resolution,
        "batch": batch,
        "precision": precision,
        "device": torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu",
        "steps": steps,
        "rounds": rounds,
        "tflop_per_step": flops / 1e12,
        "tflop_per_image": flops / 1e12 / batch,
        "rows": [asdict(row) for row in rows],
    }


__all__ = [
    "DEFAULT_RESOLUTION",
    "PARALLEL_STRATEGIES",
    "BenchRow",
    "DiffusersStep",
    "check_report_file",
    "count_flops",
    "format_report",
    "run_bench",
    "run_packed_bench",
    "time_steps",
]
