"""A video run end to end (issue #32): a tiny DiT trains on demo clips of three lengths and
still images packed together, through a tiny random Wan 2.1 VAE built in code; a run stopped
mid-epoch resumes bit for bit; the checkpoint samples clips with ``impasto sample --frames``;
an exported folder keeps its video VAE and samples the same clips."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_same
from PIL import Image

from impasto.checkpoint import load_checkpoint
from impasto.config import build_config
from impasto.train.trainer import train

pytestmark = pytest.mark.slow  # four short trainings and exports (~1-2 minutes)

pytest.importorskip("av")

CLIP_SIZES = [(32, 17), (32, 9), (32, 13)]


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 demo clips (17, 9 and 13 frames, 32 px) and 4 still images, with captions, in one
    folder as the video demo writes them (``num_stills``)."""
    from impasto.data.demo_video import write_demo_video_dataset

    root = tmp_path_factory.mktemp("video") / "mixed"
    write_demo_video_dataset(root, num_clips=12, seed=0, variants=CLIP_SIZES, num_stills=4)
    return root


@pytest.fixture(scope="module")
def wan_vae_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_video_vae import tiny_wan_vae

    folder = tmp_path_factory.mktemp("wan") / "vae"
    tiny_wan_vae(0).save_pretrained(folder, safe_serialization=True)
    return folder


def video_raw(data: Path, vae: Path, run_dir: Path, max_steps: int) -> dict[str, Any]:
    return {
        "model": {
            "family": "dit", "preset": "tiny", "vae": str(vae),
            "dit": {"autoencoder": "video", "attention": "spatiotemporal", "text_length": 16},
        },
        "objective": {"prediction_type": "flow", "flow_shift": 2.0,
                      "flow_shift_resolution": 32},
        "data": {"path": str(data), "resolution": 32, "video": {"num_frames": 17},
                 "pack_tokens": 128, "caption_dropout": 0.2},
        "cache": {"latents": "memory", "text_embeddings": "memory"},
        "ema": {"enabled": True, "decay": 0.9},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(run_dir), "seed": 3, "max_steps": max_steps},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "sample": {"every_steps": 100, "frames": 9, "num_steps": 3,
                   "prompts": ["a red circle moving left on a white background"]},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }  # fmt: skip


@pytest.fixture(scope="module")
def straight_run(video_folder, wan_vae_folder, tmp_path_factory) -> Any:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    return train(build_config(video_raw(video_folder, wan_vae_folder, run_dir, 6)))


def test_clips_and_stills_train_in_packs(straight_run):
    run_dir = straight_run.run_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and all(np.isfinite(losses))
    state = json.loads((straight_run.last_checkpoint / "state.json").read_text())
    # 12 clips (20, 12 and 16 tokens at 32 px with 2x2 patches) and 4 stills (4 tokens each):
    # 208 tokens, two packs of 128 per epoch.
    assert state["data"]["epoch"] == 3 and state["data"]["batch_in_epoch"] == 0
    dataset = json.loads((straight_run.last_checkpoint / "dataset.json").read_text())
    assert (dataset["images"], dataset["steps_per_epoch"]) == (16, 2)  # the stills included


def test_a_video_run_stopped_mid_epoch_resumes_bit_for_bit(
    straight_run, video_folder, wan_vae_folder, tmp_path
):
    run_dir = tmp_path / "resumed"
    first = train(build_config(video_raw(video_folder, wan_vae_folder, run_dir, 3)))
    data = json.loads((first.last_checkpoint / "state.json").read_text())["data"]
    assert data["batch_in_epoch"] == 1  # step 3 stops one pack into the second epoch
    resumed = train(build_config(video_raw(video_folder, wan_vae_folder, run_dir, 6)))
    a = load_checkpoint(straight_run.last_checkpoint)
    b = load_checkpoint(resumed.last_checkpoint)
    assert set(a.tensors) == {"transformer", "ema"}
    assert_same(a.tensors, b.tensors, "weights")
    assert_same(a.objects, b.objects, "optimizer and rng")


def test_memoised_clips_and_stills_are_read_once_and_train_alike(
    straight_run, video_folder, wan_vae_folder, tmp_path, monkeypatch
):
    """``cache.latents: memory``: after the first epoch the loader reads no pixels (the memo
    holds every sample's latents; reading a demo clip's frames each epoch took 22 % of the
    video demo's step), and the run trains bit for bit as one that reads them every epoch."""
    import impasto.data.dataset as dataset_module
    import impasto.train.memo as memo_module

    real = dataset_module.apply_bucket_transform
    reads = {"skipped": 0, "read": 0}

    def counting(which: str):
        def transform(image, params):
            reads[which] += 1
            return real(image, params)

        return transform

    monkeypatch.setattr(dataset_module, "apply_bucket_transform", counting("skipped"))
    skipped = train(build_config(video_raw(video_folder, wan_vae_folder, tmp_path / "a", 6)))
    monkeypatch.setattr(dataset_module, "apply_bucket_transform", counting("read"))
    monkeypatch.setattr(memo_module, "skip_memoised_pixels", lambda *args: None)
    read = train(build_config(video_raw(video_folder, wan_vae_folder, tmp_path / "b", 6)))
    # 6 steps = 3 epochs of 2 packs: every frame of every sample read in each, or in the first
    assert reads["read"] == 3 * reads["skipped"] > 0
    a, b = load_checkpoint(skipped.last_checkpoint), load_checkpoint(read.last_checkpoint)
    assert_same(a.tensors, b.tensors, "weights")
    assert_same(a.tensors, load_checkpoint(straight_run.last_checkpoint).tensors, "weights")
    losses = [
        [json.loads(line).get("loss") for line in (run.run_dir / "metrics.jsonl").open()]
        for run in (skipped, read)
    ]
    assert losses[0] == losses[1]


def test_the_checkpoint_samples_clips(straight_run, tmp_path):
    from impasto.cli import main
    from impasto.data.video.probe import probe_clip

    out = tmp_path / "clips"
    args = ["sample", str(straight_run.run_dir), "--prompt", "a blue square moving up on a black "
            "background", "--frames", "5", "--steps", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    written = sorted(path.suffix for path in out.iterdir())
    assert written == [".mp4", ".png", ".webp"]
    [mp4] = out.glob("*.mp4")
    info = probe_clip(mp4)
    assert (info.num_frames, info.height, info.width) == (5, 32, 32)
    with Image.open(next(out.glob("*.webp"))) as preview:
        assert preview.n_frames == 5


def _sample_grid(model: Path, out: Path) -> np.ndarray:
    from impasto.cli import main

    args = ["sample", str(model), "--prompt", "a green square moving right on a gray background",
            "--frames", "5", "--steps", "2", "--seed", "4", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    with Image.open(next(out.glob("*.png"))) as grid:
        return np.asarray(grid)


def test_an_exported_video_dit_keeps_its_vae_and_samples_the_same(straight_run, tmp_path):
    from impasto.cli import main
    from impasto.models.autoencoder import is_video_vae
    from impasto.sample_source import open_model

    folder = tmp_path / "dit"
    args = ["export", str(straight_run.run_dir), "--format", "folder", "--out", str(folder),
            "--dtype", "fp32"]  # fmt: skip
    assert main(args) == 0
    assert is_video_vae(open_model(folder).backbone.frozen()["vae"])
    expected = _sample_grid(straight_run.run_dir, tmp_path / "from-run")
    assert np.array_equal(_sample_grid(folder, tmp_path / "from-folder"), expected)
