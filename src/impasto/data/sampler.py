"""An exactly resumable batch order.

Each epoch's order is a pure function of ``(seed, epoch)``, so any position in the run can be
rebuilt from two integers, :class:`BatchPosition` ``(epoch, batch_in_epoch)``.

Why the trainer, not the iterator, owns the position: a ``DataLoader`` pulls index batches from
its batch sampler ahead of time (``prefetch_factor * num_workers`` batches), so how far the
sampler has been iterated says nothing about which batches were trained on. The sampler
therefore never moves its own :attr:`ResumableBatchSampler.position` while iterating. The
trainer calls :meth:`ResumableBatchSampler.advance` once for every item the loader yields (a
``None`` from an all-bad batch included) and saves :meth:`~ResumableBatchSampler.state_dict`
in its checkpoints. Each batch also records its own :class:`BatchPosition` (``Batch.position``),
which equals ``sampler.position`` just before the matching ``advance()``.

Typical loop::

    sampler.load_state_dict(checkpoint["data"])       # or start at (0, 0)
    while sampler.position.epoch < num_epochs:
        for batch in loader:                          # the rest of the current epoch
            sampler.advance()                         # this batch is consumed
            if batch.size == 0:                       # every image in it was unusable
                continue
            train_step(batch)
            save_checkpoint({"data": sampler.state_dict(), ...})

After the last batch of an epoch ``advance()`` moves to ``(epoch + 1, 0)``, so the next
``iter(loader)`` starts the next epoch; a run resumed mid-epoch yields the remaining batches of
that epoch, then epochs identical to an uninterrupted run.

Several ranks (``world_size`` > 1): the run is one endless sequence of per-rank batches (epoch
after epoch, each epoch's plan a pure function of the seed). A step takes the next
``world_size`` of them, rank ``r`` the ``r``-th, and the position counts per-rank batches, so it
means the same for any number of ranks: a run resumed on 1, 2 or 8 ranks continues with the very
next batch. No batch is dropped or repeated at an epoch's end; the step that crosses it takes its
last batches from the next epoch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import NamedTuple

import torch
from torch.utils.data import Sampler

from impasto.data.buckets import fill_batches, plan_bucket_batches
from impasto.data.packing import pack_layout, plan_packs
from impasto.data.seeding import derive_seed


class SampleKey(NamedTuple):
    """What the dataset is indexed with: which image, in which epoch, in which step.

    ``(epoch, index)`` fix the random augmentation; ``(step_epoch, step_batch)`` only travel
    along so that the collated batch can report the :class:`BatchPosition` of its step (with
    several ranks, a step that crosses an epoch's end takes images of the next epoch).
    """

    epoch: int
    index: int
    step_epoch: int
    step_batch: int


@dataclass(frozen=True, order=True)
class BatchPosition:
    """The place of one batch in the run: the ``batch_in_epoch``-th batch of ``epoch``."""

    epoch: int
    batch_in_epoch: int


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """Sample indices ``[num_samples]`` (int64) in the order epoch ``epoch`` visits them.

    With ``shuffle`` the order is ``torch.randperm`` under a generator seeded with
    ``derive_seed(seed, epoch)``; without it, ``0 .. num_samples - 1``.
    """
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def num_batches(num_samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches per epoch: a short last batch is dropped or kept."""
    if drop_last:
        return num_samples // batch_size
    return -(-num_samples // batch_size)


class ResumableBatchSampler(Sampler[list[SampleKey]]):
    """Batches of :class:`SampleKey` for one epoch, starting at :attr:`position`.

    Iterating yields the batches of ``position.epoch`` from ``position.batch_in_epoch`` to the
    end of that epoch; the position is read once when iteration starts and is never changed by
    iterating (see the module docstring for why). Move it with :meth:`advance`,
    :meth:`seek`, :meth:`set_epoch` or :meth:`load_state_dict`.

    Args:
        num_samples: dataset size.
        batch_size: samples per batch.
        seed: run seed; epoch ``e`` is ordered by ``derive_seed(seed, e)``.
        shuffle: shuffle each epoch (otherwise index order).
        drop_last: drop the short last batch of each epoch (keeps every batch full).
        fill_last: with ``drop_last=False``, fill the short last batch with images the epoch
            already showed (drawn from the epoch's generator, distinct while possible): every
            batch full and no image left out of any epoch.
        start_position: where the first iteration starts, ``(epoch, batch_in_epoch)``.
        bucket_of: each sample's aspect bucket (None: not placed). Given, an epoch is
            :func:`~impasto.data.buckets.plan_bucket_batches`: single-bucket batches, a
            bucket's short last batch filled with its other images, nothing dropped.
        rank: this process's rank; it loads the ``rank``-th batch of every step.
        world_size: number of ranks; a step consumes ``world_size`` batches (module docstring).
        tokens_of, pack_tokens: each sample's token count (None: not placed) and a pack's
            capacity; given, a batch is a pack (:func:`~impasto.data.packing.plan_packs`) and
            ``batch_size`` and ``bucket_of`` do not shape the epoch.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        start_position: BatchPosition | tuple[int, int] = (0, 0),
        bucket_of: Sequence[tuple[int, int] | None] | None = None,
        fill_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        tokens_of: Sequence[int | None] | None = None,
        pack_tokens: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"data: rank {rank} is outside world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self._plans: dict[int, list[list[int]]] = {}
        if num_samples <= 0:
            raise ValueError(f"data: the dataset is empty (num_samples={num_samples}); add images")
        if batch_size <= 0:
            raise ValueError(f"data: batch_size must be positive, got {batch_size}")
        if bucket_of is not None and len(bucket_of) != num_samples:
            raise ValueError(f"data: {len(bucket_of)} bucket entries for {num_samples} samples")
        self.bucket_of = None if bucket_of is None else list(bucket_of)
        if self.bucket_of is not None and not any(self.bucket_of):
            raise ValueError("data: no image fits any bucket; see the bucket report")
        if bucket_of is None and drop_last and batch_size > num_samples:
            raise ValueError(
                f"data: {num_samples} images is fewer than batch_size {batch_size}; "
                "lower batch_size or add images"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        if fill_last and drop_last:
            raise ValueError("data: fill_last needs drop_last=False (there is no last batch)")
        self.fill_last = fill_last
        self.tokens_of = None if tokens_of is None else list(tokens_of)
        self.pack_tokens = pack_tokens
        if pack_tokens is not None and self.tokens_of is None:
            raise ValueError("data: packing needs each sample's token count")
        # Counted once: the trainer asks after every batch, and bucket_of may hold millions.
        if pack_tokens is not None:
            self._num_batches = pack_layout(self.tokens_of, pack_tokens).num_packs
        elif self.bucket_of is not None:
            sizes = Counter(bucket for bucket in self.bucket_of if bucket is not None)
            self._num_batches = sum(num_batches(n, batch_size, False) for n in sizes.values())
        else:
            self._num_batches = num_batches(num_samples, batch_size, drop_last)
        self._position = BatchPosition(0, 0)
        self.seek(*start_position_tuple(start_position))

    @property
    def num_batches_per_epoch(self) -> int:
        """Batches in every epoch (with buckets: the sum over buckets of ceil(size / batch))."""
        return self._num_batches

    @property
    def position(self) -> BatchPosition:
        """The next batch the trainer has not consumed yet."""
        return self._position

    def seek(self, epoch: int, batch_in_epoch: int = 0) -> None:
        """Make the next iteration start at batch ``batch_in_epoch`` of ``epoch``.

        ``batch_in_epoch == num_batches_per_epoch`` (the end of an epoch) means ``(epoch + 1, 0)``.
        """
        if epoch < 0 or not 0 <= batch_in_epoch <= self.num_batches_per_epoch:
            raise ValueError(
                f"data: position ({epoch}, {batch_in_epoch}) is outside the run; "
                f"epoch must be >= 0 and batch_in_epoch in 0..{self.num_batches_per_epoch}"
            )
        if batch_in_epoch == self.num_batches_per_epoch:
            epoch, batch_in_epoch = epoch + 1, 0
        self._position = BatchPosition(epoch, batch_in_epoch)

    def at(self, epoch: int, batch_in_epoch: int = 0) -> ResumableBatchSampler:
        """A copy of this sampler positioned at ``(epoch, batch_in_epoch)``."""
        return ResumableBatchSampler(
            self.num_samples,
            self.batch_size,
            self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            start_position=(epoch, batch_in_epoch),
            bucket_of=self.bucket_of,
            fill_last=self.fill_last,
            rank=self.rank,
            world_size=self.world_size,
            tokens_of=self.tokens_of,
            pack_tokens=self.pack_tokens,
        )

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch, unless already inside it.

        A sampler resumed at ``(2, 5)`` keeps batch 5 on ``set_epoch(2)``, so the usual
        ``for epoch in range(start, end): sampler.set_epoch(epoch)`` loop resumes exactly.
        """
        if epoch != self._position.epoch:
            self.seek(epoch, 0)

    def advance(self, num_steps: int = 1) -> BatchPosition:
        """Record that the trainer consumed the next step(s); returns the new position.

        Call it once per item the loader yields, ``None`` items included. A step is
        ``world_size`` batches; crossing the end of an epoch moves into the next one.
        """
        self._position = self.position_after(self._position, num_steps)
        return self._position

    def position_after(self, position: BatchPosition, num_steps: int = 1) -> BatchPosition:
        """Where the run is after ``num_steps`` steps from ``position``."""
        if num_steps < 0:
            raise ValueError(f"data: cannot advance by {num_steps} steps")
        per_epoch = self.num_batches_per_epoch
        absolute = position.epoch * per_epoch + position.batch_in_epoch
        return BatchPosition(*divmod(absolute + num_steps * self.world_size, per_epoch))

    def state_dict(self) -> dict[str, int]:
        """The position plus the settings that fix the order, all plain ints."""
        return {
            "epoch": self._position.epoch,
            "batch_in_epoch": self._position.batch_in_epoch,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
            "bucketed": int(self.bucket_of is not None),
            "fill_last": int(self.fill_last),
            "world_size": self.world_size,  # informative: any number of ranks may resume
            "pack_tokens": self.pack_tokens or 0,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict`.

        Raises ``ValueError`` if the saved order settings differ from this sampler's, because the
        resumed batches would then not match the interrupted run.
        """
        current = self.state_dict()
        names = ("num_samples", "batch_size", "seed", "shuffle", "drop_last", "bucketed")
        for name in (*names, "fill_last", "pack_tokens"):
            if name in state and int(state[name]) != current[name]:
                raise ValueError(
                    f"data: checkpoint has {name}={int(state[name])} but this run has "
                    f"{current[name]}; use the same data settings to resume, or start fresh"
                )
        self.seek(int(state["epoch"]), int(state["batch_in_epoch"]))

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch`` (dataset indices), in order; the last two are kept."""
        if epoch not in self._plans:
            if self.pack_tokens is not None:
                plan = plan_packs(self.tokens_of, self.pack_tokens, self.seed, epoch)
            elif self.bucket_of is not None:
                plan = plan_bucket_batches(self.bucket_of, self.batch_size, self.seed, epoch)
            else:
                order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle).tolist()
                if self.fill_last:
                    generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 1))
                    plan = fill_batches(order, self.batch_size, generator)
                else:
                    size = self.batch_size
                    plan = [order[i : i + size] for i in range(0, len(order), size)]
                    plan = plan[: self.num_batches_per_epoch]
            self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
            self._plans[epoch] = plan
        return self._plans[epoch]

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[list[SampleKey]]:
        """This rank's batches of the steps that start in ``epoch`` at or after ``start``,
        independent of the current position."""
        step = BatchPosition(epoch, start)
        while step.epoch == epoch:
            absolute = step.epoch * self.num_batches_per_epoch + step.batch_in_epoch + self.rank
            batch_epoch, batch = divmod(absolute, self.num_batches_per_epoch)
            indices = self.epoch_plan(batch_epoch)[batch]
            yield [SampleKey(batch_epoch, index, *astuple(step)) for index in indices]
            step = self.position_after(step)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        # Read the position now, not lazily: the trainer calls advance() while the loader is
        # still pulling batches from this iterator.
        return self.epoch_batches(self._position.epoch, self._position.batch_in_epoch)

    def __len__(self) -> int:
        """Steps the next iteration will yield (those starting in the current epoch)."""
        remaining = self.num_batches_per_epoch - self._position.batch_in_epoch
        return -(-remaining // self.world_size)


def start_position_tuple(position: BatchPosition | tuple[int, int]) -> tuple[int, int]:
    """``(epoch, batch_in_epoch)`` from a :class:`BatchPosition` or a pair of ints."""
    if isinstance(position, BatchPosition):
        return position.epoch, position.batch_in_epoch
    epoch, batch_in_epoch = position
    return int(epoch), int(batch_in_epoch)
