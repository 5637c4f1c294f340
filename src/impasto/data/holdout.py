"""Held-out images for the validation loss (issue #18): the split of ``data.validation_split``
and the named sets of ``eval.sets``, each a fixed list of images in a fixed order.

The split is a pure function of each image's identity (its path inside its source, so moving
the dataset folder keeps it) and ``eval.seed``: the same on every rank, across resumes and
across runs with other training seeds, so their validation losses compare. An image is held
out when its hash, as a fraction of 2^64, is below the split; every copy of it (repeats, a
second source listing it) goes the same way. The held-out images are ordered by that hash, so
``eval.max_images`` takes a fixed, unbiased subset, and raising it keeps the images it had.

A held-out set reads its images with a center crop, no flip and fixed captions (the prefix and
suffix of training, no tag shuffle, tag dropout or caption dropout): evaluating draws nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from impasto.data.buckets import assign_image_buckets, buckets_from
from impasto.data.captions import caption_tools_from
from impasto.data.dataset import Batch, ImageCaptionDataset, collate_examples
from impasto.data.demo import DEMO_GENERATOR, write_demo_dataset
from impasto.data.demo_stamp import check_stamp, write_stamped
from impasto.data.demo_video import DEMO_VIDEO_GENERATOR, write_demo_video_dataset
from impasto.data.folder import ImageRecord
from impasto.data.seeding import derive_seed
from impasto.data.video.records import clip_sampling, expand_clip_slots, sample_shapes
from impasto.distributed import barrier

HASH_PERSON = b"impasto-holdout"
DEMO_SET_STREAM = 18_018  # separates a generated eval set's demo seed from other seeds
DEMO_SET_IMAGES = 256  # at most this many images in a generated demo eval set


def holdout_hash(identity: str, seed: int) -> int:
    """A 64-bit hash of an image's identity under ``seed`` (BLAKE2b: the same everywhere)."""
    text = f"{seed}\n{identity}".encode()
    return int.from_bytes(
        hashlib.blake2b(text, digest_size=8, person=HASH_PERSON).digest(), "little"
    )


def is_held_out(identity: str, seed: int, fraction: float) -> bool:
    """Whether the image ``identity`` belongs to the validation split ``fraction`` of ``seed``."""
    return holdout_hash(identity, seed) < fraction * 2**64


def record_identity(source_path: str | Path, record: ImageRecord) -> str:
    """What identifies an image across runs: its path inside its source's folder (POSIX), or
    its name as the source gave it (a shard member, a dataset row)."""
    path = Path(str(record.image_path))
    try:
        return path.relative_to(Path(str(source_path))).as_posix()
    except ValueError:
        return str(record.image_path)


def split_held_out(
    records: Sequence[ImageRecord], identities: dict[str, str], fraction: float, seed: int
) -> tuple[list[ImageRecord], list[ImageRecord]]:
    """``(training records, held-out images)``: each image (all its copies) goes one way; the
    held-out ones once each, ordered by their hash. ``identities``: image path → identity
    (:func:`record_identity`; a path it lacks is its own identity)."""
    if fraction <= 0:
        return list(records), []
    threshold = fraction * 2**64  # as is_held_out, each image hashed once (repeats too)
    training, held_out, keys = [], {}, {}
    for record in records:
        name = str(record.image_path)
        if name not in keys:
            identity = identities.get(name, name)
            keys[name] = (holdout_hash(identity, seed), identity)
        if keys[name][0] < threshold:
            held_out.setdefault(name, record)
        else:
            training.append(record)
    return training, [held_out[name] for name in sorted(held_out, key=keys.__getitem__)]


def ordered_images(
    records: Sequence[ImageRecord], source_path: str, seed: int
) -> list[ImageRecord]:
    """The distinct images of an eval set, in their fixed order (by hash, as the split)."""
    distinct = {str(record.image_path): record for record in records}
    identities = {name: record_identity(source_path, r) for name, r in distinct.items()}
    order = sorted(distinct, key=lambda name: (holdout_hash(identities[name], seed), name))
    return [distinct[name] for name in order]


def demo_set_seed(eval_seed: int, name: str) -> int:
    """The seed of the demo images generated for eval set ``name``: not the training data's
    (``train.seed``), so they are images the run never trains on."""
    return derive_seed(eval_seed, DEMO_SET_STREAM, holdout_hash(name, 0))


def generate_missing_demo_sets(config: Any, main: bool = True) -> None:
    """With ``data.generate_demo``, write the demo images to every ``eval.sets`` folder that
    does not exist yet (``main``: this process writes; the others wait), from another seed
    than the training data: the demo's held-out set. Written to a temporary folder and renamed,
    so an interrupted start never leaves half a set behind."""
    data = config.data
    if not data.generate_demo:
        return
    sets = [eval_set for eval_set in config.eval.sets if eval_set.source == "folder"]
    # Not the count (eval.max_images reads the first images of a larger set) nor the seed.
    kind = f"demo images {DEMO_GENERATOR}" if data.video is None else (
        f"demo clips {DEMO_VIDEO_GENERATOR}, held out"
    )  # fmt: skip
    settings = {"generator": kind, "resolution": data.resolution}
    for eval_set in sets if main else ():
        path = Path(eval_set.path)
        if path.exists():
            continue
        count = min(config.eval.max_images, DEMO_SET_IMAGES)
        seed = demo_set_seed(config.eval.seed, eval_set.name)
        if data.video is None:
            write = partial(write_demo_dataset, num_images=count, size=data.resolution, seed=seed)
        else:  # clips of the combinations no training clip shows
            write = partial(write_demo_video_dataset, num_clips=count, size=data.resolution,
                            frames=9, seed=seed, held_out=True)  # fmt: skip
        write_stamped(path, settings, write)
        print(f"impasto: wrote {count} held-out demo images to {path} (eval set {eval_set.name})")
    barrier()
    for eval_set in sets:
        check_stamp(Path(eval_set.path), settings, f"eval.sets {eval_set.name}")


@dataclass(frozen=True)
class HeldOutSet:
    """One set the validation loss is measured on: ``name`` (None: the validation split), its
    images in their fixed order (``eval.max_images`` at most), the dataset that reads them and
    its batches (lists of dataset indices, one bucket each, in a fixed order)."""

    name: str | None
    records: list[ImageRecord]
    dataset: ImageCaptionDataset
    batches: list[list[int]]

    def batch(self, number: int) -> Batch:
        """Batch ``number`` (the unreadable images of it left out)."""
        return collate_examples([self.dataset[(0, index)] for index in self.batches[number]])


def held_out_set(
    config: Any, name: str | None, records: Sequence[ImageRecord], batch_size: int
) -> HeldOutSet:
    """The :class:`HeldOutSet` of ``records`` (already in their fixed order): the first
    ``eval.max_images``, placed in the run's buckets (an image no bucket takes is left out),
    read as training reads them but without randomness (module docstring)."""
    data = config.data
    records = list(records)[: config.eval.max_images]
    sampling = None
    if data.video is not None:  # a video's clips, then the first max_images samples
        sampling = clip_sampling(data.video)
        records = expand_clip_slots(records, sampling)[0][: config.eval.max_images]
    bucket_of = None
    buckets = buckets_from(data)
    if buckets is not None:
        bucket_of, _ = assign_image_buckets(records, buckets, data.bucket_no_upscale)
    tools = replace(caption_tools_from(data), shuffle=False, tag_dropout=0.0)
    dataset = ImageCaptionDataset(
        records, data.resolution, "center", False, config.eval.seed, 0.0, bucket_of, tools,
        video=sampling,
    )  # fmt: skip
    keys = bucket_of if sampling is None else sample_shapes(records, bucket_of, data.resolution)
    return HeldOutSet(name, records, dataset, eval_batches(keys, len(records), batch_size))


def eval_batches(
    bucket_of: Sequence[tuple[int, ...] | None] | None, num_images: int, batch_size: int
) -> list[list[int]]:
    """Consecutive images of one bucket at a time, at most ``batch_size`` each: the buckets in
    the order their first image comes, each bucket's images in their order."""
    if bucket_of is None:
        indices = list(range(num_images))
        return [indices[start : start + batch_size] for start in range(0, num_images, batch_size)]
    by_bucket: dict[tuple[int, ...], list[int]] = {}
    for index, bucket in enumerate(bucket_of):
        if bucket is not None:
            by_bucket.setdefault(bucket, []).append(index)
    return [
        indices[start : start + batch_size]
        for indices in by_bucket.values()
        for start in range(0, len(indices), batch_size)
    ]
