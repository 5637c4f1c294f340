"""FLOPs of a training step, achieved TFLOP/s and MFU (issue #18).

FLOPs are counted with the formulas of ``torch.utils.flop_counter`` (matmuls, convolutions,
attention, forward and backward: elementwise ops count 0) once per batch shape: the count
depends on shapes only, so the first micro-batch of each shape is counted and later ones of
that shape reuse it. A counted forward + backward includes whatever ran: with gradient
checkpointing the recomputed forward is counted too, so the figure is then the *hardware*
FLOP utilisation (HFU in the PaLM paper's terms, arXiv:2204.02311 appendix B), not the model's.

Counting must not change the step's numbers (a run counts the first step of a shape; a resumed
run counts a different step, and both must stay bit-identical to an uninterrupted run).
``FlopCounterMode`` breaks that: it decomposes every op that has no FLOP formula into primitive
ops (``silu_backward``, for one, becomes several that round differently), so :class:`FlopMeter`
runs each op as it is and only adds the library's formula for it. That holds in eager mode
only: a ``torch.compile``d model runs eagerly under the meter (Dynamo leaves frames alone while
a dispatch mode is active), so that step's numbers differ from the compiled ones. Count eager
steps only (``impasto bench`` gives the compiled step's TFLOP/s from the eager step's count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from contextlib import AbstractContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, for the GPUs we know (None elsewhere)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "H100" in name or "H200" in name or "H800" in name:
        return 756.0 if "PCIe" in name else 989.4  # SXM: 989.4 dense (1979 with sparsity)
    if "A100" in name:
        return 312.0
    return None


class _CountFlops(TorchDispatchMode):
    """Runs every op unchanged and adds ``torch.utils.flop_counter``'s count for it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


class FlopMeter:
    """FLOPs per micro-batch, counted the first time each ``key`` (e.g. the latents' shape
    ``(B, C, H, W)``: anything that fixes the step's shapes) is seen::

        with meter.measure(key):  # the micro-batch's forward and backward
            step(batch).backward()
        step_flops += meter.flops(key)  # an int from then on
    """

    def __init__(self) -> None:
        self.counts: dict[Hashable, int] = {}

    def measure(self, key: Hashable) -> AbstractContextManager[None]:
        """Count what runs inside if ``key`` is new (a dispatch mode: slower, once per shape);
        else a null context."""
        if key in self.counts:
            return contextlib.nullcontext()
        return self._count(key)

    @contextlib.contextmanager
    def _count(self, key: Hashable) -> Iterator[None]:
        with _CountFlops() as mode:
            yield
        self.counts[key] = mode.total  # only once the block finished (an error leaves it new)

    def flops(self, key: Hashable) -> int | None:
        """The FLOPs counted for ``key`` (None before its first :meth:`measure` finished)."""
        return self.counts.get(key)


def tflops_and_mfu(flops: int, seconds: float, peak: float | None) -> dict[str, float]:
    """``{"tflops": achieved TFLOP/s, "mfu": its fraction of ``peak`` TFLOP/s}``; no ``mfu``
    when the peak is unknown (CPUs, GPUs outside :func:`peak_tflops`), no key at all for a
    step that took no time."""
    if seconds <= 0:
        return {}
    tflops = flops / seconds / 1e12
    return {"tflops": tflops} | ({} if peak is None else {"mfu": tflops / peak})
