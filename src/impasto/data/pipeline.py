"""A run's data, assembled from its config: records from every source, aspect buckets, loss
weights, the disk cache, and the resumable stream of micro-batches the loop consumes.

The loop asks for :func:`prepare_run_data` with what its training method needs
(:class:`~impasto.train.methods.DataNeeds`): a method that uses prompts only gets a
:class:`PromptStream`, which never opens an image.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from impasto.data import Batch, ImageRecord, build_dataloader, scan_image_folder, training_sampler
from impasto.data.buckets import assign_image_buckets, buckets_from
from impasto.data.cache import CachedEncodings
from impasto.data.cache_fill import CacheReport, fill_cache, identify_images
from impasto.data.captions import caption_tools_from, tag_frequency_weights
from impasto.data.dataset import Skipped
from impasto.data.demo import write_demo_dataset
from impasto.data.folder import read_manifest
from impasto.data.prompts import read_prompts
from impasto.data.sampler import ResumableBatchSampler
from impasto.data.sources import hf_dataset_records, parquet_records, webdataset_records
from impasto.distributed import RunGroup, barrier, process_group
from impasto.precision import autocast_factory, resolve_device, resolve_precision

Bucket = tuple[int, int]


def load_records(config: Any, main: bool = True) -> list[ImageRecord]:
    """Every source's records, each repeated ``repeats`` times with its ``loss_weight``, then
    the images without a caption left out (``data.missing_captions: skip``), counted and named.
    ``main``: this process writes the demo dataset when it is missing (the other ranks of a
    run wait for it)."""
    data = config.data
    if main and data.generate_demo and not Path(data.path).exists():
        count = write_demo_dataset(
            Path(data.path), data.demo_num_images, data.resolution, seed=config.train.seed
        )
        print(f"impasto: wrote {count} demo images to {data.path}")
    barrier()
    if data.prompts is not None:
        return read_prompts(data.prompts)
    records = []
    for source in data.source_list():
        found = SOURCE_READERS[source.source](source, shard_index_dir(config))
        if source.loss_weight != 1.0:
            found = [replace(record, weight=record.weight * source.loss_weight) for record in found]
        records.extend(record for record in found for _ in range(source.repeats))
    if data.missing_captions == "skip":
        records = skip_uncaptioned(records, data.max_bad_fraction)
    return records


def shard_index_dir(config: Any) -> Path:
    """``data.index_dir``, or ``$XDG_CACHE_HOME/impasto/shards`` (``~/.cache/...``)."""
    if config.data.index_dir:
        return Path(config.data.index_dir)
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "impasto" / "shards"


def _folder_records(source: Any, index_dir: Path) -> list[ImageRecord]:
    subfolders = {name: (sub.repeats, sub.weight) for name, sub in source.subfolders.items()}
    return scan_image_folder(Path(source.path), subfolders)


def _manifest_records(source: Any, index_dir: Path) -> list[ImageRecord]:
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
    config: Any, records: list[ImageRecord], run_dir: Path | None
) -> list[Bucket | None] | None:
    """Each record's aspect bucket (``data.buckets``), or None for square images.

    The bucket report (images per bucket, and every image that could not be placed with the
    reason) is printed and saved to ``RUN/buckets.txt`` (with a ``run_dir``) before training.
    """
    buckets = buckets_from(config.data)
    if buckets is None:
        return None
    bucket_of, bucket_report = assign_image_buckets(records, buckets, config.data.bucket_no_upscale)
    text = bucket_report.format()
    if run_dir is not None:
        (run_dir / "buckets.txt").write_text(text + "\n", encoding="utf-8")
    print(f"impasto: aspect buckets ({run_dir / 'buckets.txt' if run_dir else 'not saved'}):")
    print(text)
    return bucket_of


def record_loss_weights(config: Any, records: list[ImageRecord]) -> list[float] | None:
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
    config: Any, num_images: int, bucket_of: list[Bucket | None] | None = None, world: int = 1
) -> int:
    """Optimizer steps of the run: ``train.max_steps``, capped by ``train.max_epochs`` (a step
    takes ``grad_accum_steps`` batches on each of ``world`` ranks)."""
    sampler = training_sampler(
        num_images, config.data.batch_size, config.train.seed, (0, 0), bucket_of
    )
    batches_per_epoch = sampler.num_batches_per_epoch
    total = config.train.max_steps or math.inf
    if config.train.max_epochs is not None:
        per_step = config.train.grad_accum_steps * world
        epoch_steps = config.train.max_epochs * batches_per_epoch // per_step
        total = min(total, epoch_steps)
    if total < 1:
        raise ValueError("train.max_epochs: the run would make no optimizer step; raise it")
    return int(total)


class DataStream:
    """The run's micro-batches in the exact resumable order; its state is the sampler's
    position (the next batch not consumed yet), so it is one of the checkpoint's Stateful
    objects.

    Each epoch is one iterator of one ``DataLoader``; starting an iterator draws the loader's
    base seed from torch's global generator. A resumed run must not draw it twice for one
    epoch: :meth:`load_state_dict` starts a mid-epoch iterator at once, before the checkpoint
    restores the global generators (which already hold that epoch's draw).
    """

    def __init__(
        self,
        config: Any,
        records: Sequence[ImageRecord],
        bucket_of: Sequence[Bucket | None] | None = None,
        loss_weights: Sequence[float] | None = None,
        cache: CachedEncodings | None = None,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        data = config.data
        self.loader, self.sampler = build_dataloader(
            records,
            data.resolution,
            data.crop,
            data.random_flip,
            data.batch_size,
            config.train.seed,
            data.num_workers,
            caption_dropout=data.caption_dropout,
            bucket_of=bucket_of,
            caption_tools=caption_tools_from(data),
            loss_weights=loss_weights,
            cache=cache,
            rank=rank,
            world_size=world,
        )
        self._iterator = None

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.sampler.position.epoch

    def __next__(self) -> Batch:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        try:
            batch = next(self._iterator)
        except StopIteration:  # the epoch ended: the sampler is at the next one's start
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        self.sampler.advance()
        return batch

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self._iterator = None
        if self.sampler.position.batch_in_epoch > 0:
            self._iterator = iter(self.loader)


class PromptStream:
    """Batches of captions only, in the same resumable order as :class:`DataStream`, for
    methods that generate from prompts: no image is opened."""

    def __init__(
        self, config: Any, records: Sequence[ImageRecord], rank: int = 0, world: int = 1
    ) -> None:
        self.captions = [record.caption for record in records]
        self.resolution = config.data.resolution
        self.sampler: ResumableBatchSampler = training_sampler(
            len(records), config.data.batch_size, config.train.seed, rank=rank, world_size=world
        )

    @property
    def epoch(self) -> int:
        return self.sampler.position.epoch

    def __next__(self) -> Batch:
        position = self.sampler.position
        keys = next(self.sampler.epoch_batches(position.epoch, position.batch_in_epoch))
        self.sampler.advance()
        indices = [key.index for key in keys]
        sizes = torch.tensor([[self.resolution, self.resolution]] * len(indices))
        return Batch(
            pixel_values=None,
            captions=[self.captions[index] for index in indices],
            original_sizes=sizes,
            crop_top_lefts=torch.zeros_like(sizes),
            target_sizes=sizes,
            indices=torch.tensor(indices),
        )

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


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


@dataclass
class RunData:
    """A run's data: its records, stream of micro-batches and length in optimizer steps."""

    records: list[ImageRecord]
    stream: DataStream | PromptStream
    total_steps: int
    bad_data: BadDataLog


def prepare_run_data(
    config: Any,
    backbone: Any,
    run_dir: Path,
    images: bool,
    autocast: Any,
    precision: str,
    group: RunGroup | None = None,
) -> RunData:
    """Records, buckets, loss weights and (``cache.*: disk``) the filled cache, as a stream.

    ``images``: the method trains on images (else a :class:`PromptStream`, opening none).
    ``group``: this process's rank in a parallel run (it loads its share of every step, and
    fills its share of the cache); rank 0 alone writes the reports.
    """
    group = group or RunGroup()
    rank, world = group.rank, group.world
    records = load_records(config, group.is_main)
    bad_data = BadDataLog(run_dir / BAD_DATA_FILE)
    if not images:
        total = count_total_steps(config, len(records), world=world)
        return RunData(records, PromptStream(config, records, rank, world), total, bad_data)
    image_ids, encodings = None, None
    if config.cache.on_disk:
        records, image_ids = identify_images(config, records, rank, world)
    bucket_of = place_in_buckets(config, records, run_dir if group.is_main else None)
    total = count_total_steps(config, len(records), bucket_of, world)
    if config.cache.on_disk:
        encodings, report = fill_cache(
            config, backbone, records, image_ids, bucket_of, autocast, precision, rank, world
        )
        print(f"impasto: {report.format()}")
    weights = record_loss_weights(config, records)
    stream = DataStream(config, records, bucket_of, weights, encodings, rank, world)
    return RunData(records, stream, total, bad_data)


def cache_data(config: Any) -> CacheReport:
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
        records, image_ids = identify_images(config, load_records(config, rank == 0), rank, world)
        bucket_of = place_in_buckets(config, records, None)
        from impasto.checkpoint.trained import build_starting_backbone

        backbone = build_starting_backbone(config).to(device)
        for module in backbone.modules().values():
            module.eval()
        _, report = fill_cache(
            config, backbone, records, image_ids, bucket_of,
            autocast_factory(device, precision), str(precision), rank, world,
        )  # fmt: skip
    return report
