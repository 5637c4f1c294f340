"""The image-caption dataset, its examples and batches.

Every random choice for an example comes from a generator seeded by
``derive_seed(seed, epoch, index)``, so an example is the same in any worker process, with any
number of workers, and after a resume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch.utils.data import Dataset

from impasto.data.buckets import BucketCrop, ImageTransform, apply_bucket_transform
from impasto.data.cache import CachedEncodings
from impasto.data.captions import CaptionTools
from impasto.data.folder import ImageRecord
from impasto.data.sampler import BatchPosition
from impasto.data.seeding import derive_seed
from impasto.data.skips import Reencoded, Skipped, error_reason, text_embedding_name
from impasto.data.transforms import IMAGE_LOAD_ERRORS, get_crop_offsets
from impasto.data.video.clip_cache import cached_sample
from impasto.data.video.frames import UnreadableClip
from impasto.data.video.records import clip_frame_indices, clip_frames, stack_frames
from impasto.data.video.sampling import ClipSampling

logger = logging.getLogger(__name__)


@dataclass
class Example:
    """One preprocessed image and its SDXL micro-conditioning.

    Attributes:
        pixel_values: float32 ``[3, R, R]`` in ``[-1, 1]``; None when the latents came from
            the cache.
        caption: the caption text ("" for none).
        original_size: ``(height, width)`` of the file before resizing.
        crop_top_left: ``(top, left)`` of the crop in the resized image.
        index: position of the record in the dataset's record list.
        epoch: epoch the example was drawn for (it fixes the augmentation).
        position: the batch the example belongs to, when the key carried it.
        loss_weight: this example's loss weight, or None (weight 1).
        target_size: ``(height, width)`` of the training image (the square or the bucket).
        latent_mean, latent_std: the VAE posterior ``[C, h, w]`` from the cache, or None.
        prompt_embeds, pooled_prompt_embeds: the caption's encoding from the cache, or None.
        reencoded: the caption's cached encoding was damaged (it is encoded on the fly, as one
            that is not cached), or None.
        clip_start: a video run's sample: the first decoded frame of its clip (-1 for an
            image, whose ``pixel_values`` are one frame ``[3, 1, H, W]``); None in an image run.
    """

    pixel_values: torch.Tensor | None
    caption: str
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    index: int
    epoch: int = 0
    position: BatchPosition | None = None
    loss_weight: float | None = None
    target_size: tuple[int, int] | None = None
    latent_mean: torch.Tensor | None = None
    latent_std: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    reencoded: Reencoded | None = None
    clip_start: int | None = None


class ImageCaptionDataset(Dataset):
    """Images and captions from a list of :class:`ImageRecord`, preprocessed for SDXL.

    Indexed with ``(epoch, index)`` or a :class:`~impasto.data.sampler.SampleKey`
    ``(epoch, index, step_epoch, step_batch)``; returns an :class:`Example`, or a
    :class:`Skipped` naming the image and the reason when it cannot be used (an unreadable
    file, a missing or mismatched cache entry; a warning is logged), so one bad file never
    stops a run.

    Args:
        records: the examples, e.g. from :func:`~impasto.data.folder.scan_image_folder`.
        resolution: side of the square training images.
        crop: "center" or "random" (see :data:`~impasto.data.transforms.CROP_MODES`).
        random_flip: flip horizontally with probability 0.5.
        seed: run seed; example ``index`` of ``epoch`` uses ``derive_seed(seed, epoch, index)``.
        caption_dropout: probability of replacing the caption with "" (the unconditional
            prompt that classifier-free guidance needs; Ho & Salimans 2022, arXiv:2207.12598).
        bucket_of: each record's aspect bucket ``(height, width)``; given, an image becomes
            its bucket's size (:func:`~impasto.data.buckets.bucket_transform_params`) instead
            of a ``resolution`` square.
        caption_tools: tag shuffle / dropout / prefix (:mod:`impasto.data.captions`).
        loss_weights: each record's loss weight (e.g. tag frequency), carried to the batch.
        cache: encodings from the on-disk cache (:mod:`impasto.data.cache`). With cached
            latents no image is decoded: the transform is drawn from the stored image size
            exactly as it would be from the pixels, and a missing or mismatched entry is
            skipped like an unreadable image (nor is a clip's frame:
            :mod:`~impasto.data.video.clip_cache`). With cached text, each example carries
            its caption's encoding (a caption missing from the cache is encoded on the fly; so
            is one whose entry is damaged, and the example says so: ``Example.reencoded``).
        caption_variants: with random caption tools, train epoch ``e`` with variant
            ``e % caption_variants`` of each caption (what a text cache holds); None: the
            cache's setting when it holds text, else 0 (every caption augmented afresh).
            ``impasto data preview`` sets it to show a cached run's captions without a cache.
    """

    def __init__(
        self,
        records: Sequence[ImageRecord],
        resolution: int,
        crop: str,
        random_flip: bool,
        seed: int,
        caption_dropout: float = 0.0,
        bucket_of: Sequence[tuple[int, int] | None] | None = None,
        caption_tools: CaptionTools | None = None,
        loss_weights: Sequence[float] | None = None,
        cache: CachedEncodings | None = None,
        caption_variants: int | None = None,
        video: ClipSampling | None = None,
    ) -> None:
        if not records:
            raise ValueError("data: the record list is empty; point the dataset at some images")
        if resolution <= 0:
            raise ValueError(f"data: resolution must be positive, got {resolution}")
        get_crop_offsets(crop)  # fail on an unknown crop now, not inside a worker
        self.records = list(records)
        self.resolution = resolution
        self.crop = crop
        self.random_flip = random_flip
        self.seed = seed
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"data.caption_dropout: must be in [0, 1], got {caption_dropout}")
        self.caption_dropout = caption_dropout
        self.bucket_of = None if bucket_of is None else list(bucket_of)
        self.transform = ImageTransform(resolution, crop, random_flip, bucket_of is not None)
        self.caption_tools = caption_tools or CaptionTools()
        self.loss_weights = None if loss_weights is None else list(loss_weights)
        self.cache = cache
        self.warned: set[str] = set()  # items logged already (this process: once, not per epoch)
        if caption_variants is None:
            text_cached = cache is not None and cache.text_fingerprint is not None
            caption_variants = cache.caption_variants if text_cached else 0
        self.caption_variants = caption_variants if self.caption_tools.random else 0
        self.video = video
        # (record, first frame or -1) -> True when the training process has the latents of
        # that image or clip already (cache.latents: memory); its pixels are then not read
        # (impasto.train.memo.skip_memoised_pixels; only with the loader in that process)
        self.memoised: Callable[[int, int], bool] | None = None

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: tuple[int, ...]) -> Example | Skipped:
        epoch, index = int(key[0]), int(key[1])
        position = BatchPosition(int(key[2]), int(key[3])) if len(key) > 3 else None
        record = self.records[index]
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, index))
        bucket = None if self.bucket_of is None else self.bucket_of[index]
        pixel_values, posterior, clip_start = None, None, None
        if self.cache is not None and self.cache.vae_fingerprint is not None:
            image_id = self.cache.image_ids[index]
            if image_id is None:
                return self.skip(index, "unreadable when the cache was filled")
            params = self.transform.params(image_id.height, image_id.width, bucket, generator)
            if self.video is None:
                posterior = self.cache.posterior(image_id, params)
            else:  # a clip's posterior [z, t, h, w] (an image's [z, 1, h, w]) and first frame
                found = cached_sample(self.cache, record, image_id, params, self.video, self.seed)
                posterior, clip_start = found
            if isinstance(posterior, str):
                return self.skip(index, posterior)
        elif record.clip is not None:
            try:
                params, pixel_values, clip_start = self.load_clip(
                    record, epoch, bucket, generator, index
                )
            except UnreadableClip as error:
                return self.skip(index, error.reason)
        else:
            try:
                with record.open_image() as image:
                    # Image.open reads only the header; load() decodes (a truncated file fails).
                    params = self.transform.params(image.height, image.width, bucket, generator)
                    if self.memoised is not None and self.memoised(index, -1):
                        pixel_values = unread(3, *params.target_size)
                    else:
                        image.load()
                        pixel_values = apply_bucket_transform(image, params)
            except IMAGE_LOAD_ERRORS as error:
                return self.skip(index, f"unreadable image: {error_reason(error)}")
            if self.video is not None:  # an image in a video run: a one-frame clip
                pixel_values, clip_start = pixel_values[:, None], -1
        caption = self.caption(record.caption, epoch, index, generator)
        prompt, reencoded = None, None
        if self.cache is not None and self.cache.text_fingerprint is not None:
            prompt = self.cache.prompt(caption)
            if isinstance(prompt, str):
                reencoded, prompt = self.reencode(index, caption, prompt), None
        return Example(
            pixel_values=pixel_values,
            caption=caption,
            original_size=params.original_size,
            crop_top_left=params.crop_top_left,
            index=index,
            epoch=epoch,
            position=position,
            loss_weight=None if self.loss_weights is None else self.loss_weights[index],
            target_size=params.target_size,
            latent_mean=None if posterior is None else posterior[0],
            latent_std=None if posterior is None else posterior[1],
            prompt_embeds=None if prompt is None else prompt[0],
            pooled_prompt_embeds=None if prompt is None else prompt[1],
            reencoded=reencoded,
            clip_start=clip_start,
        )

    def load_clip(
        self, record: ImageRecord, epoch: int, bucket: tuple[int, int] | None,
        generator: torch.Generator, index: int,
    ) -> tuple[BucketCrop, torch.Tensor, int]:  # fmt: skip
        """A clip record's transform (drawn as an image's: one for every frame), its frames
        ``[3, T, H, W]`` for ``epoch``, and its first frame's index."""
        info = record.clip.info
        params = self.transform.params(info.height, info.width, bucket, generator)
        indices = clip_frame_indices(record, self.video, self.seed, epoch)
        if self.memoised is not None and self.memoised(index, indices[0]):
            return params, unread(3, len(indices), *params.target_size), indices[0]
        frames = [apply_bucket_transform(frame, params) for frame in clip_frames(record, indices)]
        return params, stack_frames(frames), indices[0]

    def skip(self, index: int, reason: str) -> Skipped:
        name = str(self.records[index].image_path)
        if name not in self.warned:
            self.warned.add(name)
            logger.warning("data: skipping %s: %s", name, reason)
        return Skipped(index, name, reason)

    def reencode(self, index: int, caption: str, reason: str) -> Reencoded:
        """The note that ``caption``'s cached encoding is damaged (the caption is encoded on the
        fly): logged once per caption in this process, reported by the run."""
        name = text_embedding_name(caption)
        if name not in self.warned:
            self.warned.add(name)
            logger.warning("data: %s: %s", name, reason)
        return Reencoded(index, name, reason)

    def caption(self, caption: str, epoch: int, index: int, generator: torch.Generator) -> str:
        """The caption record ``index`` trains with in ``epoch``: dropped (drawn after the
        transform, so the dropout setting never changes the augmentation), else augmented by
        the caption tools; with cached text and random tools, variant ``epoch % variants``."""
        if torch.rand((), generator=generator).item() < self.caption_dropout:
            return ""
        if self.caption_variants:
            variant = epoch % self.caption_variants
            return self.caption_tools.variant(caption, self.seed, variant, index)
        return self.caption_tools.apply(caption, generator)


@dataclass
class Batch:
    """A collated batch of ``B`` good examples (bad files already dropped; ``B`` may be 0).

    Attributes:
        pixel_values: float32 ``[B, 3, R, R]`` (or the bucket's ``[B, 3, H, W]``) in ``[-1, 1]``;
            None when the latents came from the cache.
        captions: ``B`` caption strings.
        original_sizes: int64 ``[B, 2]`` of ``(height, width)`` before resizing.
        crop_top_lefts: int64 ``[B, 2]`` of ``(top, left)``.
        target_sizes: int64 ``[B, 2]``: ``(R, R)``, or the batch's bucket ``(height, width)``.
        indices: int64 ``[B]`` dataset indices, for logging and debugging.
        num_bad: examples of this batch dropped as unusable (the run's data stream keeps only
            the items it had not met before: each bad item counts once; ``skipped`` likewise).
            A re-encoded text embedding is not one of them.
        position: where this batch sits in the run; equals ``sampler.position`` before the
            trainer's ``advance()`` for it. ``None`` if the keys had no batch position.
        loss_weights: float32 ``[B]`` per-sample loss weights (e.g. tag frequency), or ``None``.
        loss_masks: float32 ``[B, 1, R, R]`` in [0, 1] (where the loss counts), or ``None``.
        latent_mean, latent_std: cached VAE posteriors ``[B, C, h, w]`` (storage dtype), or None.
        prompt_embeds, pooled_prompt_embeds: cached text encodings, or None (encode on the fly).
        skipped: the dropped examples, with names and reasons.
        groups: a pack of several image sizes (``data.pack_tokens``): one batch per size, the
            image tensors there (here None); the rows here are theirs, in their order.
        reencoded: the cached text embeddings of this batch's captions that were damaged, so
            encoded on the fly (their examples are in the batch; the data stream keeps the
            ones it had not met before, like ``skipped``).
        clip_starts: a video run's batch (``pixel_values`` ``[B, 3, T, H, W]``): int64 ``[B]``,
            each clip's first decoded frame (-1 for an image); None in an image run.
    """

    pixel_values: torch.Tensor | None
    captions: list[str]
    original_sizes: torch.Tensor
    crop_top_lefts: torch.Tensor
    target_sizes: torch.Tensor
    indices: torch.Tensor
    num_bad: int = 0
    position: BatchPosition | None = None
    loss_weights: torch.Tensor | None = None
    loss_masks: torch.Tensor | None = None
    latent_mean: torch.Tensor | None = None
    latent_std: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    skipped: tuple[Skipped, ...] = ()
    reencoded: tuple[Reencoded, ...] = ()
    groups: tuple[Batch, ...] | None = None
    clip_starts: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of examples ``B``."""
        return len(self.captions)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor moved to ``device``."""
        moved = {
            field.name: getattr(self, field.name).to(device, non_blocking=non_blocking)
            for field in fields(self)
            if isinstance(getattr(self, field.name), torch.Tensor)
        }
        if self.groups is not None:
            moved["groups"] = tuple(group.to(device, non_blocking) for group in self.groups)
        return replace(self, **moved)

    def shape_groups(self) -> tuple[Batch, ...]:
        """The batch as batches of one image size each: ``groups`` of a pack, else itself."""
        return self.groups if self.groups is not None else (self,)

    def pin_memory(self) -> Batch:
        """A copy in pinned host memory; ``DataLoader(pin_memory=True)`` calls this."""
        pinned = {
            field.name: getattr(self, field.name).pin_memory()
            for field in fields(self)
            if isinstance(getattr(self, field.name), torch.Tensor)
        }
        if self.groups is not None:
            pinned["groups"] = tuple(group.pin_memory() for group in self.groups)
        return replace(self, **pinned)


def _stack(examples: Sequence[Example], name: str) -> torch.Tensor | None:
    """The examples' ``name`` tensors stacked, or None unless every example has one."""
    values = [getattr(example, name) for example in examples]
    return None if any(value is None for value in values) else torch.stack(values)


def _loss_weights(examples: Sequence[Example]) -> torch.Tensor | None:
    weights = [example.loss_weight for example in examples]
    if all(weight is None for weight in weights):
        return None
    return torch.tensor([1.0 if w is None else w for w in weights], dtype=torch.float32)


def unread(*shape: int) -> torch.Tensor:
    """Zeros of ``shape`` without their memory (an expanded scalar): the pixels of an image
    whose latents the training process memoised, which nothing reads."""
    return torch.zeros(()).expand(*shape)


def collate_examples(examples: Sequence[Example | Skipped]) -> Batch:
    """Stack examples into a :class:`Batch`, dropping the :class:`Skipped` ones.

    When every example was skipped the batch is empty (``size == 0``, no tensors to train on);
    the trainer skips it but still counts it as consumed (see :mod:`impasto.data.sampler`).
    """
    good = [example for example in examples if isinstance(example, Example)]
    skipped = tuple(example for example in examples if isinstance(example, Skipped))
    if not good:
        empty = torch.zeros(0, 2, dtype=torch.long)
        return Batch(None, [], empty, empty, empty, torch.zeros(0, dtype=torch.long),
                     num_bad=len(skipped), skipped=skipped)  # fmt: skip
    target_sizes = {example.target_size for example in good}
    if len({sample_shape(example) for example in good}) > 1:  # a pack: a sub-batch per shape
        return _collate_groups(good, skipped)
    positions = {example.position for example in good}
    assert len(positions) == 1, f"examples from different batches collated together: {positions}"
    return Batch(
        pixel_values=_stack(good, "pixel_values"),
        captions=[example.caption for example in good],
        original_sizes=torch.tensor([example.original_size for example in good], dtype=torch.long),
        crop_top_lefts=torch.tensor([example.crop_top_left for example in good], dtype=torch.long),
        target_sizes=torch.tensor([target_sizes.pop()] * len(good), dtype=torch.long),
        indices=torch.tensor([example.index for example in good], dtype=torch.long),
        num_bad=len(skipped),
        position=positions.pop(),
        loss_weights=_loss_weights(good),
        latent_mean=_stack(good, "latent_mean"),
        latent_std=_stack(good, "latent_std"),
        prompt_embeds=_stack(good, "prompt_embeds"),
        pooled_prompt_embeds=_stack(good, "pooled_prompt_embeds"),
        skipped=skipped,
        reencoded=tuple(example.reencoded for example in good if example.reencoded is not None),
        clip_starts=_clip_starts(good),
    )


def sample_shape(example: Example) -> tuple[object, ...]:
    """What a batch of one shape shares: the target size, and a clip's frames."""
    frames = None if example.pixel_values is None else example.pixel_values.shape[1:-2]
    if example.latent_mean is not None:
        frames = example.latent_mean.shape[1:-2]
    return example.target_size, tuple(frames or ())


def _clip_starts(examples: Sequence[Example]) -> torch.Tensor | None:
    starts = [example.clip_start for example in examples]
    return None if starts[0] is None else torch.tensor(starts, dtype=torch.long)


def _collate_groups(good: list[Example], skipped: tuple[Skipped, ...]) -> Batch:
    """A batch of several image sizes: ``groups`` holds one batch per size (in order of first
    appearance); the batch itself lists every row in that order, without image tensors."""
    by_size: dict[tuple[object, ...], list[Example]] = {}
    for example in good:
        by_size.setdefault(sample_shape(example), []).append(example)
    groups = tuple(collate_examples(members) for members in by_size.values())
    rows = [example for members in by_size.values() for example in members]
    bare = [
        replace(example, target_size=(0, 0), pixel_values=None, latent_mean=None, latent_std=None)
        for example in rows
    ]
    whole = collate_examples(bare)
    return replace(
        whole,
        pixel_values=None,
        target_sizes=torch.cat([group.target_sizes for group in groups]),
        latent_mean=None,
        latent_std=None,
        num_bad=len(skipped),
        skipped=skipped,
        groups=groups,
    )
