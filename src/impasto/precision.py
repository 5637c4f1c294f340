"""Device and mixed-precision choice.

``auto`` means bf16 autocast where the device computes it natively (CUDA with bf16 support) and
fp32 elsewhere (CPU autocast to bf16 is slower than fp32 on most CPUs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"train.device: {name} requested but CUDA is not available; use auto or cpu"
        )
    return device


def resolve_precision(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if mixed_precision == "fp32":
        return None
    if mixed_precision in ("bf16", "pure_bf16"):
        return torch.bfloat16
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if native_bf16 else None


def autocast_factory(
    device: torch.device, dtype: torch.dtype | None
) -> Callable[[], AbstractContextManager]:
    if dtype is None:
        return contextlib.nullcontext
    return partial(torch.autocast, device_type=device.type, dtype=dtype)
