"""What the device reports about a run: its peak memory between logging steps."""

from __future__ import annotations

import torch


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory PyTorch's allocator held on ``device`` since the last call (or the
    start), in GiB; the peak is reset, so each logging step reports its own window. None on a
    CPU. Reads allocator counters: no device sync."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return peak
