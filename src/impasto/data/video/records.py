"""Clips as training records (``data.video``): sources read as clips, each video cut into its
clip slots, and the pixels of one clip sample.

A video run's records are :class:`~impasto.data.folder.ImageRecord` s like an image run's, so
repeats, loss weights, the validation split, buckets and the bad-data report work unchanged:

- a video (a file or a tar shard's member) or a frame folder is a record with a
  :class:`ClipSlot` (its probed :class:`~impasto.data.video.probe.ClipInfo`, and once
  expanded, which of its clips it is);
- an image is a record without one: a one-frame sample.

A video of ``m`` clips (:func:`~impasto.data.video.sampling.sample_clips`) becomes ``m``
records (:func:`expand_clip_slots`), one sample each; they share a placement key (the dataset
index of the first), so an epoch's clips of one video are drawn together and never overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from impasto.data.folder import IMAGE_EXTENSIONS, ImageRecord, Scan, scan_manifest
from impasto.data.skips import SCANNED, Skipped
from impasto.data.sources import (
    SHARD_CLIP_SUFFIXES,
    FileRangeBlob,
    FsspecRangeBlob,
    ParquetRowBlob,
    parquet_scan,
    webdataset_scan,
)
from impasto.data.video.frames import UnreadableClip
from impasto.data.video.index import index_file, probe_indexed
from impasto.data.video.probe import ClipInfo, decode_frames
from impasto.data.video.sampling import ClipSampling, clip_length, frame_grid, sample_clips
from impasto.data.video.scan import ClipRecord, scan_clip_folder


@dataclass(frozen=True)
class ClipSlot:
    """A video's place in the records: its probe, and (once :func:`expand_clip_slots` ran)
    which of its ``num_clips`` clips of ``num_frames`` frames this record is; ``key`` seeds the
    placement of the video's clips (shared by its slots)."""

    info: ClipInfo
    slot: int = 0
    num_clips: int = 1
    num_frames: int = 1
    key: int = 0


def clip_sampling(video: Any) -> ClipSampling:
    """The ``data.video`` config section as :class:`ClipSampling`."""
    return ClipSampling(
        num_frames=video.num_frames, fps=video.fps, frame_stride=video.frame_stride,
        clips_per_video=video.clips_per_video, placement=video.placement,
        min_frames=video.min_frames, temporal_compression=video.temporal_compression,
    )  # fmt: skip


def is_image_file(path: Path | str) -> bool:
    path = Path(path)
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.is_dir()


def probed_scan(found: Sequence[ClipRecord], skipped: list[Skipped], index: Path | None) -> Scan:
    """``found`` probed (frames counted by decoding, or read from the probe ``index``:
    :mod:`impasto.data.video.index`): videos and frame folders as clip records, images as
    one-frame records; those that do not decode left out with the reason, after ``skipped``."""
    probed, broken = probe_indexed(found, index)
    records = []
    for record, info in probed:
        size = (info.height, info.width)
        if is_image_file(record.path) and record.blob is None:
            records.append(ImageRecord(record.path, record.caption, record.weight, size=size))
        else:
            slot = ClipSlot(info)
            records.append(ImageRecord(record.path, record.caption, record.weight,
                                       blob=record.blob, size=size, clip=slot))  # fmt: skip
    return Scan(records, skipped + broken)


def clip_folder_scan(source: Any, index_dir: Path) -> Scan:
    """A folder source read as clips (:func:`~impasto.data.video.scan.scan_clip_folder`)."""
    found = scan_clip_folder(Path(source.path))
    return probed_scan(found.records, found.skipped, index_file(index_dir, source.path))


def clip_manifest_scan(source: Any, index_dir: Path) -> Scan:
    """A JSONL, CSV or Parquet manifest read as clips: each row's ``video`` (else ``image``)
    is a video, a frame folder or an image, with its ``caption`` and ``weight``; in Parquet
    also a video's or an image's bytes (:func:`clip_parquet_scan`)."""
    path = Path(source.path)
    if path.suffix == ".parquet":
        return clip_parquet_scan(path, index_dir)
    rows = scan_manifest(path, columns=("video", "image"))
    found = [ClipRecord(r.image_path, r.caption, r.weight) for r in rows.records]
    return probed_scan(found, rows.skipped, index_file(index_dir, path))


def clip_parquet_scan(path: Path, index_dir: Path) -> Scan:
    """A Parquet manifest read as clips, in row order: a row's ``video`` (else ``image``) is a
    path (a video, a frame folder or an image, relative to the file's folder) or the bytes of
    a video or an image (:func:`~impasto.data.sources.parquet_scan`); a video's bytes are
    probed from their row (:class:`~impasto.data.sources.ParquetRowBlob`), the probe kept by
    the file's identity and the row. Image bytes are one-frame samples."""
    rows = parquet_scan(path, media=("video", "image"))
    return _probed_in_order(rows, index_file(index_dir, path))


def _probed_in_order(rows: Scan, index: Path) -> Scan:
    """``rows`` with each video probed (:func:`probed_scan`), in their order: a blob of an
    image's bytes stays an image record; those that do not decode are left out and listed."""
    stats: dict[str, str] = {}
    image_blob = [record.blob is not None and _is_image_blob(record) for record in rows.records]
    videos = [
        ClipRecord(
            record.image_path,
            record.caption,
            record.weight,
            record.blob,
            blob_identity(record.blob, stats),
        )  # fmt: skip
        for record, image in zip(rows.records, image_blob, strict=True)
        if not image
    ]
    probed = probed_scan(videos, rows.skipped, index)
    clips = {str(record.image_path): record for record in probed.records}
    records = [
        record if image else clips.get(str(record.image_path))
        for record, image in zip(rows.records, image_blob, strict=True)
    ]
    return Scan([record for record in records if record is not None], probed.skipped)


def _is_image_blob(record: ImageRecord) -> bool:
    """Whether a blob record holds an image's bytes (a shard's image member, a Parquet
    ``image`` cell), not a video's."""
    if isinstance(record.blob, ParquetRowBlob):
        return record.blob.column == "image"
    return is_image_file(record.image_path)


def blob_identity(blob: Any, stats: dict[str, str]) -> str | None:
    """What must not change for a stored probe of a blob to hold: a local shard's or Parquet
    file's path, size and modification time (``stats`` memoises them per file) and the
    member's or row's place; a remote shard's URL and the member's place (trusted to stay the
    same, as its shard index is); None for another blob (probed every time)."""
    if isinstance(blob, FsspecRangeBlob):
        return f"{blob.url}|{blob.offset}|{blob.size}"
    if isinstance(blob, FileRangeBlob):
        place = f"{blob.offset}|{blob.size}"
    elif isinstance(blob, ParquetRowBlob):
        place = f"{blob.row_group}|{blob.row}|{blob.column}"
    else:
        return None
    if blob.path not in stats:
        stat = Path(blob.path).stat()
        stats[blob.path] = f"{blob.path}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{stats[blob.path]}|{place}"


def clip_shard_scan(source: Any, index_dir: Path) -> Scan:
    """Webdataset tar shards read as clips: each sample's video member (``.mp4``, ``.webm``,
    ``.mov``, ``.m4v``, ``.mkv``, ``.gif``), else its image (a one-frame sample), with its
    caption member, in shard then member order (:func:`~impasto.data.sources.webdataset_scan`
    with :data:`~impasto.data.sources.SHARD_CLIP_SUFFIXES`). Videos are probed from their byte
    ranges, the probes kept in the probe index by shard and member; a member that does not
    decode is left out and listed, with the shards and samples the shard index left out."""
    shards = webdataset_scan(source.path, index_dir, SHARD_CLIP_SUFFIXES)
    return _probed_in_order(shards, index_file(index_dir, source.path))


CLIP_SOURCE_READERS = {
    "folder": clip_folder_scan,
    "manifest": clip_manifest_scan,
    "webdataset": clip_shard_scan,
}
"""``data.source`` → its reader in a video run (``data.video``)."""


def clip_reader(kind: str):
    """The reader of a ``kind`` source in a video run; a one-line error for one that does not
    read clips yet."""
    if kind not in CLIP_SOURCE_READERS:
        raise ValueError(
            f"data.source {kind}: clips are read from folders, manifests and webdataset "
            "shards so far (data.video); list the videos in a .jsonl manifest, or remove "
            "data.video"
        )
    return CLIP_SOURCE_READERS[kind]


def expand_clip_slots(
    records: Sequence[ImageRecord], sampling: ClipSampling
) -> tuple[list[ImageRecord], list[Skipped]]:
    """Each video record as its clip slots (module docstring); a video too short for
    ``min_frames`` at the sample rate is left out with the reason. Images stay one record."""
    expanded: list[ImageRecord] = []
    skipped: dict[str, Skipped] = {}
    for record in records:
        if record.clip is None:
            expanded.append(record)
            continue
        info = record.clip.info
        grid = frame_grid(info, sampling)
        length = clip_length(len(grid), sampling)
        if length == 0:
            name = str(record.image_path)
            skipped[name] = Skipped(SCANNED, name, (
                f"{len(grid)} frames at the sample rate, fewer than data.video.min_frames "
                f"{sampling.min_frames}; lower it or remove the clip"))  # fmt: skip
            continue
        count = min(sampling.clips_per_video, len(grid) // length)
        key = len(expanded)
        expanded.extend(
            replace(record, clip=ClipSlot(info, slot, count, length, key)) for slot in range(count)
        )
    return expanded, list(skipped.values())


def run_clip_slots(
    video: Any, records: Sequence[ImageRecord]
) -> tuple[list[ImageRecord], list[Skipped]]:
    """A run's records: with ``data.video`` (``video``), each video as its clip slots
    (:func:`expand_clip_slots`) and the videos too short for one; else unchanged."""
    if video is None:
        return list(records), []
    return expand_clip_slots(records, clip_sampling(video))


def frames_of(records: Sequence[ImageRecord]) -> list[int]:
    """Frames of each record's samples: its clips' length, 1 for an image."""
    return [1 if record.clip is None else record.clip.num_frames for record in records]


def sample_shapes(
    records: Sequence[ImageRecord], bucket_of: Sequence[tuple[int, int] | None] | None,
    resolution: int,
) -> list[tuple[int, int, int] | None]:  # fmt: skip
    """Each sample's ``(frames, height, width)``: its bucket (or the ``resolution`` square),
    with its clip's frames (1 for an image); None where no bucket takes it."""
    sizes = bucket_of if bucket_of is not None else [(resolution, resolution)] * len(records)
    return [
        None if size is None else (frames, *size)
        for frames, size in zip(frames_of(records), sizes, strict=True)
    ]


def clip_frame_indices(
    record: ImageRecord, sampling: ClipSampling, seed: int, epoch: int
) -> tuple[int, ...]:
    """The decoded frames record ``record`` (a clip slot) trains on in ``epoch``."""
    slot = record.clip
    clips = sample_clips(slot.info, sampling, seed, epoch, slot.key)
    return clips[slot.slot]


def clip_frames(record: ImageRecord, indices: Sequence[int]) -> list[Image.Image]:
    """The frames ``indices`` of a clip record, as RGB images (UnreadableClip if they no
    longer decode)."""
    source = record.blob if record.blob is not None else record.image_path
    frames = decode_frames(source, indices, str(record.image_path))
    return [Image.fromarray(frame.numpy()) for frame in frames]


def stack_frames(frames: Sequence[torch.Tensor]) -> torch.Tensor:
    """Transformed frames ``[3, H, W]`` each → the clip ``[3, T, H, W]``."""
    return torch.stack(list(frames), dim=1)


__all__ = [
    "CLIP_SOURCE_READERS",
    "ClipSlot",
    "UnreadableClip",
    "blob_identity",
    "clip_folder_scan",
    "clip_shard_scan",
    "clip_manifest_scan",
    "clip_parquet_scan",
    "clip_frame_indices",
    "clip_frames",
    "clip_reader",
    "clip_sampling",
    "expand_clip_slots",
    "frames_of",
    "run_clip_slots",
    "sample_shapes",
    "stack_frames",
]
