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
visible GPU (or ``nproc`` CPU processes on gloo): see :func:`run_parallel_bench`.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from torch.utils.flop_counter import FlopCounterMode

from impasto.config import Config, build_config
from impasto.config.load import apply_override
from impasto.data import Batch
from impasto.distributed import RunGroup, run_group
from impasto.models import add_time_ids
from impasto.models.backbone import build_backbone
from impasto.precision import autocast_factory, resolve_device, resolve_precision
from impasto.train.checks import check_config
from impasto.train.methods import WHOLE_STEP, Rows
from impasto.train.optim import set_lr
from impasto.train.setup import build_step_setup

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "checkpointing": {"memory.gradient_checkpointing": "all"},
    "fused": {"memory.fused_backward": True, "optim.max_grad_norm": None},
    "pure_bf16": {"train.mixed_precision": "pure_bf16", "optim.name": "adamw_bf16_sr"},
    "low_memory": {
        "train.mixed_precision": "pure_bf16",
        "optim.name": "adamw_bf16_sr",
        "memory.fused_backward": True,
        "optim.max_grad_norm": None,
        "memory.gradient_checkpointing": "all",
    },
    "adafactor": {
        "optim.name": "adafactor",
        "memory.fused_backward": True,
        "optim.max_grad_norm": None,
        "memory.gradient_checkpointing": "all",
    },
    "channels_last": {"memory.channels_last": True},
    "compile": {"memory.compile": "blocks"},
    "lora": {"parts.unet": "lora"},
    "offload": {"memory.offload_blocks": True},
}
"""Named sets of config overrides: what ``--variants`` can ask for."""

DEFAULT_RESOLUTION = {"tiny": 64, "demo": 64, "sdxl": 1024}

PARALLEL_STRATEGIES = ("ddp", "fsdp")
"""What ``--parallel`` can ask for (``none``, the default, is the one-process bench)."""


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, for the GPUs we know (None elsewhere)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "H100" in name or "H200" in name or "H800" in name:
        return 756.0 if "PCIe" in name else 989.4  # SXM: 989.4 dense (1979 with sparsity)
    if "A100" in name:
        return 312.0
    return None


@dataclass(frozen=True)
class BenchRow:
    name: str
    step_ms: float
    images_per_s: float
    tflops: float | None
    mfu: float | None
    peak_memory_gib: float | None
    vs_diffusers: float


def bench_config(
    model: str,
    resolution: int,
    batch: int,
    precision: str,
    device: str,
    overrides: Sequence[str] = (),
    variant: dict[str, Any] | None = None,
) -> Config:
    """The config of one variant: the model preset, a synthetic batch's size, the overrides."""
    raw: dict[str, Any] = {
        "model": {"preset": model},
        "data": {"path": "synthetic", "resolution": resolution, "batch_size": batch},
        "optim": {"lr": 1e-5},
        "train": {"max_steps": 1, "mixed_precision": precision, "device": device},
        "log": {"tensorboard": False, "progress_bar": False},
    }
    for key, value in (variant or {}).items():
        apply_override(raw, f"{key}={json.dumps(value)}")
    for assignment in overrides:
        apply_override(raw, assignment)
    return build_config(raw)


def synthetic_batch(unet_config, batch: int, resolution: int, seed: int = 0) -> Batch:
    """A batch as the cache delivers it: latents' posterior and text embeddings, random."""
    generator = torch.Generator().manual_seed(seed)
    side, channels = resolution // 8, unet_config.in_channels
    pooled = (
        unet_config.projection_class_embeddings_input_dim - 6 * unet_config.addition_time_embed_dim
    )
    sizes = torch.tensor([[resolution, resolution]] * batch)
    return Batch(
        pixel_values=None,
        captions=[""] * batch,
        original_sizes=sizes,
        crop_top_lefts=torch.zeros(batch, 2, dtype=torch.long),
        target_sizes=sizes,
        indices=torch.arange(batch),
        latent_mean=torch.randn(batch, channels, side, side, generator=generator),
        latent_std=torch.full((batch, channels, side, side), 0.01),
        prompt_embeds=torch.randn(batch, 77, unet_config.cross_attention_dim, generator=generator),
        pooled_prompt_embeds=torch.randn(batch, pooled, generator=generator),
    )


class DiffusersStep:
    """The plain diffusers training step on a fresh UNet."""

    def __init__(self, config: Config, device: torch.device) -> None:
        self.device = device
        self.unet = build_backbone(config).denoiser().to(device).train()
        self.optimizer = torch.optim.AdamW(self.unet.parameters(), lr=config.optim.lr)
        self.scheduler = DDPMScheduler(
            beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012
        )
        precision = resolve_precision(config.train.mixed_precision, device)
        self.autocast = autocast_factory(device, precision)

    def prepare(self, batch: Batch) -> None:
        device = self.device
        self.latents = batch.latent_mean.to(device)
        self.embeds = batch.prompt_embeds.to(device)
        time_ids = add_time_ids(
            batch.original_sizes, batch.crop_top_lefts, batch.target_sizes, dtype=torch.float32
        )
        self.added = {
            "text_embeds": batch.pooled_prompt_embeds.to(device),
            "time_ids": time_ids.to(device),
        }

    def forward_backward(self) -> None:
        noise = torch.randn_like(self.latents)
        timesteps = torch.randint(0, 1000, (self.latents.shape[0],), device=self.device)
        noisy = self.scheduler.add_noise(self.latents, noise, timesteps)
        with self.autocast():
            prediction = self.unet(noisy, timesteps, self.embeds, added_cond_kwargs=self.added)
        F.mse_loss(prediction.sample.float(), noise.float()).backward()

    def __call__(self) -> None:
        self.forward_backward()
        torch.nn.utils.clip_grad_norm_(self.unet.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class ImpastoStep:
    """The trainer's step (its setup, micro-step, update and EMA) on a fresh model; with a
    ``group``, this rank's part of a parallel step (its rows of the global batch, as the
    trainer draws them)."""

    def __init__(self, config: Config, device: torch.device, group: RunGroup | None = None) -> None:
        precision = resolve_precision(config.train.mixed_precision, device)
        self.setup = build_step_setup(config, device, precision, group)
        self.max_grad_norm = config.optim.max_grad_norm
        self.rows = WHOLE_STEP
        if group is not None and group.world > 1:
            self.rows = Rows(group.rank, group.world, config.data.batch_size)
        backbone = self.setup.backbone
        self.unet = backbone.denoiser()
        self.number = 0
        # Latents and text come with the batch: free the memory of the untrained encoders.
        for name, module in backbone.modules().items():
            if name not in self.setup.trainable and module is not self.unet:
                module.to("cpu")

    def prepare(self, batch: Batch) -> None:
        self.batch = batch

    def __call__(self) -> None:
        setup = self.setup
        set_lr(setup.optimizer, 1.0)
        setup.micro_step(self.batch, torch.Generator().manual_seed(self.number), rows=self.rows)
        setup.update(self.max_grad_norm)
        self.number += 1
        if setup.ema is not None:
            setup.ema.update(self.number)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    step: Callable[[], None], device: torch.device, warmup: int, steps: int
) -> tuple[float, float | None]:
    """(seconds per step, peak memory GiB or None on CPU) after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


def time_each_step(
    step: Callable[[], None], device: torch.device, warmup: int, steps: int
) -> tuple[list[float], float | None]:
    """(seconds of each step, peak memory GiB or None on CPU) after ``warmup`` untimed steps.

    Each step ends with a device sync, so one step's time is its own (a little less overlap
    than :func:`time_steps`, which syncs once): the parallel bench needs the spread per step
    and the step time of the slowest rank, step by step."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


def count_flops(step: DiffusersStep) -> int:
    """FLOPs of one forward + backward of the plain step (counted, not timed)."""
    with FlopCounterMode(display=False) as counter:
        step.forward_backward()
    step.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_bench(
    model: str = "tiny",
    resolution: int | None = None,
    batch: int = 2,
    steps: int = 10,
    warmup: int = 3,
    rounds: int = 1,
    precision: str = "auto",
    variants: Sequence[str] = ("default",),
    device: str = "auto",
    overrides: Sequence[str] = (),
    parallel: str = "none",
    nproc: int | None = None,
) -> dict[str, Any] | None:
    """Time the diffusers step and each variant; returns a JSON-able report. With ``parallel``
    (ddp, fsdp): :func:`run_parallel_bench` (its report; None on the ranks other than 0)."""
    if parallel not in ("none", *PARALLEL_STRATEGIES):
        raise ValueError(
            f"bench: unknown --parallel {parallel!r}; valid: {', '.join(PARALLEL_STRATEGIES)} "
            "(or leave it out for one process)"
        )
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise ValueError(f"bench: unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    resolution = resolution or DEFAULT_RESOLUTION.get(model, 1024)
    base = bench_config(model, resolution, batch, precision, device, overrides)
    check_config(base)  # the user's --model and --set names; the variants' are impasto's own
    if base.parallel.strategy != "none":
        raise ValueError(
            f"bench: parallel.strategy {base.parallel.strategy} is set with --set; choose the "
            "strategy with --parallel ddp|fsdp instead (it also starts the processes)"
        )
    if parallel != "none":
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
    flops, data = None, None
    for _ in range(rounds):
        for name, config in configs.items():
            step = (DiffusersStep if name == "diffusers" else ImpastoStep)(config, target)
            if data is None:
                data = synthetic_batch(step.unet.config, batch, resolution)
            step.prepare(data)
            if flops is None:
                flops = count_flops(step)
            seconds, peaks[name] = time_steps(step, target, warmup, steps)
            times[name].append(seconds)
            del step
            _free(target)
    peak_flops = peak_tflops(target)
    baseline = statistics.median(times["diffusers"])
    rows = []
    for name, measured in times.items():
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


def _show(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(report: dict[str, Any]) -> str:
    """The report as a table."""
    if "strategy" in report:
        return format_parallel_report(report)
    show = _show

    lines = [
        f"impasto bench: {report['model']} at {report['resolution']}², batch {report['batch']}, "
        f"{report['precision']}, {report['device']}; {report['tflop_per_image']:.3g} TFLOP per "
        f"image (forward + backward); median of {report['rounds']} round(s) of "
        f"{report['steps']} steps",
        f"{'variant':<14} {'step ms':>9} {'img/s':>8} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'peak GiB':>9} {'vs diffusers':>13}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['name']:<14} {row['step_ms']:>9.1f} {row['images_per_s']:>8.2f} "
            f"{show(row['tflops'], '.1f'):>8} {show(row['mfu'], '.1%'):>6} "
            f"{show(row['peak_memory_gib'], '.2f'):>9} {row['vs_diffusers']:>13.3f}"
        )
    return "\n".join(lines)


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
    with run_group(
        request.strategy, request.device, parallel.timeout_s, parallel.shard_size
    ) as group:
        device = group.device
        if device.type == "cpu" and group.world > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # as torchrun does: ranks share the cores, 1 thread each
        batch = request.batch
        baseline: dict[str, list[float]] = {name: [] for name in request.variants}
        timed: dict[str, list[float]] = {name: [] for name in request.variants}
        base_peaks: dict[str, float | None] = {}
        peaks: dict[str, list[float | None]] = {}
        data = None
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
                    _free(device)
                group.barrier()
                step = ImpastoStep(request.config(name, request.strategy), device, group)
                data = data or synthetic_batch(step.unet.config, batch, request.resolution)
                step.prepare(data)
                seconds, peak = time_each_step(step, device, request.warmup, request.steps)
                del step
                _free(device)
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
            f"{_show(row['baseline_peak_memory_gib'], '.2f')}",
            f"{row['name']:<14} {f'{strategy} ×{world}':<9} {row['step_ms']:>9.1f} "
            f"{row['min_ms']:>9.1f} {row['max_ms']:>9.1f} {row['samples_per_s']:>10.2f} "
            f"{row['speedup']:>8.3f} {row['efficiency']:>10.1%}  "
            f"{'n/a' if peaks is None else ' '.join(f'{peak:.2f}' for peak in peaks)}",
        ]
    return "\n".join(lines)
