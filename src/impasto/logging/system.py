"""What the device reports about a run: its peak memory between logging steps."""

from __future__ import annotations

import sys

import torch

GIB = 2**30


def peak_memory(device: torch.device) -> dict[str, float]:
    """On CUDA, ``peak_memory_gib``: the most memory PyTorch's allocator held on ``device``
    since the last call (or the start); the peak is then reset, so each logging step reports
    its own window (allocator counters: no device sync). Elsewhere ``peak_rss_gib``: the most
    resident memory the process has held since it started (``getrusage``; none on Windows)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
        return {"peak_memory_gib": peak}
    try:
        import resource
    except ImportError:
        return {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gib": peak / (GIB if sys.platform == "darwin" else 2**20)}
