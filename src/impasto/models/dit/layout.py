"""Tokens of the DiT: patches of latents in (frame, row, column) order, and packs of them.

A sample's latents are an image ``[C, h, w]`` (one frame) or a clip ``[C, F, h, w]`` (F latent
frames, diffusers' and Wan's layout). A token covers ``pt`` frames of ``p × p`` latent pixels
(``model.dit.frame_patch``, ``model.dit.patch_size``): ``(F/pt)·(h/p)·(w/p)`` tokens of
``C·pt·p·p`` values, frame-major then row-major, each token's values channel-major; its
position is its (frame, row, column) patch index. With ``pt = 1`` an image and the same image
as a one-frame clip give the same tokens.

A *pack* lays the tokens of several samples of different shapes end to end in one sequence of
fixed ``capacity`` (padding at the end); ``document`` says which sample each token belongs to,
so attention can stay inside each sample (:mod:`impasto.models.dit.attention`). A
:class:`Partition` says which tokens attend to each other under one layout: a whole sample
(``full``), one frame of a sample (``spatial``), or one patch position of a sample across its
frames (``temporal``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

PACK_MULTIPLE = 128  # FlexAttention's block size: a pack's capacity is a multiple of it


class Grid(NamedTuple):
    """A sample's tokens: ``frames`` × ``rows`` × ``cols`` patches."""

    frames: int
    rows: int
    cols: int

    @property
    def cells(self) -> int:
        """Patch positions per frame."""
        return self.rows * self.cols

    @property
    def num_tokens(self) -> int:
        return self.frames * self.rows * self.cols


def as_grid(grid: Sequence[int]) -> Grid:
    """A :class:`Grid` from (frames, rows, cols), or from an image's (rows, cols)."""
    return Grid(1, *grid) if len(grid) == 2 else Grid(*grid)


def patchify(latents: Tensor, patch: int, frame_patch: int = 1) -> Tensor:
    """An image ``[B, C, h, w]`` → ``[B, (h/p)·(w/p), C·p·p]``, or a clip ``[B, C, F, h, w]`` →
    ``[B, (F/pt)·(h/p)·(w/p), C·pt·p·p]``: patches frame-major, then row-major, each patch's
    values channel-major (``C, p_frame, p_row, p_col``)."""
    if latents.dim() == 4:
        batch, channels, height, width = latents.shape
        grid = latents.reshape(batch, channels, height // patch, patch, width // patch, patch)
        return grid.permute(0, 2, 4, 1, 3, 5).reshape(batch, -1, channels * patch * patch)
    batch, channels, frames, height, width = latents.shape
    grid = latents.reshape(
        batch, channels, frames // frame_patch, frame_patch,
        height // patch, patch, width // patch, patch,
    )  # fmt: skip
    values = channels * frame_patch * patch * patch
    return grid.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(batch, -1, values)


def unpatchify(
    tokens: Tensor, patch: int, channels: int, rows: int, cols: int,
    frames: int | None = None, frame_patch: int = 1,
) -> Tensor:  # fmt: skip
    """The inverse of :func:`patchify`: ``[B, rows·cols, C·p·p]`` → ``[B, C, rows·p, cols·p]``
    (``frames`` None), or ``[B, frames·rows·cols, C·pt·p·p]`` → a clip
    ``[B, C, frames·pt, rows·p, cols·p]``."""
    batch = tokens.shape[0]
    if frames is None:
        grid = tokens.reshape(batch, rows, cols, channels, patch, patch)
        return grid.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, rows * patch, cols * patch)
    grid = tokens.reshape(batch, frames, rows, cols, channels, frame_patch, patch, patch)
    shape = (batch, channels, frames * frame_patch, rows * patch, cols * patch)
    return grid.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(shape)


def grid_positions(rows: int, cols: int, frames: int = 1) -> Tensor:
    """``[frames·rows·cols, 3]`` int64: (frame, row, column) of each token, frame-major, then
    row-major."""
    frame, row, col = torch.meshgrid(
        torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij"
    )
    return torch.stack([frame, row, col], dim=-1).reshape(-1, 3)


def pack_capacity(num_tokens: int, capacity: int | None, multiple: int = 1) -> int:
    """The pack length for ``num_tokens`` tokens: ``capacity`` (ValueError if they do not fit
    or it is not a multiple of ``multiple``), or the next multiple of both
    :data:`PACK_MULTIPLE` and ``multiple``."""
    if capacity is None:
        step = math.lcm(PACK_MULTIPLE, multiple)
        return -(-num_tokens // step) * step
    if num_tokens > capacity:
        raise ValueError(f"a pack of {num_tokens} tokens exceeds its capacity of {capacity}")
    if capacity % multiple:
        raise ValueError(f"a pack of {capacity} tokens does not split into {multiple} parts")
    return capacity


@dataclass(frozen=True)
class Pack:
    """Where each sample of a pack sits in its sequence.

    ``document`` ``[S]`` int64: the sample of each token (0 .. N-1; padding is N);
    ``positions`` ``[S, 3]``: each token's (frame, row, column); ``grids``: each sample's
    :class:`Grid` (frames, rows, cols) of patches, in order; ``num_tokens``: tokens before the
    padding.
    """

    document: Tensor
    positions: Tensor
    grids: tuple[Grid, ...]
    num_tokens: int

    @property
    def num_samples(self) -> int:
        return len(self.grids)

    @property
    def capacity(self) -> int:
        return self.document.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Tokens per sample, in order."""
        return [grid.num_tokens for grid in self.grids]


def plan_pack(
    grids: Sequence[Sequence[int]], capacity: int | None, device: torch.device, multiple: int = 1
) -> Pack:
    """The :class:`Pack` of samples with patch grids ``grids`` (frames, rows, cols; or an
    image's rows, cols), in that order (its length a multiple of ``multiple``:
    :func:`pack_capacity`)."""
    grids = [as_grid(grid) for grid in grids]
    lengths = [grid.num_tokens for grid in grids]
    total = sum(lengths)
    size = pack_capacity(total, capacity, multiple)
    document = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(lengths))
    document = torch.cat([document, torch.full((size - total,), len(grids))])
    positions = [grid_positions(grid.rows, grid.cols, grid.frames) for grid in grids]
    positions.append(torch.zeros(size - total, 3, dtype=torch.long))
    return Pack(
        document=document.to(device),
        positions=torch.cat(positions).to(device),
        grids=tuple(grids),
        num_tokens=total,
    )


# -- which tokens attend to each other ------------------------------------------------------
@dataclass(frozen=True)
class Partition:
    """A pack's tokens in groups that attend among themselves (one attention layout).

    ``ids`` ``[S]`` int64: the group of each token, in pack order (padding tokens form one
    group of their own, the last); ``order`` ``[S]``: the pack's tokens rearranged so that
    every group is contiguous (None: they already are), padding still at the end; ``inverse``
    its inverse permutation; ``lengths``: tokens per group in that arrangement, padding
    excluded.
    """

    ids: Tensor
    lengths: tuple[int, ...]
    order: Tensor | None = None
    inverse: Tensor | None = None

    @property
    def contiguous_ids(self) -> Tensor:
        """``ids`` in the arrangement of ``order``: equal ids are runs."""
        return self.ids if self.order is None else self.ids[self.order]


def _group_ids(lengths: list[int], capacity: int) -> Tensor:
    """``[capacity]``: group i for each of its ``lengths[i]`` tokens, then the padding group."""
    counts = torch.tensor(lengths, dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    return torch.cat([ids, torch.full((capacity - ids.shape[0],), len(lengths))])


def _full(pack: Pack) -> Partition:
    """Each sample is a group (the document mask)."""
    return Partition(pack.document, tuple(pack.lengths))


def _spatial(pack: Pack) -> Partition:
    """Each frame of each sample is a group: contiguous already (tokens are frame-major)."""
    lengths = [grid.cells for grid in pack.grids for _ in range(grid.frames)]
    return Partition(_group_ids(lengths, pack.capacity).to(pack.document.device), tuple(lengths))


def _temporal(pack: Pack) -> Partition:
    """Each patch position of each sample is a group of its frames: tokens ``f·cells + cell``
    of a sample, rearranged cell-major so that each group is contiguous."""
    pieces, lengths, start = [], [], 0
    for grid in pack.grids:
        local = torch.arange(grid.num_tokens).reshape(grid.frames, grid.cells)
        pieces.append(start + local.T.reshape(-1))  # [cells·frames]: cell-major
        lengths += [grid.frames] * grid.cells
        start += grid.num_tokens
    order = torch.cat([*pieces, torch.arange(start, pack.capacity)])
    inverse = torch.argsort(order)
    ids = _group_ids(lengths, pack.capacity)[inverse]  # group of each token in pack order
    device = pack.document.device
    return Partition(ids.to(device), tuple(lengths), order.to(device), inverse.to(device))


PARTITIONS: dict[str, Callable[[Pack], Partition]] = {
    "full": _full,
    "spatial": _spatial,
    "temporal": _temporal,
}
"""Attention layout → the groups of a pack's tokens that attend to each other."""


def partition(pack: Pack, layout: str) -> Partition:
    """The :class:`Partition` of ``pack`` under ``layout`` (full, spatial or temporal)."""
    return PARTITIONS[layout](pack)
