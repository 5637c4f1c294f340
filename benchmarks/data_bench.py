"""Data-path throughput: decode, decode + bucket transform, and the full bucketed loader.

    python benchmarks/data_bench.py [--images N] [--workers 0 2] [--json]

Writes N JPEG images of SDXL-like sizes (random aspect ratios, about 1024² pixels, fixed seed)
to a temporary folder, then times, on the same files in the same run:

- ``decode``: PIL open + decode + RGB (the baseline every path pays);
- ``decode+bucket``: decode, then the SDXL bucket's cover-resize, crop and tensor conversion
  (``impasto.data.buckets``);
- ``loader wK``: the training loader (``build_dataloader`` with SDXL buckets, batch 4) with K
  worker processes, pulling one epoch;
- ``cached wK``: the training loader reading VAE posteriors (mean and std, 4×128×128 each, the
  size of a 1024² SDXL latent, float16) from the on-disk cache (``impasto.data.cache``) with
  K workers: ``--cached`` entries with random flip (two outcomes each), batch 32, pulling
  ``--cached-samples`` samples. No image is decoded; the shards are in the page cache, as
  they are in a run after the first epoch.

Prints samples/s and the ratio to ``decode``.
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

from impasto.data import ImageCaptionDataset, ImageRecord, build_dataloader
from impasto.data.buckets import (
    SDXL_BUCKETS,
    apply_bucket_transform,
    assign_bucket,
    assign_image_buckets,
    bucket_transform_params,
)
from impasto.data.cache import CachedEncodings, ImageId, ShardStore, ShardWriter, latent_key


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


def write_cache(folder: Path, count: int) -> tuple[list[ImageRecord], CachedEncodings]:
    """``count`` records of 1024² images with both flips' posteriors in a cache (random values)."""
    records = [
        ImageRecord(f"synthetic/{i}.png", f"image {i}", size=(1024, 1024)) for i in range(count)
    ]
    ids = [ImageId(f"{i:064x}", 1024, 1024) for i in range(count)]
    dataset = ImageCaptionDataset(records, 1024, "center", True, seed=0)
    writer = ShardWriter(folder, "latents", rank=0, max_bytes=256 << 20)
    generator = torch.Generator().manual_seed(0)
    for image_id in ids:
        for params in dataset.transform.every_params(1024, 1024, None):
            key = latent_key(image_id, params, "bench-vae", "float16")
            mean = torch.randn(4, 128, 128, generator=generator).half()
            writer.add({f"{key}.mean": mean, f"{key}.std": mean.abs() * 0.01})
    writer.flush()
    return records, CachedEncodings(ShardStore(folder), ids, "bench-vae", None, "float16")


def time_cached(
    records: list[ImageRecord], cache: CachedEncodings, workers: int, samples: int
) -> float:
    loader, sampler = build_dataloader(
        records, 1024, "center", True, 32, seed=0, num_workers=workers, cache=cache
    )
    iterator, count = iter(loader), 0
    next(iterator)  # worker start-up is not throughput
    start = time.perf_counter()
    while count < samples:
        try:
            batch = next(iterator)
        except StopIteration:
            sampler.advance(len(sampler))
            iterator = iter(loader)
            continue
        count += batch.size
    return _rate(count, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--cached", type=int, default=256, help="entries in the latent cache")
    parser.add_argument("--cached-samples", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_images(Path(tmp), args.images)
        time_decode(paths[:4])  # warm the file cache and PIL's decoders
        rows = {"decode": time_decode(paths), "decode+bucket": time_decode_bucket(paths)}
        for workers in args.workers:
            rows[f"loader w{workers}"] = time_loader(paths, workers)
        records, cache = write_cache(Path(tmp) / "cache", args.cached)
        for workers in args.workers:
            rows[f"cached w{workers}"] = time_cached(records, cache, workers, args.cached_samples)
    baseline = rows["decode"]
    if args.json:
        print(json.dumps({"images": args.images, "samples_per_s": rows}))
        return
    print(f"{'path':<16} {'samples/s':>10} {'vs decode':>10}")
    for name, rate in rows.items():
        print(f"{name:<16} {rate:>10.1f} {rate / baseline:>10.2f}")


if __name__ == "__main__":
    main()
