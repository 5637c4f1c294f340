"""Data-path throughput: decode, decode + bucket transform, and the full bucketed loader.

    python benchmarks/data_bench.py [--images N] [--workers 0 2] [--json]

Writes N JPEG images of SDXL-like sizes (random aspect ratios, about 1024² pixels, fixed seed)
to a temporary folder, then times, on the same files in the same run:

- ``decode``: PIL open + decode + RGB (the baseline every path pays);
- ``decode+bucket``: decode, then the SDXL bucket's cover-resize, crop and tensor conversion
  (``impasto.data.buckets``);
- ``loader wK``: the training loader (``build_dataloader`` with SDXL buckets, batch 4) with K
  worker processes, pulling one epoch.

Prints samples/s and the ratio to ``decode``. The cached-latent path comes with the on-disk
cache (issue #6).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from impasto.data import ImageRecord, build_dataloader
from impasto.data.buckets import (
    SDXL_BUCKETS,
    apply_bucket_transform,
    assign_bucket,
    assign_image_buckets,
    bucket_transform_params,
)


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` noisy-gradient JPEGs (quality 90) of random SDXL-like sizes."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
        height = int(round(1024 / aspect**0.5 / 8)) * 8
        width = int(round(1024 * aspect**0.5 / 8)) * 8
        gradient = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
        noise = rng.normal(0, 20, (height, width, 3)).astype(np.float32)
        pixels = np.clip(gradient + noise, 0, 255).astype(np.uint8)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        path.with_suffix(".txt").write_text(f"image {i}")
        paths.append(path)
    return paths


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def time_decode(paths: list[Path]) -> float:
    start = time.perf_counter()
    for path in paths:
        with Image.open(path) as image:
            image.convert("RGB").load()
    return _rate(len(paths), time.perf_counter() - start)


def time_decode_bucket(paths: list[Path]) -> float:
    start = time.perf_counter()
    for index, path in enumerate(paths):
        with Image.open(path) as image:
            rgb = image.convert("RGB")
            bucket = assign_bucket(rgb.height, rgb.width, SDXL_BUCKETS)
            generator = torch.Generator().manual_seed(index)
            params = bucket_transform_params(
                rgb.height, rgb.width, bucket, "random", True, generator
            )
            apply_bucket_transform(rgb, params)
    return _rate(len(paths), time.perf_counter() - start)


def time_loader(paths: list[Path], workers: int) -> float:
    records = [ImageRecord(path, f"image {i}") for i, path in enumerate(paths)]
    bucket_of, _ = assign_image_buckets(paths, SDXL_BUCKETS)
    loader, _ = build_dataloader(
        records, 1024, "random", True, 4, seed=0, num_workers=workers, bucket_of=bucket_of
    )
    start, count = time.perf_counter(), 0
    for batch in loader:
        count += batch.size
    return _rate(count, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_images(Path(tmp), args.images)
        time_decode(paths[:4])  # warm the file cache and PIL's decoders
        rows = {"decode": time_decode(paths), "decode+bucket": time_decode_bucket(paths)}
        for workers in args.workers:
            rows[f"loader w{workers}"] = time_loader(paths, workers)
    baseline = rows["decode"]
    if args.json:
        print(json.dumps({"images": args.images, "samples_per_s": rows}))
        return
    print(f"{'path':<16} {'samples/s':>10} {'vs decode':>10}")
    for name, rate in rows.items():
        print(f"{name:<16} {rate:>10.1f} {rate / baseline:>10.2f}")


if __name__ == "__main__":
    main()
