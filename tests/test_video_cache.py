"""The disk cache of a video run's latents (issue #32): clips (and still images, as one-frame
clips) are encoded a chunk of frames at a time, keyed by their content and frames; a run from
the cache trains bit for bit as one that encodes on the fly; a second start encodes nothing;
caching a 257-frame clip holds one chunk of frames; a clip that changed is encoded again, one
that no longer decodes is named and skipped; ``placement: random`` is refused in one line."""

from __future__ import annotations

import copy
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from impasto.config import build_config
from impasto.data import ImageCaptionDataset, Skipped
from impasto.data.buckets import apply_bucket_transform
from impasto.data.cache import clip_latent_key
from impasto.data.cache_fill import fill_cache, identify_images
from impasto.data.pipeline import cache_data, load_records
from impasto.data.video import clip_cache
from impasto.data.video.records import clip_sampling, run_clip_slots
from impasto.models import build_backbone
from impasto.train.trainer import train

pytest.importorskip("av")

LONG_CLIP = 257
SIDE = 32


@pytest.fixture(scope="module")
def wan_vae_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_video_vae import tiny_wan_vae

    folder = tmp_path_factory.mktemp("wan") / "vae"
    tiny_wan_vae(0).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture
def video_folder(tmp_path: Path) -> Path:
    """4 demo clips (frame folders of 17 and 9 frames, 32 px) and 2 still images."""
    from impasto.data.demo import write_demo_dataset
    from impasto.data.demo_video import write_demo_video_dataset

    root = tmp_path / "data"
    write_demo_video_dataset(root / "clips", num_clips=4, seed=0, variants=[(32, 17), (32, 9)])
    write_demo_dataset(root / "stills", num_images=2, size=SIDE, seed=0)
    return root


def video_raw(tmp_path: Path, data: Path, vae: Path, latents: str, out: str) -> dict[str, Any]:
    return {
        "model": {
            "family": "dit", "preset": "tiny", "vae": str(vae),
            "dit": {"autoencoder": "video", "attention": "spatiotemporal", "text_length": 16},
        },
        "objective": {"prediction_type": "flow", "flow_shift": 2.0,
                      "flow_shift_resolution": SIDE},
        "data": {"path": str(data), "resolution": SIDE, "index_dir": str(tmp_path / "index"),
                 "video": {"num_frames": 17, "placement": "even"}, "pack_tokens": 128,
                 "caption_dropout": 0.2},
        "cache": {"latents": latents, "text_embeddings": "memory", "dtype": "float32",
                  "dir": str(tmp_path / "cache")},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(tmp_path / out), "seed": 3, "max_steps": 4},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }  # fmt: skip


def losses_of(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if "loss" in record]


def fill(config, backbone=None):
    """The fill a run makes before training: records, clip slots, ids, then the cache."""
    backbone = backbone or build_backbone(config)
    records, _ = run_clip_slots(config.data.video, load_records(config))
    records, ids = identify_images(config, records)
    encodings, report = fill_cache(config, backbone, records, ids, None, torch.no_grad, "None")
    return records, encodings, report


def test_a_run_from_the_disk_cache_trains_as_the_memory_cache_and_reuses_it(
    tmp_path, video_folder, wan_vae_folder, capsys
):
    disk = video_raw(tmp_path, video_folder, wan_vae_folder, "disk", "disk")
    memory = video_raw(tmp_path, video_folder, wan_vae_folder, "memory", "memory")
    first = losses_of(train(build_config(disk)).run_dir)
    assert "latents 6 encoded, 0 already cached" in capsys.readouterr().out  # 4 clips, 2 stills
    assert len(first) == 4 and all(np.isfinite(first))
    assert first == losses_of(train(build_config(memory)).run_dir)  # bit for bit
    again = copy.deepcopy(disk)
    again["train"]["output_dir"] = str(tmp_path / "again")
    capsys.readouterr()
    assert losses_of(train(build_config(again)).run_dir) == first
    assert "latents 0 encoded, 6 already cached" in capsys.readouterr().out


def test_cached_clips_are_the_posteriors_of_their_frames(tmp_path, video_folder, wan_vae_folder):
    """Frame folders and mp4s, two clips of 5 frames from each 17-frame video, and stills: each
    cached sample is bitwise the posterior of the frames the dataset decodes on the fly."""
    from impasto.data.demo_video import write_demo_video_dataset

    write_demo_video_dataset(video_folder / "mp4", num_clips=2, seed=1, fmt="mp4",
                             variants=[(32, 17), (32, 9)])  # fmt: skip
    raw = video_raw(tmp_path, video_folder, wan_vae_folder, "disk", "run")
    raw["data"]["video"].update(num_frames=5, clips_per_video=2)
    config = build_config(raw)
    backbone = build_backbone(config)
    records, encodings, report = fill(config, backbone)
    assert (report.latents_encoded, report.unreadable) == (11, [])  # 3 x 2 + 3 x 1 clips, 2 stills
    sampling = clip_sampling(config.data.video)
    settings = (records, SIDE, "center", False, 3)
    cached = ImageCaptionDataset(*settings, cache=encodings, video=sampling)
    plain = ImageCaptionDataset(*settings, video=sampling)
    starts = set()
    for index in range(len(records)):
        from_cache, from_pixels = cached[(1, index)], plain[(1, index)]
        assert from_cache.pixel_values is None and from_cache.clip_start == from_pixels.clip_start
        with torch.no_grad():
            mean, std = backbone.latent_posterior(from_pixels.pixel_values[None])
        assert torch.equal(from_cache.latent_mean, mean[0])
        assert torch.equal(from_cache.latent_std, std[0])
        frames = 1 if records[index].clip is None else 2
        assert from_cache.latent_mean.shape == (4, frames, 4, 4)
        starts.add((Path(records[index].image_path).suffix, from_cache.clip_start))
    assert {(".mp4", 1), (".mp4", 10), ("", 1), ("", 10), ("", 2), (".png", -1)} <= starts


class LiveFrames:
    """Frames handed out by the fill's reader and transform, tracked through weak references:
    how many are alive at once (held by the encoder, the reader or a view of them)."""

    def __init__(self) -> None:
        self.handed: list[tuple[weakref.ref, int]] = []
        self.reads: list[tuple[int, int]] = []
        self.max_live = 0

    def track(self, tensor: torch.Tensor, frames: int) -> torch.Tensor:
        self.handed.append((weakref.ref(tensor), frames))
        live = sum(count for ref, count in self.handed if ref() is not None)
        self.max_live = max(self.max_live, live)
        return tensor


def write_frame_folder(folder: Path, num_frames: int) -> None:
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    for index in range(num_frames):
        pixels = generator.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"frame_{index:04d}.png")
    (folder / "fps.txt").write_text("24", encoding="utf-8")
    folder.with_name(folder.name + ".txt").write_text("noise", encoding="utf-8")


def test_caching_a_257_frame_clip_holds_one_chunk_of_frames(tmp_path, wan_vae_folder, monkeypatch):
    """Issue #32's bound: at most ``CHUNK_FRAMES`` (16) transformed frames are alive at any
    time during the fill, counting each frame the transform makes and each chunk the encoder
    reads, so nothing of an earlier chunk is kept. Encoding the clip whole would hold all 257
    frames (the clip tensor ``[1, 3, 257, 32, 32]``), 16 times the bound; the decoder holds
    one decoded frame besides (each frame is decoded in one pass, as it is read)."""
    clip = tmp_path / "data" / "long"
    write_frame_folder(clip, LONG_CLIP)
    raw = video_raw(tmp_path, tmp_path / "data", wan_vae_folder, "disk", "run")
    raw["data"].update(video={"num_frames": LONG_CLIP, "placement": "even"}, pack_tokens=None)
    raw["cache"]["text_embeddings"] = "none"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    live = LiveFrames()
    transform, read = clip_cache.apply_bucket_transform, clip_cache.ChunkReader.__call__

    def tracked_read(reader, start: int, stop: int) -> torch.Tensor:
        live.reads.append((start, stop))
        return live.track(read(reader, start, stop), stop - start)

    monkeypatch.setattr(clip_cache, "apply_bucket_transform",
                        lambda image, params: live.track(transform(image, params), 1))  # fmt: skip
    monkeypatch.setattr(clip_cache.ChunkReader, "__call__", tracked_read)
    report = cache_data(build_config(raw))  # `impasto cache CONFIG`
    assert (report.latents_encoded, report.unreadable) == (1, [])
    assert live.max_live <= clip_cache.CHUNK_FRAMES < LONG_CLIP
    assert live.reads[0] == (0, 1) and live.reads[-1] == (241, 257) and len(live.reads) == 17
    monkeypatch.undo()
    # the entry is the clip's posterior (checked on its first 33 frames: the encoder is causal)
    config = build_config(raw)
    backbone = build_backbone(config)
    records, encodings, report = fill(config, backbone)
    assert (report.latents_encoded, report.latents_found) == (0, 1)
    dataset = ImageCaptionDataset(records, SIDE, "center", False, 3, cache=encodings,
                                  video=clip_sampling(config.data.video))  # fmt: skip
    mean = dataset[(0, 0)].latent_mean
    assert mean.shape == (4, 65, 4, 4)
    frames = sorted(clip.glob("*.png"))[:33]
    params = dataset.transform.params(SIDE, SIDE, None, None)
    pixels = []
    for frame in frames:
        with Image.open(frame) as image:
            pixels.append(apply_bucket_transform(image, params))
    with torch.no_grad():
        expected, _ = backbone.latent_posterior(torch.stack(pixels, dim=1)[None])
    assert torch.equal(mean[:, :9], expected[0])


def test_a_changed_clip_is_encoded_again_and_one_that_no_longer_decodes_is_skipped(
    tmp_path, video_folder, wan_vae_folder, caplog
):
    raw = video_raw(tmp_path, video_folder, wan_vae_folder, "disk", "run")
    config = build_config(raw)
    backbone = build_backbone(config)
    _, _, first = fill(config, backbone)
    assert (first.latents_encoded, first.latents_found) == (6, 0)
    clips = sorted(path for path in (video_folder / "clips").iterdir() if path.is_dir())
    changed = sorted(clips[0].iterdir())[3]
    Image.new("RGB", (SIDE, SIDE), (9, 9, 9)).save(changed)  # same frames, new pixels
    _, _, second = fill(config, backbone)
    assert (second.latents_encoded, second.latents_found) == (1, 5)
    # A clip cut short after it was probed and hashed, before it was cached (a new cache):
    raw["cache"]["dir"] = str(tmp_path / "another-cache")
    config = build_config(raw)
    records, _ = run_clip_slots(config.data.video, load_records(config))
    records, ids = identify_images(config, records)
    truncated = next(i for i, r in enumerate(records) if r.clip and r.clip.num_frames == 17)
    name = records[truncated].image_path
    for frame in sorted(Path(name).iterdir())[9:]:
        frame.unlink()
    encodings, report = fill_cache(config, backbone, records, ids, None, torch.no_grad, "None")
    assert report.unreadable == [str(name)] and report.latents_encoded == 5
    dataset = ImageCaptionDataset(records, SIDE, "center", False, 3, cache=encodings,
                                  video=clip_sampling(config.data.video))  # fmt: skip
    skipped = dataset[(0, truncated)]
    assert isinstance(skipped, Skipped) and skipped.name == str(name)
    assert skipped.reason.startswith("not in the cache") and str(name) in caplog.text
    # An entry of the wrong shape under a clip's key is skipped like an image's.
    other = next(i for i, r in enumerate(records) if r.clip and i != truncated)
    image_id, frames = ids[other], clip_cache.sample_frames(records[other], dataset.video, 3)
    params = dataset.transform.params(image_id.height, image_id.width, None, None)
    key = clip_latent_key(image_id, frames, params, encodings.vae_fingerprint, "float32")
    bad = {f"{key}.mean": torch.zeros(4, 2, 4, 4), f"{key}.std": torch.zeros(4, 2, 4, 4)}
    save_file(bad, str(encodings.store.folder / "zz-bad.safetensors"))
    encodings.store.refresh()
    mismatched = dataset[(0, other)]
    assert isinstance(mismatched, Skipped) and "shape (4, 2, 4, 4)" in mismatched.reason


def test_a_truncated_clip_is_reported_by_the_run(tmp_path, video_folder, wan_vae_folder):
    """Training from the cache names a clip the fill could not encode in bad-data.tsv."""
    raw = video_raw(tmp_path, video_folder, wan_vae_folder, "disk", "run")
    raw["data"]["max_bad_fraction"] = 0.5
    clip = sorted(path for path in (video_folder / "clips").iterdir() if path.is_dir())[0]
    real = clip_cache.sample_pictures

    def cut_short(record, indices):  # the clip ends after 3 frames while it is cached
        if Path(record.image_path) == clip:
            for frame in sorted(clip.iterdir())[3:]:
                frame.unlink()
        return real(record, indices)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clip_cache, "sample_pictures", cut_short)
        result = train(build_config(raw))
    report = (result.run_dir / "bad-data.tsv").read_text()
    assert f"{clip}\tnot in the cache" in report and result.state.images_bad >= 1


def test_a_random_placement_with_the_disk_cache_is_one_line(tmp_path, wan_vae_folder):
    from impasto.train.checks import video_problems

    raw = video_raw(tmp_path, tmp_path, wan_vae_folder, "disk", "run")
    raw["data"]["video"]["placement"] = "random"
    [problem] = video_problems(build_config(raw))
    assert "\n" not in problem and "set data.video.placement: even" in problem
    raw["data"]["video"]["placement"] = "even"
    assert video_problems(build_config(raw)) == []


def test_a_frame_folder_gets_a_new_content_id_when_a_frame_changes(tmp_path):
    from impasto.data.folder import ImageRecord
    from impasto.data.video.content import clip_sha256, clip_stat_identity

    folder = tmp_path / "clip"
    write_frame_folder(folder, 3)
    record = ImageRecord(folder, "noise")
    before, identity = clip_sha256(record), clip_stat_identity(record)
    shutil.copy(folder / "frame_0000.png", folder / "frame_0001.png")
    assert clip_sha256(record) != before and clip_stat_identity(record) != identity
