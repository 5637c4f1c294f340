"""A run that explains itself (issue #17): the start-up summary, built as data (lines of text)
from the config, what was built and the data; the facts behind ``dataset.json``; and the
cost of a validation in training steps, for the ETA before the first one is timed.

Everything here reads host values only (parameter counts, record lists): no tensor is read,
so nothing syncs with the device or draws a random number.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from impasto.config import Config
from impasto.data.census import data_groups, dataset_json, tag_frequency, training_records
from impasto.data.pipeline import RunData
from impasto.logging.progress import STEP_SMOOTHING, RunClock, Schedule
from impasto.models.parts import Part
from impasto.train.state import TrainState
from impasto.train.validation import validation_prompts


@dataclass(frozen=True)
class DatasetFacts:
    """What ``dataset.json`` says besides the epoch: counted once at start-up."""

    num_images: int  # training examples per epoch, repeats counted
    steps_per_epoch: int
    tag_frequency: dict[str, dict[str, int]]

    def json(self, epoch: int) -> str:
        """``dataset.json`` of a checkpoint taken after ``epoch`` completed epochs."""
        return dataset_json(self.num_images, self.steps_per_epoch, epoch, self.tag_frequency)


def steps_per_epoch(config: Config, data: RunData, world: int) -> int:
    """Optimizer steps in an epoch: its batches over ``grad_accum_steps`` × ranks, rounded up
    (the step that crosses an epoch's end takes its last batches from the next)."""
    return math.ceil(data.batches_per_epoch / (config.train.grad_accum_steps * world))


def dataset_facts(config: Config, data: RunData, world: int) -> DatasetFacts:
    records = training_records(data.records, data.bucket_of)
    frequency = tag_frequency(records, data.groups, config.data.tag_separator)
    return DatasetFacts(len(records), steps_per_epoch(config, data, world), frequency)


def validation_cost(config: Config) -> float:
    """A validation's cost in training steps, before one is timed: each sampler step is one
    forward of the denoiser per image (two with classifier-free guidance), a training step
    three per image (forward and backward) for ``batch_size × grad_accum_steps`` images; both
    scale with the pixels. A rough guide, replaced by the measured time after the first."""
    sample = config.sample
    if sample.every_steps == 0:
        return 0.0
    images = len(validation_prompts(sample)) * sample.images_per_prompt
    branches = 2 if sample.guidance_scale != 1 else 1
    train_images = config.data.batch_size * config.train.grad_accum_steps
    pixels = ((sample.resolution or config.data.resolution) / config.data.resolution) ** 2
    return images * branches * sample.num_steps * pixels / (3 * train_images)


def run_clock(config: Config, total_steps: int) -> RunClock:
    """The wall-time record behind the progress bar's ETA, on the run's schedule."""
    checkpoint = config.checkpoint
    schedule = Schedule(
        total_steps, config.sample.every_steps, checkpoint.every_steps, checkpoint.save_final
    )
    return RunClock(schedule, validation_cost(config), STEP_SMOOTHING)


def summary_lines(
    config: Config,
    data: RunData,
    trainable: Mapping[str, Part],
    device: torch.device,
    precision: torch.dtype | None,
    world: int,
    step: int = 0,
) -> list[str]:
    """The start-up summary, one string per line (printed once by rank 0); ``step``: where a
    resumed run starts."""
    lines = ["impasto: the run"]
    lines += [f"  {line}" for line in data_lines(config, data)]
    lines += [f"  {line}" for line in schedule_lines(config, data, world)]
    lines.append(f"  trainable   {parameter_text(trainable)}")
    lines += [f"  {line}" for line in setup_lines(config, device, precision)]
    if step:
        lines.append(f"  resumed     at step {step} of {data.total_steps}")
    return lines


def data_lines(config: Config, data: RunData) -> list[str]:
    """Images per group with repeats, what was left out, and the buckets."""
    records = training_records(data.records, data.bucket_of)
    groups = data_groups(records, data.groups)
    distinct = len({str(record.image_path) for record in records})
    noun = "images" if config.data.prompts is None else "prompts"
    lines = [f"data        {distinct} {noun}, {len(records)} examples per epoch (repeats counted)"]
    width = max(len(group.name) for group in groups) if groups else 0
    for group in groups:
        repeats = group.repeats
        times = f"{repeats:g} repeat{'s' if repeats != 1 else ''}"
        lines.append(
            f"  {group.name:<{width}}  {group.num_images} {noun} x {times} = {group.num_examples}"
        )
    unplaced = len(data.records) - len(records)
    left_out = f"unusable    {len(data.scan_skipped)} left out"
    if data.scan_skipped and data.bad_data.path is not None:
        left_out += f" ({data.bad_data.path})"
    if unplaced:
        left_out += f"; {unplaced} examples fit no bucket"
    lines.append(left_out)
    if config.data.validation_split and config.data.prompts is None:
        split = config.data.validation_split
        lines.append(
            f"held out    {len(data.held_out)} images for validation (data.validation_split "
            f"{split:g}), never trained on"
        )
    if config.data.prompts is None:
        lines.append(f"buckets     {bucket_text(config, data)}")
    return lines


def bucket_text(config: Config, data: RunData) -> str:
    """``64x64: 12, 48x80: 4`` (examples per epoch in each bucket, height x width)."""
    if data.bucket_of is None:
        side = config.data.resolution
        return f"none: every image a {side}x{side} square ({config.data.crop} crop)"
    counts = Counter(bucket for bucket in data.bucket_of if bucket is not None)
    by_aspect = sorted(counts.items(), key=lambda item: item[0][0] / item[0][1])
    text = ", ".join(f"{height}x{width}: {count}" for (height, width), count in by_aspect)
    return f"{text} (examples per epoch; buckets.txt)"


def schedule_lines(config: Config, data: RunData, world: int) -> list[str]:
    train = config.train
    per_step = config.data.batch_size * train.grad_accum_steps * world
    per_epoch = steps_per_epoch(config, data, world)
    epochs = data.total_steps * train.grad_accum_steps * world / data.batches_per_epoch
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    every = config.sample.every_steps
    samples = f"samples every {every} steps" if every else "no samples"
    minutes = config.checkpoint.every_minutes
    every_minutes = f" or {minutes:g} minutes" if minutes else ""
    lines = [
        f"batch       {config.data.batch_size} x {train.grad_accum_steps} accumulation x "
        f"{ranks} = {per_step} images per step",
        f"length      {data.total_steps} steps = {epochs:.3g} epochs of {per_epoch} steps",
        f"outputs     {samples}, checkpoints every {config.checkpoint.every_steps} steps"
        f"{every_minutes} (keep {config.checkpoint.keep_last})",
    ]
    if data.eval_sets:
        evaluation = config.eval
        sets = ", ".join(
            f"{held.name or 'the split'} ({len(held.records)} images)" for held in data.eval_sets
        )
        lines.append(
            f"validation  loss every {evaluation.every_steps} steps at {evaluation.timesteps} "
            f"timesteps on {sets}"
        )
    return lines


def parameter_text(trainable: Mapping[str, Part]) -> str:
    """``unet (lora) 12,345; text_encoder (full) 678; total 13,023``: each part's trained
    parameters (an adapter's own, not the frozen weights it adapts)."""
    counts = {name: sum(p.numel() for p in part.parameters()) for name, part in trainable.items()}
    parts = [f"{name} ({trainable[name].mode}) {count:,}" for name, count in counts.items()]
    return "; ".join([*parts, f"total {sum(counts.values()):,}"])


def setup_lines(config: Config, device: torch.device, precision: torch.dtype | None) -> list[str]:
    memory, cache, objective = config.memory, config.cache, config.objective
    compute = "fp32" if precision is None else f"{str(precision).removeprefix('torch.')} autocast"
    if config.train.mixed_precision == "pure_bf16":
        compute = "bf16 weights (pure_bf16)"
    checkpointing = memory.gradient_checkpointing
    if isinstance(checkpointing, list):
        checkpointing = ", ".join(checkpointing)
    offload = f"on ({memory.resident_blocks} resident)" if memory.offload_blocks else "off"
    ema = f"decay {config.ema.decay:g}" if config.ema.enabled else "off"
    sampling = objective.timestep_sampling
    return [
        f"device      {device}, {compute} (train.mixed_precision {config.train.mixed_precision})",
        f"memory      gradient checkpointing {checkpointing}, fused backward "
        f"{'on' if memory.fused_backward else 'off'}, offload {offload}, compile "
        f"{memory.compile}, attention {memory.attention}, EMA {ema}",
        f"cache       latents {cache.latents}, text embeddings {cache.text_embeddings}",
        f"objective   {objective.method}: {objective.prediction_type} prediction, {sampling} "
        f"timesteps, {objective.loss} loss, weighting {objective.loss_weighting}"
        + (", zero terminal SNR" if objective.zero_terminal_snr else ""),
        f"optimizer   {config.optim.name}, lr {config.optim.lr:g} ({config.optim.lr_schedule}, "
        f"{config.optim.warmup_steps} warmup steps)",
    ]


def report(state: TrainState, elapsed: float, interrupted: bool, checkpoint: Path | None) -> None:
    """The end of a run, in a line or three."""
    how = "stopped on request" if interrupted else "finished"
    print(f"impasto: {how} at step {state.step} in {elapsed:.1f} s; checkpoint: {checkpoint}")
    if state.images_bad:
        print(f"impasto: skipped {state.images_bad} unusable images")
    if state.steps_skipped:
        print(f"impasto: skipped {state.steps_skipped} non-finite steps")
