"""The training loop: load or resume, then step, log, checkpoint (torchtitan-style)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from impasto.config import Config
from impasto.config.data import SourceConfig
from impasto.data import (
    Batch,
    ImageRecord,
    build_dataloader,
    derive_seed,
    scan_image_folder,
    training_sampler,
)
from impasto.data.buckets import assign_image_buckets
from impasto.data.cache import CachedEncodings
from impasto.data.captions import tag_frequency_weights
from impasto.data.dataset import Skipped
from impasto.data.demo import write_demo_dataset
from impasto.data.folder import read_manifest
from impasto.data.sources import hf_dataset_records, parquet_records, webdataset_records
from impasto.distributed import process_group, rank_and_world
from impasto.logging import MetricsLogger
from impasto.models import load_model
from impasto.train.disk_cache import CacheReport, fill_cache, identify_images
from impasto.train.optim import lr_multiplier, set_lr
from impasto.train.precision import autocast_factory, resolve_device, resolve_precision
from impasto.train.setup import build_step_setup
from impasto.train.signals import StopRequest
from impasto.train.state import (
    TrainState,
    prepare_run_dir,
    restore_train_checkpoint,
    save_train_checkpoint,
)
from impasto.train.validation import write_validation_grid

MicroBatches = Iterator[tuple[Batch, tuple[int, int]]]


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    state: TrainState
    last_checkpoint: Path | None
    interrupted: bool


def train(config: Config, resume: bool = True) -> TrainResult:
    """Train (or continue training) the run described by ``config``."""
    if rank_and_world()[1] > 1:
        raise ValueError(
            "impasto train runs in one process for now (DDP/FSDP are not built yet); under "
            "torchrun every rank would train its own copy into the same run directory. Use "
            "`torchrun ... -m impasto cache CONFIG` to fill the cache on all GPUs, then train"
        )
    return Trainer(config, resume).run()


class Trainer:
    """One run: built from a config, resumed from its newest checkpoint, then stepped."""

    def __init__(self, config: Config, resume: bool) -> None:
        self.started = time.perf_counter()
        self.config = config
        self.run_dir = prepare_run_dir(config, resume)
        device = resolve_device(config.train.device)
        precision = resolve_precision(config.train.mixed_precision, device)
        torch.manual_seed(config.train.seed)

        self.records, image_ids = load_records(config), None
        if config.cache.on_disk:
            self.records, image_ids = identify_images(config, self.records)
        self.bucket_of = place_in_buckets(config, self.records, self.run_dir)
        self.total_steps = count_total_steps(config, len(self.records), self.bucket_of)
        self.setup = setup = build_step_setup(config, device, precision)
        self.models, self.trainable, self.optimizer = setup.models, setup.trainable, setup.optimizer
        self.ema = setup.ema
        self.encodings = None
        if config.cache.on_disk:
            self.encodings, cache_report = fill_cache(
                config, self.models, self.records, image_ids, self.bucket_of, setup.autocast,
                str(precision),
            )  # fmt: skip
            print(f"impasto: {cache_report.format()}")
        self.bad_data = BadDataLog(self.run_dir / BAD_DATA_FILE)

        self.state, self.last_checkpoint = TrainState(), None
        restored = None
        if resume:
            restored = restore_train_checkpoint(
                self.run_dir, config, self.trainable, self.optimizer, self.ema
            )
        if restored is not None:
            self.state, self.last_checkpoint = restored
            print(f"impasto: resumed from {self.last_checkpoint} (step {self.state.step})")
        self.stream = micro_batches(
            config,
            self.records,
            (self.state.epoch, self.state.batch_in_epoch),
            self.bucket_of,
            record_loss_weights(config, self.records),
            self.encodings,
        )

    def run(self) -> TrainResult:
        config, state = self.config, self.state
        metrics = MetricsLogger(self.run_dir, config.log.jsonl, config.log.tensorboard, state.step)
        progress = tqdm(
            total=self.total_steps,
            initial=state.step,
            unit="step",
            disable=not config.log.progress_bar,
            dynamic_ncols=True,
        )
        interrupted = False
        with StopRequest() as stop:
            while state.step < self.total_steps and not interrupted:
                values = self.step()
                progress.update(1)
                if values is not None:
                    metrics.log(state.step, values)
                    progress.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
                if self.should_sample():
                    with self.sampling_weights():
                        path, grid = write_validation_grid(
                            config, self.models, self.run_dir, state.step
                        )
                    metrics.log_image("samples", grid, state.step)
                    progress.write(f"impasto: samples at step {state.step}: {path}")
                interrupted = stop.requested
                if self.should_save() or interrupted:
                    self.last_checkpoint = save_train_checkpoint(
                        self.run_dir, config, state, self.trainable, self.optimizer, self.ema
                    )
        progress.close()
        metrics.close()
        report(state, time.perf_counter() - self.started, interrupted, self.last_checkpoint)
        if state.images_bad:
            print(f"impasto: the skipped images and why: {self.bad_data.path}")
        return TrainResult(self.run_dir, state, self.last_checkpoint, interrupted)

    def step(self) -> dict[str, float] | None:
        """One optimizer step; returns the metrics on logging steps (the only host syncs)."""
        config, state = self.config, self.state
        step_start = time.perf_counter()
        optim = config.optim
        lr = set_lr(
            self.optimizer,
            lr_multiplier(
                state.step,
                optim.lr_schedule,
                optim.warmup_steps,
                self.total_steps,
                optim.min_lr_ratio,
            ),
        )
        loss, num_samples = self.accumulate_gradients()
        grad_norm = self.apply_gradients()
        state.step += 1
        if self.ema is not None:
            self.ema.update(state.step)
        state.samples_seen += num_samples
        if state.step % config.log.every_steps and state.step != self.total_steps:
            return None
        step_time = time.perf_counter() - step_start
        return {
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time": step_time,
            "samples_per_s": num_samples / step_time,
            "epoch": state.epoch,
            "images_bad": state.images_bad,
        }

    def accumulate_gradients(self) -> tuple[torch.Tensor, int]:
        """Forward and backward ``grad_accum_steps`` micro-batches; returns (mean loss, samples)."""
        config, state = self.config, self.state
        accum = config.train.grad_accum_steps
        # Summed on the device: .item() happens only on logging steps (no per-step host sync).
        total_loss, num_samples = torch.zeros((), device=self.models.unet.device), 0
        for micro in range(accum):
            batch, (state.epoch, state.batch_in_epoch) = next(self.stream)
            state.images_attempted += config.data.batch_size
            state.images_bad += batch.num_bad
            self.bad_data.record(batch.skipped)
            self.check_bad_fraction()
            if batch.size == 0:
                continue
            seed = derive_seed(config.train.seed, 0, state.step, micro)  # (seed, rank, step, micro)
            generator = torch.Generator().manual_seed(seed)
            total_loss += self.setup.micro_step(batch, generator, 1 / accum)
            num_samples += len(batch.captions)
        return total_loss / accum, num_samples

    def apply_gradients(self) -> float:
        """Clip, then step unless the gradient is non-finite (DESIGN §6). Returns the grad norm."""
        state = self.state
        grad_norm, finite = self.setup.update(self.config.optim.max_grad_norm)
        if finite:
            state.nonfinite_in_row = 0
            return grad_norm
        state.nonfinite_in_row += 1
        state.steps_skipped += 1
        how = "zeroed" if self.setup.fused is not None else "step skipped"
        print(f"impasto: step {state.step + 1}: non-finite gradient, {how}")
        if state.nonfinite_in_row >= self.config.train.max_nonfinite_steps:
            raise FloatingPointError(
                f"{state.nonfinite_in_row} non-finite steps in a row; stopping with the last "
                "checkpoint intact (lower optim.lr or check the data)"
            )
        return grad_norm

    def check_bad_fraction(self) -> None:
        """After a full epoch's worth of images, stop if too many were unusable."""
        state, limit = self.state, self.config.data.max_bad_fraction
        fraction = state.images_bad / max(1, state.images_attempted)
        if state.images_attempted >= len(self.records) and fraction > limit:
            raise ValueError(
                f"data: {state.images_bad} of {state.images_attempted} images were unusable "
                f"({fraction:.0%} > data.max_bad_fraction {limit}); see {self.bad_data.path}, "
                "then remove or fix the broken files"
            )

    def sampling_weights(self) -> AbstractContextManager:
        """The weights validation samples use: the EMA's (``ema.sample_with_ema``) or live."""
        if self.ema is not None and self.config.ema.sample_with_ema:
            return self.ema.swapped()
        return contextlib.nullcontext()

    def should_sample(self) -> bool:
        every = self.config.sample.every_steps
        return every > 0 and (self.state.step % every == 0 or self.state.step == self.total_steps)

    def should_save(self) -> bool:
        final = self.state.step == self.total_steps and self.config.checkpoint.save_final
        return final or self.state.step % self.config.checkpoint.every_steps == 0


def load_records(config: Config) -> list[ImageRecord]:
    """Every source's records, each repeated ``repeats`` times with its ``loss_weight``, then
    the images without a caption left out (``data.missing_captions: skip``), counted and named."""
    data = config.data
    if data.generate_demo and not Path(data.path).exists():
        count = write_demo_dataset(
            Path(data.path), data.demo_num_images, data.resolution, seed=config.train.seed
        )
        print(f"impasto: wrote {count} demo images to {data.path}")
    records = []
    for source in data.source_list():
        found = SOURCE_READERS[source.source](source, shard_index_dir(config))
        if source.loss_weight != 1.0:
            found = [replace(record, weight=record.weight * source.loss_weight) for record in found]
        records.extend(record for record in found for _ in range(source.repeats))
    if data.missing_captions == "skip":
        records = skip_uncaptioned(records, data.max_bad_fraction)
    return records


def shard_index_dir(config: Config) -> Path:
    """``data.index_dir``, or ``$XDG_CACHE_HOME/impasto/shards`` (``~/.cache/...``)."""
    if config.data.index_dir:
        return Path(config.data.index_dir)
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "impasto" / "shards"


def _folder_records(source: SourceConfig, index_dir: Path) -> list[ImageRecord]:
    subfolders = {name: (sub.repeats, sub.weight) for name, sub in source.subfolders.items()}
    return scan_image_folder(Path(source.path), subfolders)


def _manifest_records(source: SourceConfig, index_dir: Path) -> list[ImageRecord]:
    path = Path(source.path)
    return parquet_records(path) if path.suffix == ".parquet" else read_manifest(path)


SOURCE_READERS = {
    "folder": _folder_records,
    "manifest": _manifest_records,
    "webdataset": lambda source, index_dir: webdataset_records(source.path, index_dir),
    "hf": lambda source, index_dir: hf_dataset_records(
        source.path, source.split, source.image_column, source.caption_column
    ),
}


def skip_uncaptioned(records: list[ImageRecord], max_bad_fraction: float) -> list[ImageRecord]:
    """The records with a caption; the others are named (the first 20) and counted, and more
    than ``max_bad_fraction`` of them stops the run."""
    missing = sorted({str(record.image_path) for record in records if not record.caption})
    if not missing:
        return records
    kept = [record for record in records if record.caption]
    named = ", ".join(missing[:20])
    if len(missing) > 20:
        named += f" and {len(missing) - 20} more"
    print(f"impasto: left out {len(missing)} images without a caption: {named}")
    fraction = (len(records) - len(kept)) / len(records)
    if fraction > max_bad_fraction:
        raise ValueError(
            f"data: {len(missing)} images have no caption ({fraction:.0%} of the samples > "
            f"data.max_bad_fraction "
            f"{max_bad_fraction}); add captions, or set data.missing_captions: empty"
        )
    return kept


def place_in_buckets(
    config: Config, records: list[ImageRecord], run_dir: Path | None
) -> list[tuple[int, int] | None] | None:
    """Each record's aspect bucket (``data.buckets``), or None for square images.

    The bucket report (images per bucket, and every image that could not be placed with the
    reason) is printed and saved to ``RUN/buckets.txt`` (with a ``run_dir``) before training.
    """
    buckets = config.data.bucket_list()
    if buckets is None:
        return None
    bucket_of, bucket_report = assign_image_buckets(records, buckets, config.data.bucket_no_upscale)
    text = bucket_report.format()
    if run_dir is not None:
        (run_dir / "buckets.txt").write_text(text + "\n", encoding="utf-8")
    print(f"impasto: aspect buckets ({run_dir / 'buckets.txt' if run_dir else 'not saved'}):")
    print(text)
    return bucket_of


def cache_data(config: Config) -> CacheReport:
    """``impasto cache``: fill the disk cache for ``config``'s data, split across the ranks of a
    torchrun job (each process encodes its share on its own device)."""
    if not config.cache.on_disk:
        raise ValueError(
            "cache: nothing to do; set cache.latents and/or cache.text_embeddings to disk"
        )
    with process_group() as (rank, world):
        device = resolve_device(config.train.device)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        precision = resolve_precision(config.train.mixed_precision, device)
        records, image_ids = identify_images(config, load_records(config), rank, world)
        bucket_of = place_in_buckets(config, records, None)
        models = load_model(config).to(device)
        for module in (models.vae, models.text_encoder, models.text_encoder_2):
            module.eval()
        _, report = fill_cache(
            config, models, records, image_ids, bucket_of,
            autocast_factory(device, precision), str(precision), rank, world,
        )  # fmt: skip
    return report


def record_loss_weights(config: Config, records: list[ImageRecord]) -> list[float] | None:
    """Per-image loss weights: tag frequency (``data.tag_frequency_weighting``) times the
    subfolder's or manifest row's weight; None when every weight is 1."""
    data = config.data
    weights = [record.weight for record in records]
    if data.tag_frequency_weighting:
        captions = [record.caption for record in records]
        tags = tag_frequency_weights(
            captions, data.tag_weight_min, data.tag_weight_max, data.tag_separator
        )
        weights = [tag * weight for tag, weight in zip(tags, weights, strict=True)]
    elif all(weight == 1.0 for weight in weights):
        return None
    return weights


def count_total_steps(
    config: Config, num_images: int, bucket_of: list[tuple[int, int] | None] | None = None
) -> int:
    sampler = training_sampler(
        num_images, config.data.batch_size, config.train.seed, (0, 0), bucket_of
    )
    batches_per_epoch = sampler.num_batches_per_epoch
    total = config.train.max_steps or math.inf
    if config.train.max_epochs is not None:
        epoch_steps = config.train.max_epochs * batches_per_epoch // config.train.grad_accum_steps
        total = min(total, epoch_steps)
    if total < 1:
        raise ValueError("train.max_epochs: the run would make no optimizer step; raise it")
    return int(total)


def micro_batches(
    config: Config,
    records: list[ImageRecord],
    start: tuple[int, int],
    bucket_of: list[tuple[int, int] | None] | None = None,
    loss_weights: list[float] | None = None,
    cache: CachedEncodings | None = None,
) -> MicroBatches:
    """Batches in the exact resumable order, each with the position *after* consuming it."""
    epoch, first = start
    while True:
        loader, sampler = build_dataloader(
            records,
            config.data.resolution,
            config.data.crop,
            config.data.random_flip,
            config.data.batch_size,
            config.train.seed,
            config.data.num_workers,
            (epoch, first),
            caption_dropout=config.data.caption_dropout,
            bucket_of=bucket_of,
            caption_tools=config.data.caption_tools(),
            loss_weights=loss_weights,
            cache=cache,
        )
        position = sampler.position
        for batch in loader:
            position = sampler.position_after(position)
            yield batch, (position.epoch, position.batch_in_epoch)
        epoch, first = position.epoch, position.batch_in_epoch


BAD_DATA_FILE = "bad-data.tsv"


class BadDataLog:
    """The images a run skipped, one ``name<TAB>reason`` line each (``RUN/bad-data.tsv``),
    appended as they are met, kept across resumes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.names = set()
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines()
            self.names = {line.split("\t")[0] for line in lines}

    def record(self, skipped: Sequence[Skipped]) -> None:
        new = [item for item in skipped if item.name not in self.names]
        if not new:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            for item in new:
                handle.write(f"{item.name}\t{item.reason}\n")
                self.names.add(item.name)


def report(state: TrainState, elapsed: float, interrupted: bool, checkpoint: Path | None) -> None:
    how = "stopped on request" if interrupted else "finished"
    print(f"impasto: {how} at step {state.step} in {elapsed:.1f} s; checkpoint: {checkpoint}")
    if state.images_bad:
        print(f"impasto: skipped {state.images_bad} unusable images")
    if state.steps_skipped:
        print(f"impasto: skipped {state.steps_skipped} non-finite steps")
