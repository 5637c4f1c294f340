"""Packs: images of different bucket shapes as one token sequence of fixed capacity
(``data.pack_tokens``), for families that attend within each image of a pack (the diffusion
transformer).

Each epoch, the placed images are shuffled (``derive_seed(seed, epoch)``), sorted by token
count, largest first (stable, so equal sizes keep the shuffled order), and placed first-fit:
each image goes into the first pack with room for it (first-fit-decreasing, Johnson 1973).
The packs are then shuffled. Every epoch has the same multiset of sizes, so the same pack
layout and number of packs, with different images in them: the plan is a pure function of
``(seed, epoch)``, the resumable sampler's contract (:mod:`impasto.data.sampler`), and does not
depend on the number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from impasto.data.seeding import derive_seed


@dataclass(frozen=True)
class PackLayout:
    """How an epoch's images fill packs: the number of packs and the tokens in use."""

    num_packs: int
    capacity: int
    num_tokens: int  # tokens of every placed image

    @property
    def utilisation(self) -> float:
        """The share of the packs' capacity that holds image tokens."""
        return self.num_tokens / (self.num_packs * self.capacity)


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Positions of ``sizes`` (already sorted, largest first) grouped into packs of at most
    ``capacity``, first-fit. Few distinct sizes (buckets) make this linear: for each size, the
    first pack that may fit it only moves forward as packs fill."""
    packs: list[list[int]] = []
    free: list[int] = []
    first_with_room: dict[int, int] = {}
    for position, size in enumerate(sizes):
        if size > capacity:
            raise ValueError(
                f"data.pack_tokens: an image of {size} tokens does not fit a pack of "
                f"{capacity}; raise data.pack_tokens or use smaller buckets"
            )
        pack = first_with_room.get(size, 0)
        while pack < len(free) and free[pack] < size:
            pack += 1
        first_with_room[size] = pack
        if pack == len(free):
            packs.append([])
            free.append(capacity)
        packs[pack].append(position)
        free[pack] -= size
    return packs


def pack_layout(tokens_of: Sequence[int | None], capacity: int) -> PackLayout:
    """The layout every epoch of ``tokens_of`` (each image's tokens; None: not placed) has."""
    sizes = sorted((tokens for tokens in tokens_of if tokens is not None), reverse=True)
    if not sizes:
        raise ValueError("data: no image fits any bucket; see the bucket report")
    return PackLayout(len(first_fit_decreasing(sizes, capacity)), capacity, sum(sizes))


def plan_packs(
    tokens_of: Sequence[int | None], capacity: int, seed: int, epoch: int
) -> list[list[int]]:
    """The packs of epoch ``epoch``, as lists of dataset indices, in training order (see the
    module docstring); images whose ``tokens_of`` entry is None are left out."""
    placed = [index for index, tokens in enumerate(tokens_of) if tokens is not None]
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    order = [placed[i] for i in torch.randperm(len(placed), generator=generator).tolist()]
    order.sort(key=lambda index: -tokens_of[index])  # stable: ties keep the shuffled order
    positions = first_fit_decreasing([tokens_of[index] for index in order], capacity)
    packs = [[order[position] for position in pack] for pack in positions]
    return [packs[i] for i in torch.randperm(len(packs), generator=generator).tolist()]
