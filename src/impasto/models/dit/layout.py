"""Tokens of the DiT: patches of latents in (frame, row, column) order, and packs of them.

A sample's latents ``[C, h, w]`` (an image: one frame) become ``(h/p)·(w/p)`` tokens of
``C·p·p`` values, row-major; each token's position is its (frame, row, column) patch index.
A *pack* lays the tokens of several samples of different shapes end to end in one sequence of
fixed ``capacity`` (padding at the end); ``document`` says which sample each token belongs to,
so attention can stay inside each sample (:mod:`impasto.models.dit.attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

PACK_MULTIPLE = 128  # FlexAttention's block size: a pack's capacity is a multiple of it


def patchify(latents: Tensor, patch: int) -> Tensor:
    """``[B, C, h, w]`` → ``[B, (h/p)·(w/p), C·p·p]``, patches row-major, each patch's values
    channel-major (``C, p_row, p_col``)."""
    batch, channels, height, width = latents.shape
    grid = latents.reshape(batch, channels, height // patch, patch, width // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(batch, -1, channels * patch * patch)


def unpatchify(tokens: Tensor, patch: int, channels: int, rows: int, cols: int) -> Tensor:
    """The inverse of :func:`patchify`: ``[B, rows·cols, C·p·p]`` → ``[B, C, rows·p, cols·p]``."""
    batch = tokens.shape[0]
    grid = tokens.reshape(batch, rows, cols, channels, patch, patch)
    return grid.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, rows * patch, cols * patch)


def grid_positions(rows: int, cols: int, frame: int = 0) -> Tensor:
    """``[rows·cols, 3]`` int64: (frame, row, column) of each token of one frame, row-major."""
    row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([torch.full_like(row, frame), row, col], dim=-1).reshape(-1, 3)


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
    (rows, cols) of patches, in order; ``num_tokens``: tokens before the padding.
    """

    document: Tensor
    positions: Tensor
    grids: tuple[tuple[int, int], ...]
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
        return [rows * cols for rows, cols in self.grids]


def plan_pack(
    grids: list[tuple[int, int]], capacity: int | None, device: torch.device, multiple: int = 1
) -> Pack:
    """The :class:`Pack` of samples with patch grids ``grids`` (rows, cols), in that order
    (its length a multiple of ``multiple``: :func:`pack_capacity`)."""
    lengths = [rows * cols for rows, cols in grids]
    total = sum(lengths)
    size = pack_capacity(total, capacity, multiple)
    document = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(lengths))
    document = torch.cat([document, torch.full((size - total,), len(grids))])
    positions = [grid_positions(rows, cols) for rows, cols in grids]
    positions.append(torch.zeros(size - total, 3, dtype=torch.long))
    return Pack(
        document=document.to(device),
        positions=torch.cat(positions).to(device),
        grids=tuple(grids),
        num_tokens=total,
    )
