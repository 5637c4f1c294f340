"""Aspect-ratio buckets in the data path (issue #6): sampler, dataset, report, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from impasto.config import build_config
from impasto.data import build_dataloader, scan_image_folder
from impasto.data.buckets import assign_image_buckets, bucket_transform_params
from impasto.data.demo import write_demo_dataset
from impasto.data.sampler import ResumableBatchSampler
from impasto.train.trainer import train

BUCKETS = [(48, 80), (64, 64), (80, 48)]
SIZES = [(64, 64), (60, 100), (100, 60), (62, 66)]  # (height, width) of the four image kinds


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory) -> Path:
    """14 demo images resized to four aspect ratios, plus one corrupt file."""
    folder = tmp_path_factory.mktemp("mixed") / "data"
    write_demo_dataset(folder, num_images=14, size=64, seed=1)
    for i, path in enumerate(sorted(folder.glob("*.png"))):
        height, width = SIZES[i % len(SIZES)]
        with Image.open(path) as image:
            image.resize((width, height)).save(path)
    (folder / "broken.png").write_bytes(b"not an image")
    (folder / "broken.txt").write_text("a broken file")
    return folder


def test_placing_reports_every_image(mixed_folder):
    records = scan_image_folder(mixed_folder)
    bucket_of, report = assign_image_buckets([r.image_path for r in records], BUCKETS)
    names = [r.image_path.name for r in records]
    assert bucket_of[names.index("broken.png")] is None
    # i % 4 = 0 (64x64) and 3 (62x66): 4 + 3 square; 1 (60x100): 4 wide; 2 (100x60): 3 tall.
    assert report.counts == {(64, 64): 7, (48, 80): 4, (80, 48): 3}
    assert list(report.unplaced.values()) == [
        "unreadable image: not an image PIL can read (unknown format, or an empty or damaged "
        "header)"
    ]
    assert report.unreadable == [str(mixed_folder / "broken.png")]
    assert "broken.png" in report.format()


def test_bucketed_sampler_covers_every_image_and_resumes_exactly():
    bucket_of = [(64, 64)] * 7 + [(48, 80)] * 5 + [None]
    sampler = ResumableBatchSampler(13, 4, seed=3, bucket_of=bucket_of)
    assert sampler.num_batches_per_epoch == 2 + 2
    epoch = list(sampler.epoch_batches(0))
    assert all(len(batch) == 4 for batch in epoch)
    assert {len({bucket_of[key.index] for key in batch}) for batch in epoch} == {1}
    assert {key.index for batch in epoch for key in batch} == set(range(12))  # all but None
    # Resume at (0, 2): the same remaining batches, then the same next epoch.
    straight = [b for e in (0, 1) for b in sampler.at(e).epoch_batches(e)]
    resumed = ResumableBatchSampler(13, 4, seed=3, bucket_of=bucket_of)
    resumed.load_state_dict(sampler.at(0, 2).state_dict())
    assert list(resumed) == straight[2:4]
    assert list(resumed.epoch_batches(1)) == straight[4:]
    with pytest.raises(ValueError, match="bucketed=0 but this run has 1"):
        resumed.load_state_dict(ResumableBatchSampler(13, 4, seed=3).state_dict())


def test_batches_have_their_bucket_size_and_micro_conditioning(mixed_folder):
    records = scan_image_folder(mixed_folder)
    bucket_of, _ = assign_image_buckets([r.image_path for r in records], BUCKETS)
    loader, sampler = build_dataloader(
        records, 64, "random", True, batch_size=2, seed=0, bucket_of=bucket_of
    )
    seen = 0
    for batch in loader:
        height, width = batch.pixel_values.shape[-2:]
        assert batch.target_sizes.tolist() == [[height, width]] * batch.size
        for row, index in enumerate(batch.indices.tolist()):
            assert bucket_of[index] == (height, width)
            generator = torch.Generator().manual_seed(_example_seed(0, 0, index))
            with Image.open(records[index].image_path) as image:
                source = (image.height, image.width)
            params = bucket_transform_params(*source, (height, width), "random", True, generator)
            assert batch.original_sizes[row].tolist() == list(params.original_size)
            assert batch.crop_top_lefts[row].tolist() == list(params.crop_top_left)
        seen += batch.size
    assert seen == sampler.num_batches_per_epoch * 2


def _example_seed(seed: int, epoch: int, index: int) -> int:
    from impasto.data.seeding import derive_seed

    return derive_seed(seed, epoch, index)


def _raw(folder: Path, run_dir: Path, max_steps: int) -> dict:
    return {
        "model": {"preset": "tiny"},
        "data": {
            "path": str(folder),
            "resolution": 64,
            "batch_size": 2,
            "crop": "random",
            "random_flip": True,
            "buckets": "generated",
            "bucket_step": 16,
            "bucket_min_side": 48,
            "bucket_max_side": 80,
            "max_bad_fraction": 0.1,  # broken.png: 1 of 15, reported before training
        },
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(run_dir), "seed": 0, "max_steps": max_steps},
        "checkpoint": {"every_steps": 3},
        "log": {"tensorboard": False, "progress_bar": False},
    }


def test_bucketed_training_resumes_bitwise(mixed_folder, tmp_path):
    straight = train(build_config(_raw(mixed_folder, tmp_path / "straight", 6)))
    report = (straight.run_dir / "buckets.txt").read_text()
    assert "48 x 80" in report and "broken.png: unreadable" in report
    bad_data = (straight.run_dir / "bad-data.tsv").read_text()
    assert (
        bad_data == f"{mixed_folder / 'broken.png'}\tunreadable image: not an image PIL can "
        "read (unknown format, or an empty or damaged header)\n"
    )
    train(build_config(_raw(mixed_folder, tmp_path / "resumed", 3)))
    resumed = train(build_config(_raw(mixed_folder, tmp_path / "resumed", 6)))
    a = load_file(straight.last_checkpoint / "unet.safetensors")
    b = load_file(resumed.last_checkpoint / "unet.safetensors")
    assert all(torch.equal(a[key], b[key]) for key in a)
    losses = [
        [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (straight.run_dir, resumed.run_dir)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_bucket_config_errors():
    base = {"model": {"preset": "tiny"}, "train": {"max_steps": 1}}
    with pytest.raises(ValueError, match="buckets: sdxl is SDXL's list around 1024x1024"):
        build_config({**base, "data": {"path": "x", "buckets": "sdxl"}})
    with pytest.raises(ValueError, match="bucket_step must be a multiple of 8"):
        build_config({**base, "data": {"path": "x", "buckets": "generated", "bucket_step": 12}})
