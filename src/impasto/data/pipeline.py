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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from impasto.data import Batch, ImageRecord, build_dataloader, training_sampler
from impasto.data.buckets import assign_image_buckets, buckets_from
from impasto.data.cache import CachedEncodings
from impasto.data.cache_fill import CacheReport, fill_cache, identify_images
from impasto.data.captions import caption_tools_from, tag_frequency_weights
from impasto.data.holdout import HeldOutSet, generate_missing_demo_sets, held_out_set
from impasto.data.packing import pack_layout
from impasto.data.records import (
    SOURCE_READERS,
    check_bad_fraction,
    load_records,
    num_items,
    print_left_out,
    read_eval_set,
    scan_sources,
    shard_index_dir,
)
from impasto.data.sampler import ResumableBatchSampler
from impasto.data.skips import BAD_DATA_FILE, SCANNED, BadDataLog, Skipped, distinct
from impasto.data.video.records import clip_sampling, run_clip_slots, sample_shapes
from impasto.distributed import RunGroup, process_group
from impasto.faults import writing
from impasto.precision import autocast_factory, resolve_device, resolve_precision

Bucket = tuple[int, int]

__all__ = [
    "BAD_DATA_FILE",
    "SOURCE_READERS",
    "BadDataLog",
    "DataStream",
    "PromptStream",
    "RunData",
    "cache_data",
    "held_out_sets",
    "count_total_steps",
    "load_records",
    "place_in_buckets",
    "prepare_run_data",
    "record_loss_weights",
    "shard_index_dir",
]


def place_in_buckets(
    config: Any, records: list[ImageRecord], run_dir: Path | None, main: bool = True
) -> list[Bucket | None] | None:
    """Each record's aspect bucket (``data.buckets``), or None for square images.

    The bucket report (images per bucket, and every image that could not be placed with the
    reason) is printed (``main``: by this process) and saved to ``RUN/buckets.txt`` (with a
    ``run_dir``) before training.
    """
    return bucket_placement(config, records, run_dir, main)[0]


def bucket_placement(
    config: Any, records: list[ImageRecord], run_dir: Path | None, main: bool = True
) -> tuple[list[Bucket | None] | None, list[Skipped]]:
    """:func:`place_in_buckets`, and the images left out because their header does not read
    (they are never loaded, so the run's bad-data report learns of them here). ``main``:
    this process prints the report (rank 0 of a run)."""
    buckets = buckets_from(config.data)
    if buckets is None:
        return None, []
    bucket_of, bucket_report = assign_image_buckets(records, buckets, config.data.bucket_no_upscale)
    text = bucket_report.format()
    if run_dir is not None:
        with writing(run_dir / "buckets.txt"):
            (run_dir / "buckets.txt").write_text(text + "\n", encoding="utf-8")
    if main:
        where = run_dir / "buckets.txt" if run_dir else "not saved"
        print(f"impasto: aspect buckets ({where}):")
        print(text)
    unplaced = bucket_report.unplaced
    left_out = [Skipped(SCANNED, name, unplaced[name]) for name in bucket_report.unreadable]
    return bucket_of, left_out


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
    config: Any, num_images: int, bucket_of: list[Bucket | None] | None = None, world: int = 1,
    tokens_of: list[int | None] | None = None,
) -> int:  # fmt: skip
    """Optimizer steps of the run: ``train.max_steps``, capped by ``train.max_epochs`` (a step
    takes ``grad_accum_steps`` batches on each of ``world`` ranks).

    Raises ``ValueError`` when one micro-step (``data.batch_size`` on each of ``world`` ranks)
    would need more images than there are to train on (every image would be repeated many
    times in each batch: a typo such as ``batch_size: 10000000`` would hang the loader).
    """
    pack_tokens = config.data.pack_tokens if tokens_of is not None else None
    if pack_tokens is None:
        check_batch_size(config.data.batch_size, world, num_images, bucket_of)
    sampler = training_sampler(
        num_images, config.data.batch_size, config.train.seed, (0, 0), bucket_of,
        tokens_of=tokens_of, pack_tokens=pack_tokens,
    )  # fmt: skip
    batches_per_epoch = sampler.num_batches_per_epoch
    total = config.train.max_steps or math.inf
    if config.train.max_epochs is not None:
        per_step = config.train.grad_accum_steps * world
        epoch_steps = config.train.max_epochs * batches_per_epoch // per_step
        total = min(total, epoch_steps)
    if total < 1:
        raise ValueError("train.max_epochs: the run would make no optimizer step; raise it")
    return int(total)


def check_batch_size(
    batch_size: int, world: int, num_images: int, bucket_of: list[Bucket | None] | None = None
) -> None:
    """One-line ``ValueError`` when ``batch_size × world`` exceeds the usable images: the
    records (repeats included), less those no bucket takes. A bucket smaller than a batch is
    filled with its own images again, so only the total counts."""
    usable = num_images if bucket_of is None else sum(bucket is not None for bucket in bucket_of)
    if batch_size * world <= usable:
        return
    ranks = f" x {world} ranks = {batch_size * world}" if world > 1 else ""
    fix = (
        f"set data.batch_size to at most {usable // world}"
        if usable >= world
        else "use fewer ranks"
    )
    raise ValueError(
        f"data.batch_size: {batch_size}{ranks} images per micro-step is more than the {usable} "
        f"usable images (after repeats and bucket placement); {fix}, or add images"
    )


class DataStream:
    """The run's micro-batches in the exact resumable order; its state is the sampler's
    position (the next batch not consumed yet), so it is one of the checkpoint's Stateful
    objects.

    Each epoch is one iterator of one ``DataLoader``; starting an iterator draws the loader's
    base seed from torch's global generator. A resumed run must not draw it twice for one
    epoch: :meth:`load_state_dict` starts a mid-epoch iterator at once, before the checkpoint
    restores the global generators (which already hold that epoch's draw).

    An unusable item counts once (issue #16): a batch's ``num_bad`` and ``skipped`` hold only
    the items this stream has not met before (``known_bad``: those left out before training),
    so a bad file met again in a later epoch, or as a repeat, is not reported again by this
    process; the trainer's checkpointed counters dedup across ranks and resumes.

    A damaged cached text embedding is no unusable item: its caption is encoded on the fly and
    the image trained on. A batch's ``reencoded`` likewise holds the ones not met before; the
    trainer adds them, gathered from every rank, to the bad-data report (issue #29), never to
    ``num_bad``, so they count toward neither ``images_bad`` nor ``data.max_bad_fraction``;
    the report's rows are what the run summary counts.
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
        known_bad: set[str] | None = None,
        caption_variants: int | None = None,
        tokens_of: list[int | None] | None = None,
        sample_keys: list[tuple[int, int, int] | None] | None = None,
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
            caption_variants=caption_variants,
            tokens_of=tokens_of,
            pack_tokens=data.pack_tokens if tokens_of is not None else None,
            video=None if data.video is None else clip_sampling(data.video),
            sample_keys=sample_keys,
        )
        self.known_bad = set(known_bad or ())
        self.known_reencoded: set[str] = set()
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
        return self.first_meetings(batch)

    def first_meetings(self, batch: Batch) -> Batch:
        """``batch`` with ``skipped`` and ``num_bad``, and ``reencoded``, cut to the items not
        met before."""
        if batch.skipped:
            new = [item for item in distinct(batch.skipped) if item.name not in self.known_bad]
            self.known_bad.update(item.name for item in new)
            batch = replace(batch, num_bad=len(new), skipped=tuple(new))
        if batch.reencoded:
            known = self.known_reencoded
            reencoded = [item for item in distinct(batch.reencoded) if item.name not in known]
            known.update(item.name for item in reencoded)
            batch = replace(batch, reencoded=tuple(reencoded))
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


@dataclass
class RunData:
    """A run's data: its records, stream of micro-batches and length in optimizer steps; the
    bad-data report, and the items left out while the sources were read (``scan_skipped``:
    already in the report, never in a batch; each counts as one unusable image).
    ``bucket_of``: each record's bucket (None: no buckets); ``groups``: each image's group
    (:mod:`impasto.data.census`). ``held_out``: the images ``data.validation_split`` keeps
    out of training; ``eval_sets``: what the validation loss reads (``eval.every_steps``: the
    split, then ``eval.sets``; none when it is off)."""

    records: list[ImageRecord]
    stream: DataStream | PromptStream
    total_steps: int
    bad_data: BadDataLog
    scan_skipped: list[Skipped] = field(default_factory=list)
    bucket_of: list[Bucket | None] | None = None
    groups: dict[str, str] = field(default_factory=dict)
    held_out: list[ImageRecord] = field(default_factory=list)
    eval_sets: list[HeldOutSet] = field(default_factory=list)

    @property
    def batches_per_epoch(self) -> int:
        """Per-rank batches (micro-batches) in an epoch."""
        return self.stream.sampler.num_batches_per_epoch


def prepare_run_data(
    config: Any,
    backbone: Any,
    run_dir: Path | None,
    images: bool,
    autocast: Any,
    precision: str,
    group: RunGroup | None = None,
    pixels_only: bool = False,
) -> RunData:
    """Records, buckets, loss weights and (``cache.*: disk``) the filled cache, as a stream.

    ``images``: the method trains on images (else a :class:`PromptStream`, opening none).
    ``group``: this process's rank in a parallel run (it loads its share of every step, and
    fills its share of the cache); rank 0 alone writes the reports. Items left out while the
    sources were read go to ``RUN/bad-data.tsv`` before training; more than
    ``data.max_bad_fraction`` of them stops the run here. ``run_dir`` None: no report is
    written. ``pixels_only`` (``impasto data preview``): decode the images even when the
    config caches them, with the crops and captions a cached run trains on (no cache is read
    or filled; ``backbone`` may be None).

    The images of ``data.validation_split`` are held out of the records (``held_out``); with
    ``eval.every_steps``, ``eval_sets`` holds what the validation loss reads
    (:func:`held_out_sets`).
    """
    group = group or RunGroup()
    rank, world = group.rank, group.world  # who hashes and caches what: every rank a share
    share, shares = group.data_rank, group.data_world  # who trains on what (tp x cp: one)
    main = group.is_main
    scan = scan_sources(config, main)
    bad_data = BadDataLog(None if run_dir is None else run_dir / BAD_DATA_FILE)
    records = scan.records
    if not images:
        left_out = report_left_out(config, bad_data, scan.skipped, records, main)
        total = count_total_steps(config, len(records), world=shares)
        stream = PromptStream(config, records, share, shares)
        return RunData(records, stream, total, bad_data, left_out, groups=scan.groups)
    cached = config.cache.on_disk and not pixels_only
    image_ids, encodings = None, None
    records, too_short = run_clip_slots(config.data.video, records)
    if cached:  # (after the slots: the cache holds each slot's frames)
        records, image_ids = identify_images(config, records, rank, world)
    bucket_of, unreadable = bucket_placement(config, records, run_dir if main else None, main)
    unplaced = {item.name for item in unreadable}
    usable = [record for record in records if str(record.image_path) not in unplaced]
    skipped = scan.skipped + too_short + unreadable
    left_out = report_left_out(config, bad_data, skipped, usable + scan.held_out, main)
    tokens_of = pack_sizes(config, backbone, records, bucket_of, main)
    sample_keys = clip_keys(config, records, bucket_of)
    total = count_total_steps(config, len(records), sample_keys or bucket_of, shares, tokens_of)
    if cached:
        encodings, report = fill_cache(
            config, backbone, records, image_ids, bucket_of, autocast, precision, rank, world
        )
        if main:
            print(f"impasto: {report.format()}")
    weights = record_loss_weights(config, records)
    known_bad = {item.name for item in left_out}  # (not the report: it may run ahead of a
    # resumed checkpoint; the trainer's counters dedup across epochs, ranks and resumes)
    variants = None
    if pixels_only and config.cache.text_embeddings == "disk":
        variants = config.cache.caption_variants  # the captions the text cache holds
    stream = DataStream(
        config, records, bucket_of, weights, encodings, share, shares, known_bad, variants,
        tokens_of, sample_keys,
    )  # fmt: skip
    sets = [] if pixels_only else held_out_sets(config, scan.held_out, main)
    return RunData(
        records, stream, total, bad_data, left_out, bucket_of, scan.groups, scan.held_out, sets
    )


def clip_keys(
    config: Any, records: Sequence[ImageRecord], bucket_of: list[Bucket | None] | None
) -> list[tuple[int, int, int] | None] | None:
    """What batches of a video run group by: each sample's (frames, height, width), so a batch
    holds one shape (:func:`sample_shapes`); None in an image run (its buckets do)."""
    if config.data.video is None:
        return None
    return sample_shapes(records, bucket_of, config.data.resolution)


def pack_sizes(
    config: Any, backbone: Any, records: Sequence[ImageRecord],
    bucket_of: list[Bucket | None] | None, main: bool,
) -> list[int | None] | None:  # fmt: skip
    """Each sample's tokens in the backbone's sequence (``Backbone.sequence_length`` of its
    bucket, or the ``data.resolution`` square, and its frames) when ``data.pack_tokens`` packs
    batches, else None; rank 0 reports the packs' layout."""
    capacity = config.data.pack_tokens
    if capacity is None or backbone is None:
        return None
    shapes = sample_shapes(records, bucket_of, config.data.resolution)
    lengths = {
        shape: backbone.sequence_length(shape[1], shape[2], frames=shape[0])
        for shape in set(shapes) if shape is not None
    }  # fmt: skip
    tokens_of = [None if shape is None else lengths[shape] for shape in shapes]
    if main:
        layout = pack_layout(tokens_of, capacity)
        print(
            f"impasto: packing: {layout.num_packs} packs of {capacity} tokens per epoch, "
            f"{layout.utilisation:.1%} of their tokens hold samples "
            f"({len(lengths)} shapes: {', '.join(shape_name(s) for s in sorted(lengths))})"
        )
    return tokens_of


def shape_name(shape: tuple[int, int, int]) -> str:
    """``(1, 48, 80)`` → ``48x80``; ``(17, 64, 64)`` → ``17x64x64`` (frames first)."""
    frames, height, width = shape
    return f"{height}x{width}" if frames == 1 else f"{frames}x{height}x{width}"


def held_out_sets(config: Any, split: list[ImageRecord], main: bool = True) -> list[HeldOutSet]:
    """What the validation loss reads (``eval.every_steps``; none when it is off): the
    validation split ``split`` (when it holds an image), then each of ``eval.sets`` (the demo's
    written first with ``data.generate_demo``: :func:`generate_missing_demo_sets`)."""
    evaluation = config.eval
    if not evaluation.every_steps:
        return []
    generate_missing_demo_sets(config, main)
    batch_size = evaluation.batch_size or config.data.batch_size
    sets = [held_out_set(config, None, split, batch_size)] if split else []
    if config.data.validation_split and not split and main:
        print(
            f"impasto: data.validation_split {config.data.validation_split:g} held out no "
            "image (too few images); no val/loss"
        )
    for eval_set in evaluation.sets:
        records = read_eval_set(config, eval_set)
        sets.append(held_out_set(config, eval_set.name, records, batch_size))
    if not sets:
        raise ValueError(
            "eval.every_steps: no held-out image to measure the validation loss on; raise "
            "data.validation_split or list eval.sets"
        )
    return sets


def report_left_out(
    config: Any,
    bad_data: BadDataLog,
    skipped: list[Skipped],
    usable: Sequence[ImageRecord],
    main: bool,
) -> list[Skipped]:
    """Add the items left out before training to the bad-data report (``main``: rank 0 writes
    it), say so on the console, and stop when they are more than ``data.max_bad_fraction``."""
    skipped = distinct(skipped)
    bad_data.record(skipped, write=main)
    if main:
        print_left_out(skipped, bad_data.path)
    check_bad_fraction(skipped, num_items(usable), config.data.max_bad_fraction, bad_data.path)
    return skipped


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
        records, _ = run_clip_slots(config.data.video, load_records(config, rank == 0))
        records, image_ids = identify_images(config, records, rank, world)
        bucket_of = place_in_buckets(config, records, None, rank == 0)
        from impasto.checkpoint.trained import build_starting_backbone

        backbone = build_starting_backbone(config).to(device)
        for module in backbone.modules().values():
            module.eval()
        _, report = fill_cache(
            config, backbone, records, image_ids, bucket_of,
            autocast_factory(device, precision), str(precision), rank, world,
        )  # fmt: skip
    return report
