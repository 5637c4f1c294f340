"""Aspect-ratio buckets: lists, assignment, crop conditioning, transform, report, epoch plan."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.data.buckets import (
    SDXL_BUCKETS,
    BucketCrop,
    apply_bucket_transform,
    aspect_distance,
    assign_bucket,
    bucket_report,
    bucket_transform_params,
    generate_buckets,
    plan_bucket_batches,
)


def test_sdxl_buckets_match_the_paper_table() -> None:
    assert len(SDXL_BUCKETS) == 40
    assert len(set(SDXL_BUCKETS)) == 40
    assert (1024, 1024) in SDXL_BUCKETS
    assert SDXL_BUCKETS[0] == (512, 2048) and SDXL_BUCKETS[-1] == (2048, 512)
    aspects = [height / width for height, width in SDXL_BUCKETS]
    assert aspects == sorted(aspects) and len(set(aspects)) == 40
    assert all(height % 64 == 0 and width % 64 == 0 for height, width in SDXL_BUCKETS)
    # The paper's table spans 0.902·1024² (704x1344) to exactly 1024² (e.g. 512x2048).
    areas = [height * width for height, width in SDXL_BUCKETS]
    assert min(areas) == 704 * 1344 and max(areas) == 1024 * 1024
    assert all(0.90 * 1024**2 <= area <= 1024**2 for area in areas)


def test_generate_buckets_small_case() -> None:
    # max_area 512² = 262144, step 64: width 256 -> 262144 // 256 = 1024 -> 1024;
    # 320 -> 819 -> 768; 384 -> 682 -> 640; 448 -> 585 -> 576; 512 -> 512; 576 -> 448 (seen);
    # 640 -> 384 (seen); 704 -> 372 -> 320; 768 -> 320 (seen); 832 -> 315 -> 256;
    # 896 -> 292 -> 256; 960 -> 273 -> 256; 1024 -> 256 (seen). Plus transposes.
    expected = [
        (256, 1024), (256, 960), (256, 896), (256, 832), (320, 768), (320, 704),
        (384, 640), (448, 576), (512, 512), (576, 448), (640, 384), (704, 320),
        (768, 320), (832, 256), (896, 256), (960, 256), (1024, 256),
    ]  # fmt: skip
    assert generate_buckets(512 * 512, 256, 1024, 64) == expected


@pytest.mark.parametrize(
    ("max_area", "min_side", "max_side", "step", "message"),
    [
        (512 * 512, 256, 1024, 0, "step must be positive"),
        (512 * 512, 250, 1024, 64, "multiples of step"),
        (512 * 512, 256, 1000, 64, "multiples of step"),
        (512 * 512, 1024, 256, 64, "larger than max_side"),
        (200 * 200, 256, 1024, 64, "below min_side"),
    ],
)
def test_generate_buckets_rejects_bad_arguments(
    max_area: int, min_side: int, max_side: int, step: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        generate_buckets(max_area, min_side, max_side, step)


def test_assign_bucket_picks_the_closest_log_aspect() -> None:
    # 1000x1500 has aspect 2/3. Neighbours in the SDXL list: 832/1216 = 0.684 at
    # |log(0.6667 / 0.6842)| = 0.026, 832/1152 = 0.722 at 0.080, 768/1280 = 0.6 at 0.105.
    assert assign_bucket(1000, 1500, SDXL_BUCKETS) == (832, 1216)
    assert assign_bucket(1500, 1000, SDXL_BUCKETS) == (1216, 832)
    assert assign_bucket(3000, 3000, SDXL_BUCKETS) == (1024, 1024)
    # Beyond the list's range the extreme bucket is the closest.
    assert assign_bucket(100, 1000, SDXL_BUCKETS) == (512, 2048)


def test_assign_bucket_breaks_ties_by_area_then_size() -> None:
    # A square image is exactly as far from 960x1024 as from 1024x960 (same area).
    assert assign_bucket(1000, 1000, [(1024, 960), (960, 1024)]) == (960, 1024)
    assert assign_bucket(1000, 1000, [(1024, 1024), (512, 512)]) == (512, 512)


def test_assign_bucket_error_is_within_half_the_largest_gap() -> None:
    log_aspects = [math.log(height / width) for height, width in SDXL_BUCKETS]
    largest_gap = max(b - a for a, b in zip(log_aspects[:-1], log_aspects[1:], strict=True))
    # Between 512x1856 and 576x1792: log((576 / 1792) / (512 / 1856)) = 0.15287.
    assert largest_gap == pytest.approx(0.152874, abs=1e-6)
    rng = random.Random(0)
    for _ in range(500):
        aspect = math.exp(rng.uniform(math.log(0.25), math.log(4.0)))
        height = rng.randint(300, 3000)
        width = max(1, round(height / aspect))
        bucket = assign_bucket(height, width, SDXL_BUCKETS)
        error = aspect_distance(height, width, bucket)
        assert error <= largest_gap / 2 + 1e-12
        assert error <= min(aspect_distance(height, width, b) for b in SDXL_BUCKETS) + 1e-12


def test_assign_bucket_no_upscale() -> None:
    # Every SDXL bucket has a side of at least 1024, so nothing fits inside 1000x1000.
    assert assign_bucket(1000, 1000, SDXL_BUCKETS, no_upscale=True) is None
    assert assign_bucket(500, 500, SDXL_BUCKETS, no_upscale=True) is None
    assert assign_bucket(1100, 1100, SDXL_BUCKETS, no_upscale=True) == (1024, 1024)
    # 950x1100 (aspect 0.864): 960x1088 (0.882) is closest but taller than the image, so the
    # next closest, 896x1088 (0.824), is used.
    assert assign_bucket(950, 1100, SDXL_BUCKETS) == (960, 1088)
    assert assign_bucket(950, 1100, SDXL_BUCKETS, no_upscale=True) == (896, 1088)


def test_assign_bucket_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="positive"):
        assign_bucket(0, 100, SDXL_BUCKETS)
    with pytest.raises(ValueError, match="empty"):
        assign_bucket(100, 100, [])


@pytest.mark.parametrize(
    ("size", "resize_to", "crop_top_left"),
    [
        # 600x900: scale max(832/600, 1216/900) = 1.387 from the height; width 832·900/600
        # = 1248; left round((1248 - 1216) / 2) = 16.
        ((600, 900), (832, 1248), (0, 16)),
        # Upscaling, same aspect: 832·450/300 = 1248.
        ((300, 450), (832, 1248), (0, 16)),
        # Square: width sets the scale (1216/1000 > 832/1000); top round((1216 - 832) / 2).
        ((1000, 1000), (1216, 1216), (192, 0)),
        # 832·901/600 = 1249.39 -> 1249; left round(33 / 2) = round(16.5) = 16 (half to even,
        # as torchvision's CenterCrop).
        ((600, 901), (832, 1249), (0, 16)),
    ],
)
def test_center_crop_params(
    size: tuple[int, int], resize_to: tuple[int, int], crop_top_left: tuple[int, int]
) -> None:
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    params = bucket_transform_params(*size, (832, 1216), "center", False, generator)
    assert params == BucketCrop(
        original_size=size,
        resize_to=resize_to,
        crop_top_left=crop_top_left,
        target_size=(832, 1216),
        flip=False,
    )
    assert params.add_time_ids == (*size, *crop_top_left, 832, 1216)
    assert torch.equal(generator.get_state(), state)  # center crop, no flip: nothing drawn


def test_flip_mirrors_the_crop_left() -> None:
    # 600x901 in 832x1216: resized 832x1249, center left 16; the same crop seen in the flipped
    # resized image starts at 1249 - 16 - 1216 = 17.
    seen = set()
    for seed in range(32):
        generator = torch.Generator().manual_seed(seed)
        params = bucket_transform_params(600, 901, (832, 1216), "center", True, generator)
        assert params.crop_top_left == ((0, 17) if params.flip else (0, 16))
        assert params.add_time_ids == (600, 901, *params.crop_top_left, 832, 1216)
        seen.add(params.flip)
    assert seen == {False, True}


def test_random_crop_params_are_in_range_and_reproducible() -> None:
    lefts = set()
    for seed in range(50):
        params = bucket_transform_params(
            600, 900, (832, 1216), "random", True, torch.Generator().manual_seed(seed)
        )
        again = bucket_transform_params(
            600, 900, (832, 1216), "random", True, torch.Generator().manual_seed(seed)
        )
        assert params == again
        assert params.resize_to == (832, 1248)
        # Draw order: top in [0, 0], left in [0, 32], then the flip coin.
        generator = torch.Generator().manual_seed(seed)
        top = int(torch.randint(0, 1, (1,), generator=generator))
        left = int(torch.randint(0, 33, (1,), generator=generator))
        flip = bool(torch.rand((), generator=generator) < 0.5)
        assert params.flip == flip
        assert params.crop_top_left == (top, 1248 - left - 1216 if flip else left)
        assert 0 <= params.crop_top_left[1] <= 32
        lefts.add(params.crop_top_left[1])
    assert len(lefts) > 5


def test_unknown_crop_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="center, random"):
        bucket_transform_params(600, 900, (832, 1216), "middle", False, torch.Generator())


def test_apply_bucket_transform_shape_range_and_flip() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (600, 901, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    params = BucketCrop((600, 901), (832, 1249), (0, 16), (832, 1216), flip=False)
    tensor = apply_bucket_transform(image, params)
    assert tensor.shape == (3, 832, 1216) and tensor.dtype == torch.float32
    assert tensor.min() >= -1.0 and tensor.max() <= 1.0
    assert tensor.min() < -0.9 and tensor.max() > 0.9  # really spans the range
    # The same crop, flipped: recorded at 1249 - 16 - 1216 = 17 in the flipped image.
    flipped = apply_bucket_transform(image, replace(params, flip=True, crop_top_left=(0, 17)))
    assert torch.equal(flipped, torch.flip(tensor, dims=[2]))
    shifted = apply_bucket_transform(image, replace(params, crop_top_left=(0, 17)))
    assert not torch.equal(shifted, tensor)
    with pytest.raises(ValueError, match="600x900"):
        apply_bucket_transform(image.crop((0, 0, 900, 600)), params)


def test_bucket_report_counts_and_format() -> None:
    assignments = {
        "a.png": (832, 1216),
        "b.png": (832, 1216),
        "c.png": (1024, 1024),
        "tiny.png": None,
        "odd.png": None,
    }
    report = bucket_report(assignments, {"tiny.png": "64x64 is smaller than every bucket"})
    assert report.counts == {(832, 1216): 2, (1024, 1024): 1}
    assert report.unplaced == {
        "tiny.png": "64x64 is smaller than every bucket",
        "odd.png": "fits no bucket",
    }
    text = report.format()
    lines = text.splitlines()
    assert "832 x 1216" in lines[1] and lines[1].split()[-2:] == ["0.684", "2"]
    assert "1024 x 1024" in lines[2] and lines[2].split()[-2:] == ["1.000", "1"]
    assert lines[3].split() == ["total", "3"]
    assert "2 image(s) not placed:" in text
    assert "  tiny.png: 64x64 is smaller than every bucket" in lines


A, B = (832, 1216), (1024, 1024)
# 7 images in A, 5 in B, one unplaced (index 12), interleaved.
BUCKET_OF = [A, B, A, A, B, A, B, A, A, B, A, B, None]


def test_plan_bucket_batches_every_batch_full_and_single_bucket() -> None:
    plan = plan_bucket_batches(BUCKET_OF, batch_size=4, seed=3, epoch=0)
    # A: 7 = 4 + 3, the short batch filled with 1 earlier index -> 2 batches;
    # B: 5 = 4 + 1, filled with 3 earlier indices -> 2 batches.
    assert len(plan) == 4
    assert all(len(batch) == 4 for batch in plan)
    assert all(len({BUCKET_OF[i] for i in batch}) == 1 for batch in plan)
    assert all(len(set(batch)) == 4 for batch in plan)  # fills come from other batches
    counts = Counter(i for batch in plan for i in batch)
    assert 12 not in counts
    a_indices = [i for i, b in enumerate(BUCKET_OF) if b == A]
    b_indices = [i for i, b in enumerate(BUCKET_OF) if b == B]
    assert sorted(counts[i] for i in a_indices) == [1, 1, 1, 1, 1, 1, 2]
    assert sorted(counts[i] for i in b_indices) == [1, 1, 2, 2, 2]


def test_plan_bucket_batches_is_a_function_of_seed_and_epoch() -> None:
    plan = plan_bucket_batches(BUCKET_OF, 4, seed=3, epoch=0)
    assert plan_bucket_batches(BUCKET_OF, 4, seed=3, epoch=0) == plan
    assert plan_bucket_batches(BUCKET_OF, 4, seed=3, epoch=1) != plan
    assert plan_bucket_batches(BUCKET_OF, 4, seed=4, epoch=0) != plan


def test_plan_bucket_batches_interleaves_buckets() -> None:
    # 10 batches of A and 10 of B: the batch list is shuffled, not grouped by bucket.
    plan = plan_bucket_batches([A, B] * 40, 4, seed=0, epoch=0)
    buckets = [A if batch[0] % 2 == 0 else B for batch in plan]
    assert Counter(buckets) == {A: 10, B: 10}
    num_switches = sum(a != b for a, b in zip(buckets[:-1], buckets[1:], strict=True))
    assert num_switches > 1


def test_plan_bucket_batches_small_bucket_and_edge_cases() -> None:
    # A bucket of 2 images with batch 4 has no earlier batch: its own images are repeated.
    plan = plan_bucket_batches([A, A], 4, seed=0, epoch=0)
    assert len(plan) == 1 and sorted(plan[0]) == [0, 0, 1, 1]
    assert plan_bucket_batches([None, None], 4, seed=0, epoch=0) == []
    assert plan_bucket_batches([A] * 8, 4, seed=0, epoch=0) != [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="batch_size"):
        plan_bucket_batches([A], 0, seed=0, epoch=0)
