"""Data: image folders, SDXL preprocessing, a resumable batch order, and the demo dataset.

Entry point for the trainer: :func:`build_dataloader`. See :mod:`impasto.data.sampler` for how
to record and restore the data position exactly.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Sequence

from torch.utils.data import DataLoader

from impasto.data.cache import CachedEncodings
from impasto.data.captions import CaptionTools
from impasto.data.dataset import (
    Batch,
    Example,
    ImageCaptionDataset,
    collate_examples,
)
from impasto.data.demo import (
    DEMO_BACKGROUNDS,
    DEMO_COLORS,
    DEMO_SHAPES,
    DemoSpec,
    demo_caption,
    demo_spec,
    render_demo_image,
    write_demo_dataset,
)
from impasto.data.folder import (
    IMAGE_EXTENSIONS,
    ImageRecord,
    read_caption,
    read_manifest,
    scan_image_folder,
)
from impasto.data.sampler import (
    BatchPosition,
    ResumableBatchSampler,
    SampleKey,
    epoch_order,
)
from impasto.data.seeding import derive_seed
from impasto.data.skips import Skipped
from impasto.data.transforms import CROP_MODES, pil_to_tensor, resize_and_crop
from impasto.data.video.sampling import ClipSampling

__all__ = [
    "CROP_MODES",
    "DEMO_BACKGROUNDS",
    "DEMO_COLORS",
    "DEMO_SHAPES",
    "IMAGE_EXTENSIONS",
    "Batch",
    "BatchPosition",
    "DemoSpec",
    "Example",
    "ImageCaptionDataset",
    "ImageRecord",
    "ResumableBatchSampler",
    "SampleKey",
    "Skipped",
    "build_dataloader",
    "collate_examples",
    "demo_caption",
    "demo_spec",
    "derive_seed",
    "epoch_order",
    "pil_to_tensor",
    "read_caption",
    "read_manifest",
    "render_demo_image",
    "resize_and_crop",
    "scan_image_folder",
    "training_sampler",
    "write_demo_dataset",
]


def training_sampler(
    num_samples: int,
    batch_size: int,
    seed: int,
    start_position: BatchPosition | tuple[int, int] = (0, 0),
    bucket_of: Sequence[tuple[int, int] | None] | None = None,
    rank: int = 0,
    world_size: int = 1,
    tokens_of: Sequence[int | None] | None = None,
    pack_tokens: int | None = None,
) -> ResumableBatchSampler:
    """The batch order of training: shuffled per epoch, every batch full, no image left out
    (a short last batch is filled with images the epoch already showed), by bucket if given;
    rank ``rank`` of ``world_size`` loads its share of every step; with ``pack_tokens``, a
    batch is a pack of images by ``tokens_of`` (:mod:`impasto.data.packing`)."""
    return ResumableBatchSampler(
        num_samples=num_samples,
        batch_size=batch_size,
        seed=seed,
        shuffle=True,
        drop_last=False,
        fill_last=True,
        start_position=start_position,
        bucket_of=bucket_of,
        rank=rank,
        world_size=world_size,
        tokens_of=tokens_of,
        pack_tokens=pack_tokens,
    )


def ignore_stop_signals(worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: the main process owns shutdown, so a worker
    ignores SIGINT (Ctrl-C reaches the whole foreground process group) and every SIGTERM
    except its parent's (Slurm signals every process of the job; the main process then saves
    a checkpoint and stops its loader, which needs its workers alive).

    A SIGTERM from the parent still ends the worker, as torch's own handler does: it is how
    ``multiprocessing`` stops daemonic workers a main process leaves behind at exit, which would
    otherwise hang there. The signal is blocked and taken by a thread that reads its sender
    (``sigwaitinfo``); where that does not exist (macOS), SIGTERM keeps its default.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = multiprocessing.parent_process()  # the loader's process, even under forkserver
    main = os.getppid() if parent is None else parent.pid
    threading.Thread(target=_await_parent_sigterm, args=(main,), daemon=True).start()


def _await_parent_sigterm(parent: int) -> None:
    """Take every SIGTERM sent to this worker; exit on the parent's."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # a clean exit: torch reports a worker killed by a signal as a failure


def build_dataloader(
    records: Sequence[ImageRecord],
    resolution: int,
    crop: str,
    random_flip: bool,
    batch_size: int,
    seed: int,
    num_workers: int = 0,
    start_position: BatchPosition | tuple[int, int] = (0, 0),
    pin_memory: bool = False,
    caption_dropout: float = 0.0,
    bucket_of: Sequence[tuple[int, int] | None] | None = None,
    caption_tools: CaptionTools | None = None,
    loss_weights: Sequence[float] | None = None,
    rank: int = 0,
    world_size: int = 1,
    cache: CachedEncodings | None = None,
    caption_variants: int | None = None,
    tokens_of: Sequence[int | None] | None = None,
    pack_tokens: int | None = None,
    video: ClipSampling | None = None,
    sample_keys: Sequence[tuple[int, ...] | None] | None = None,
) -> tuple[DataLoader, ResumableBatchSampler]:
    """A shuffling, exactly resumable loader of :class:`Batch` (empty when all were skipped).

    Each ``iter(loader)`` yields the rest of the sampler's current epoch, starting at its
    position; every batch is full (a short last batch is filled with images the epoch already
    showed, so no image is left out). The trainer calls ``sampler.advance()`` once
    per yielded item and checkpoints ``sampler.state_dict()``; the loader's own prefetching is
    never mistaken for consumption (see :mod:`impasto.data.sampler`).

    Args:
        records: the examples, e.g. ``scan_image_folder(root)``.
        resolution: side of the square training images.
        crop: "center" or "random".
        random_flip: flip horizontally with probability 0.5.
        batch_size: examples per batch (before dropping unreadable files).
        seed: run seed for the order and the augmentations.
        num_workers: loader worker processes; results are identical for any value. Workers
            ignore SIGINT and SIGTERM (:func:`ignore_stop_signals`).
        start_position: ``(epoch, batch_in_epoch)`` of the first batch to load.
        pin_memory: pin batches in host memory (for faster, asynchronous GPU copies).
        caption_dropout: probability of training an example with the empty caption.
        bucket_of: each record's aspect bucket (:mod:`impasto.data.buckets`); ``None`` entries
            are left out. Without it, every image is a ``resolution`` square.
        caption_tools: tag shuffle / dropout / prefix and suffix (:mod:`impasto.data.captions`).
        loss_weights: each record's loss weight, carried to ``Batch.loss_weights``.
        rank, world_size: this process's share of every step (``batch_size`` images each).
        cache: read latents and/or text encodings from the disk cache (:mod:`.cache`).
        caption_variants: see :class:`ImageCaptionDataset` (None: the cache's setting).
        tokens_of, pack_tokens: batches are packs (see :func:`training_sampler`).
        video: records are clips and images, cut as this says (``data.video``).
        sample_keys: what batches group by, over ``bucket_of`` (a video run: each sample's
            ``(frames, height, width)``); ``None`` entries are left out.

    Returns:
        ``(loader, sampler)``.
    """
    if num_workers < 0:
        raise ValueError(f"data: num_workers must be >= 0, got {num_workers}")
    dataset = ImageCaptionDataset(
        records,
        resolution,
        crop,
        random_flip,
        seed,
        caption_dropout,
        bucket_of,
        caption_tools,
        loss_weights,
        cache,
        caption_variants,
        video,
    )
    keys = sample_keys if sample_keys is not None else bucket_of
    sampler = training_sampler(
        len(dataset), batch_size, seed, start_position, keys, rank, world_size,
        tokens_of, pack_tokens,
    )  # fmt: skip
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_examples,
        num_workers=num_workers,
        # Workers hold no random state (every draw is derived from (seed, epoch, index)), so
        # keeping them alive across epochs only saves start-up time.
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
    )
    return loader, sampler
