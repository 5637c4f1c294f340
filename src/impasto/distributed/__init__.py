"""Process groups for runs launched with ``torchrun`` (one process per device).

``torchrun`` sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` for every process; a plain
``python`` / ``impasto`` process is rank 0 of 1. Model code never imports ``torch.distributed``;
the parts that split work across ranks take ``(rank, world_size)`` as plain integers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process, from torchrun's environment (else ``(0, 1)``)."""
    try:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise ValueError("RANK and WORLD_SIZE must be integers (set by torchrun)") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world}; launch with torchrun")
    return rank, world


@contextmanager
def process_group() -> Iterator[tuple[int, int]]:
    """Join the run's process group for the block (if ``WORLD_SIZE`` > 1); yields
    ``(rank, world_size)``. NCCL on CUDA machines, gloo otherwise."""
    rank, world = rank_and_world()
    owned = world > 1 and not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield rank, world
    finally:
        if owned:
            dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()


def gather_to_all(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
