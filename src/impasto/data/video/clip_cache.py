"""The disk cache of a video run's latents (``cache.latents: disk`` with ``data.video``;
issue #32): every sample a clip, encoded a chunk of frames at a time.

- **Keys.** :func:`~impasto.data.cache.clip_latent_key`: the clip's content
  (:mod:`impasto.data.video.content`), the decoded frame indices of the sample, the transform
  every frame gets, the VAE's fingerprint and the storage dtype. The indices must be the same
  every epoch, so the run needs ``data.video.placement: even`` (``random`` draws new clips each
  epoch: a cache would hold every possible start of every clip).
- **Images** in a video run are one-frame clips: frame ``(0,)`` of the image, stored
  ``[z, 1, h, w]`` as the denoiser takes them, encoded one at a time as the memory cache
  does (so their posteriors are bitwise those of ``cache.latents: memory``).
- **The fill** encodes one sample at a time through ``Backbone.clip_posterior``: the frames are
  decoded in one pass over the video or frame folder, and handed to the encoder
  :data:`CHUNK_FRAMES` at a time, each transformed as it is read, so a clip of any length holds
  one chunk of transformed frames (and the decoder's current frame), never the whole clip.
- **Training** reads ``[z, t, h, w]`` posteriors (and the clip's first frame) instead of
  decoding; a missing or mismatched entry is skipped, and reported, like an image's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING

import torch
from PIL import Image
from torch import Tensor
from tqdm import tqdm

from impasto.data.buckets import BucketCrop, apply_bucket_transform
from impasto.data.cache import DTYPES, CachedEncodings, ImageId, clip_latent_key
from impasto.data.folder import ImageRecord
from impasto.data.skips import error_reason
from impasto.data.transforms import IMAGE_LOAD_ERRORS
from impasto.data.video.frames import DecodedFrame, DecodingStopped, UnreadableClip, open_frames
from impasto.data.video.records import clip_frame_indices, clip_frames, clip_sampling
from impasto.data.video.sampling import ClipSampling
from impasto.models.backbone import Backbone

if TYPE_CHECKING:
    from impasto.data.cache_fill import CacheFill

CHUNK_FRAMES = 16
"""Frames handed to the encoder at once after the first (a multiple of 4, Wan's step)."""

IMAGE_FRAMES = (0,)
"""The frames of an image in a video run: its one frame."""


def sample_frames(record: ImageRecord, sampling: ClipSampling, seed: int) -> tuple[int, ...]:
    """The decoded frames of a record's sample (the same every epoch with ``placement:
    even``); an image's one frame."""
    if record.clip is None:
        return IMAGE_FRAMES
    return clip_frame_indices(record, sampling, seed, epoch=0)


def sample_pictures(record: ImageRecord, indices: Sequence[int]) -> Iterator[Image.Image]:
    """The frames ``indices`` of a record, in order: an image's one frame, or a clip's frames
    decoded in one pass over the video or frame folder (indices in decoding order; a repeated
    index takes the frame again), converting only the frames asked for. ``UnreadableClip``
    when the clip no longer decodes as far as it was probed."""
    if record.clip is None:
        with record.open_image() as image:
            image.load()
            yield image
        return
    if list(indices) != sorted(indices):  # not in decoding order: a pass for each frame
        for index in indices:
            yield from clip_frames(record, [index])
        return
    name = str(record.image_path)
    source = record.blob if record.blob is not None else record.image_path
    position, decoded, rgb = -1, None, None
    with open_frames(source, name) as frames:
        for index in indices:
            while position < index:
                decoded, rgb = _next_frame(frames, name, position, index), None
                position += 1
            if rgb is None:
                rgb = decoded.rgb()
            yield Image.fromarray(rgb)


def _next_frame(
    frames: Iterator[DecodedFrame], name: str, position: int, wanted: int
) -> DecodedFrame:
    """The frame after ``position``; ``UnreadableClip`` (as ``decode_clips`` says it) where
    the clip ends, or stops decoding, before frame ``wanted``."""
    try:
        frame, reason = next(frames, None), "it ends there"
    except DecodingStopped as stop:
        frame, reason = None, stop.reason
    if frame is None:
        raise UnreadableClip(name, f"decodes {position + 1} frames, not frame {wanted} ({reason}); "
                             "it changed since it was probed: probe it again")  # fmt: skip
    return frame


class ChunkReader:
    """``read_frames`` for ``Backbone.clip_posterior``: the next ``stop − start`` frames of a
    sample (:func:`sample_pictures`), each transformed by ``params``, as ``[1, 3, n, H, W]``
    in [-1, 1]: the frames of one chunk, and nothing of the chunks before."""

    def __init__(self, record: ImageRecord, indices: Sequence[int], params: BucketCrop) -> None:
        self.pictures = sample_pictures(record, indices)
        self.params, self.name = params, str(record.image_path)

    def __call__(self, start: int, stop: int) -> Tensor:
        """Raises ``UnreadableClip`` for a frame that does not read (the encoder's own errors
        pass through)."""
        try:
            pictures = islice(self.pictures, stop - start)
            frames = [apply_bucket_transform(picture, self.params) for picture in pictures]
        except UnreadableClip:
            raise
        except IMAGE_LOAD_ERRORS as error:
            raise UnreadableClip(self.name, f"unreadable: {error_reason(error)}") from None
        return torch.stack(frames, dim=1)[None]

    def close(self) -> None:
        self.pictures.close()


def encode_sample(
    backbone: Backbone, record: ImageRecord, indices: Sequence[int], params: BucketCrop,
    chunk_frames: int = CHUNK_FRAMES,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The posterior (mean, std) ``[z, t, h, w]`` of a record's frames ``indices`` under
    ``params``, read ``chunk_frames`` at a time (module docstring)."""
    reader = ChunkReader(record, indices, params)
    try:
        mean, std = backbone.clip_posterior(reader, len(indices), chunk_frames)
    finally:
        reader.close()
    return mean[0], std[0]


def fill_clip_latents(
    fill: CacheFill, ids: Sequence[ImageId | None],
    bucket_of: Sequence[tuple[int, int] | None] | None, key_fp: str,
) -> None:  # fmt: skip
    """Encode the posterior of every (sample, transform outcome) of a video run not in the
    cache yet, one sample at a time (module docstring); a clip that no longer decodes is
    named in the report and left out (training skips it: not in the cache)."""
    config, report = fill.config, fill.report
    sampling, dtype = clip_sampling(config.data.video), config.cache.dtype
    frames_of = [sample_frames(record, sampling, config.train.seed) for record in fill.records]

    def key_of(index: int, image_id: ImageId, params: BucketCrop) -> str:
        return clip_latent_key(image_id, frames_of[index], params, key_fp, dtype)

    needed, mine = fill.missing_latents(ids, bucket_of, key_of)
    writer = fill.writer("latents")
    progress = tqdm(total=len(mine), desc="cache clips", unit="clip", disable=fill.quiet(mine))
    for key in mine:
        index, params = needed[key]
        record = fill.records[index]
        try:
            with torch.no_grad():
                mean, std = encode_sample(fill.backbone, record, frames_of[index], params)
        except UnreadableClip:
            report.unreadable.append(str(record.image_path))
        else:
            writer.add({f"{key}.mean": mean.to(DTYPES[dtype]), f"{key}.std": std.to(DTYPES[dtype])})
            report.latents_encoded += 1
        progress.update(1)
    progress.close()
    writer.flush()


def cached_sample(
    cache: CachedEncodings, record: ImageRecord, image_id: ImageId, params: BucketCrop,
    sampling: ClipSampling, seed: int,
) -> tuple[tuple[Tensor, Tensor] | str, int]:  # fmt: skip
    """A video run's sample from the cache: its posterior ``[z, t, h, w]`` (or why there is
    none), and its first decoded frame (-1 for an image)."""
    frames = sample_frames(record, sampling, seed)
    return cache.posterior(image_id, params, frames), -1 if record.clip is None else frames[0]
