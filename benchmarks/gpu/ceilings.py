"""The device's own ceilings (issue #19): bf16 matrix-product TFLOP/s and device-to-device copy
GB/s, measured on random data with CUDA events (median of repeats after a warm-up), so MFU can
also be read against what the card really does, not only its datasheet.

    python benchmarks/gpu/ceilings.py [--json FILE] [--size N] [--copy-gib G]

On a machine without CUDA it measures the CPU with small sizes (the dry run of ``run.sh``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def median_ms(work: Callable[[], object], device: torch.device, warmup: int, repeat: int) -> float:
    """The median time of ``work`` in milliseconds: CUDA events on a GPU, else a host clock."""
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            work()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def matmul_tflops(device: torch.device, size: int, dtype: torch.dtype) -> dict[str, float]:
    """``size``³ products on random data (never zeros: they run faster), rotating three input
    pairs so repeats do not hit a cache."""
    generator = torch.Generator(device=device).manual_seed(0)
    pairs = [
        (
            torch.randn(size, size, device=device, dtype=dtype, generator=generator),
            torch.randn(size, size, device=device, dtype=dtype, generator=generator),
        )
        for _ in range(3)
    ]
    out = torch.empty(size, size, device=device, dtype=dtype)
    turn = [0]

    def product() -> None:
        a, b = pairs[turn[0] % 3]
        turn[0] += 1
        torch.mm(a, b, out=out)

    ms = median_ms(product, device, warmup=5, repeat=30 if device.type == "cuda" else 5)
    return {"size": size, "ms": ms, "tflops": 2 * size**3 / (ms / 1e3) / 1e12}


def copy_gbps(device: torch.device, gib: float) -> dict[str, float]:
    """A large device-to-device copy; bytes read plus bytes written over its time."""
    numel = int(gib * 2**30) // 4
    source = torch.rand(numel, device=device)
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), device, warmup=3, repeat=20)
    moved = 2 * numel * 4
    return {"gib": gib, "ms": ms, "gbps": moved / (ms / 1e3) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--size", type=int, help="matrix side (default 8192 on a GPU, 512 on CPU)")
    parser.add_argument("--copy-gib", type=float, help="copy size (default 4 on a GPU, 0.0625)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size = args.size or (8192 if cuda else 512)
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "bf16_matmul": matmul_tflops(device, size, torch.bfloat16),
        "fp32_matmul_tf32_off": matmul_tflops(device, size // 2, torch.float32),
        "copy": copy_gbps(device, args.copy_gib or (4.0 if cuda else 0.0625)),
    }
    print(
        f"ceilings on {report['device']}: bf16 {size}^3 matmul "
        f"{report['bf16_matmul']['tflops']:.1f} TFLOP/s; fp32 "
        f"{report['fp32_matmul_tf32_off']['tflops']:.1f} TFLOP/s; copy "
        f"{report['copy']['gbps']:.0f} GB/s (read + write)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
