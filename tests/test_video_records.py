"""Clips as training records (issue #32): a folder of videos, frame folders and images read
as clip records, videos cut into their clip slots, clip samples decoded and transformed, and
batches grouped by (frames, height, width)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.config.load import build_config
from impasto.config.video import VideoConfig
from impasto.data.buckets import apply_bucket_transform
from impasto.data.dataset import ImageCaptionDataset, collate_examples
from impasto.data.demo_video import write_demo_video_dataset
from impasto.data.skips import Skipped
from impasto.data.video.probe import decode_frames
from impasto.data.video.records import (
    clip_folder_scan,
    clip_sampling,
    expand_clip_slots,
    frames_of,
)
from impasto.objectives.process import flow_shift_at
from impasto.train.memo import memo_keys

pytest.importorskip("av")


def write_frame_folder(folder: Path, num_frames: int, caption: str, size: int = 32) -> None:
    """A frame folder whose frame i is a flat grey of level 10·i (each frame tells itself
    apart), with its caption beside it."""
    folder.mkdir(parents=True)
    for index in range(num_frames):
        level = np.full((size, size, 3), 10 * index, dtype=np.uint8)
        Image.fromarray(level).save(folder / f"{index:03d}.png")
    (folder / "fps.txt").write_text("8\n")
    folder.with_name(folder.name + ".txt").write_text(caption + "\n")


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Demo clips of 17 and 9 frames (frame folders), a 24-frame grey ramp, a still image, a
    broken video and a video too short for min_frames 5."""
    root = tmp_path_factory.mktemp("clips")
    write_demo_video_dataset(root / "demo", num_clips=4, seed=0, variants=[(32, 17), (32, 9)])
    write_frame_folder(root / "ramp", 24, "a grey ramp")
    write_frame_folder(root / "short", 3, "three frames")
    Image.new("RGB", (48, 32), (200, 10, 10)).save(root / "still.png")
    (root / "still.txt").write_text("a red still\n")
    (root / "broken.mp4").write_bytes(b"not a video at all" * 10)
    return root


def scan(folder: Path, index_dir: Path | None = None):
    return clip_folder_scan(SimpleNamespace(path=str(folder)), index_dir or folder / ".index")


def test_a_clip_folder_reads_videos_frame_folders_and_images_and_lists_the_broken(clip_folder):
    found = scan(clip_folder)
    names = sorted(Path(r.image_path).name for r in found.records)
    assert names == ["clip-00000", "clip-00001", "clip-00002", "clip-00003", "ramp", "short",
                     "still.png"]  # fmt: skip
    counts = {Path(r.image_path).name: r.clip and r.clip.info.num_frames for r in found.records}
    assert counts["clip-00000"] == 17 and counts["clip-00001"] == 9 and counts["ramp"] == 24
    assert counts["still.png"] is None  # an image: a one-frame record, no clip
    still = next(r for r in found.records if Path(r.image_path).name == "still.png")
    assert still.size == (32, 48) and still.caption == "a red still"
    [broken] = found.skipped
    assert broken.name.endswith("broken.mp4") and "\n" not in broken.reason


def test_videos_become_clip_slots_that_share_a_placement_key(clip_folder):
    sampling = clip_sampling(VideoConfig(num_frames=9, clips_per_video=3, min_frames=5))
    records, short = expand_clip_slots(scan(clip_folder).records, sampling)
    by_name: dict[str, list] = {}
    for index, record in enumerate(records):
        by_name.setdefault(Path(record.image_path).name, []).append((index, record))
    ramp = by_name["ramp"]  # 24 frames: two clips of 9 (24 // 9), never three
    assert [r.clip.slot for _, r in ramp] == [0, 1]
    assert {r.clip.key for _, r in ramp} == {ramp[0][0]}  # the dataset index of slot 0
    assert [r.clip.num_clips for _, r in ramp] == [2, 2]
    assert len(by_name["clip-00000"]) == 1  # 17 frames: one clip of 9
    assert "short" not in by_name  # 3 frames < min_frames 5: left out, with the reason
    assert [item.name.endswith("short") for item in short] == [True]
    assert "min_frames" in short[0].reason
    assert frames_of(records) == [1 if r.clip is None else 9 for r in records]


def ramp_dataset(clip_folder: Path, placement: str):
    sampling = clip_sampling(VideoConfig(num_frames=9, clips_per_video=2, placement=placement))
    records, _ = expand_clip_slots(scan(clip_folder).records, sampling)
    ramp = [i for i, r in enumerate(records) if Path(r.image_path).name == "ramp"]
    dataset = ImageCaptionDataset(records, 32, "center", False, seed=3, video=sampling)
    return dataset, ramp


def levels(example) -> list[int]:
    """The grey level of each frame of a ramp sample (frame i of the ramp is level 10·i)."""
    pixels = (example.pixel_values[0, :, 0, 0] + 1) * 127.5
    return [int(round(float(value))) for value in pixels]


def test_a_videos_clips_never_overlap_and_move_each_epoch(clip_folder):
    dataset, ramp = ramp_dataset(clip_folder, "random")
    starts = {}
    for epoch in range(4):
        clips = [dataset[(epoch, index)] for index in ramp]
        frames = [[level // 10 for level in levels(clip)] for clip in clips]
        for clip, indices in zip(clips, frames, strict=True):
            assert indices == list(range(indices[0], indices[0] + 9))  # consecutive frames
            assert clip.clip_start == indices[0]
        assert frames[0][-1] < frames[1][0]  # slot 0 before slot 1: no overlap
        starts[epoch] = tuple(clip.clip_start for clip in clips)
    assert len(set(starts.values())) > 1  # placement: random moves them between epochs
    again, _ = ramp_dataset(clip_folder, "random")  # a fresh dataset (a resume): the same
    assert tuple(again[(2, index)].clip_start for index in ramp) == starts[2]
    even, _ = ramp_dataset(clip_folder, "even")
    # each clip centred in its segment, [0, 12) and [12, 24), every epoch
    assert {tuple(even[(e, i)].clip_start for i in ramp) for e in range(3)} == {(1, 13)}


def test_a_clip_sample_is_its_decoded_frames_each_transformed_alike(clip_folder):
    sampling = clip_sampling(VideoConfig(num_frames=17))
    records, _ = expand_clip_slots(scan(clip_folder).records, sampling)
    index = next(i for i, r in enumerate(records) if Path(r.image_path).name == "clip-00000")
    dataset = ImageCaptionDataset(records, 64, "center", False, seed=0, video=sampling)
    example = dataset[(0, index)]
    assert example.pixel_values.shape == (3, 17, 64, 64)  # 32 px clip resized to 64
    frames = decode_frames(records[index].image_path, range(17))
    generator = torch.Generator().manual_seed(0)
    params = dataset.transform.params(32, 32, None, generator)
    for t in (0, 8, 16):
        expected = apply_bucket_transform(Image.fromarray(frames[t].numpy()), params)
        assert torch.equal(example.pixel_values[:, t], expected)
    still = next(i for i, r in enumerate(records) if r.clip is None)
    image = dataset[(0, still)]
    assert image.pixel_values.shape == (3, 1, 64, 64) and image.clip_start == -1


def test_a_clip_that_stops_decoding_is_skipped_not_fatal(clip_folder, tmp_path):
    import shutil

    copy = tmp_path / "clips"
    shutil.copytree(clip_folder / "demo", copy)
    sampling = clip_sampling(VideoConfig(num_frames=17))
    records, _ = expand_clip_slots(scan(copy).records, sampling)
    index = next(i for i, r in enumerate(records) if Path(r.image_path).name == "clip-00000")
    for frame in (copy / "clip-00000").glob("01*.png"):  # frames 10-16 go after the probe
        frame.unlink()
    dataset = ImageCaptionDataset(records, 32, "center", False, seed=0, video=sampling)
    skipped = dataset[(0, index)]
    assert isinstance(skipped, Skipped) and skipped.name.endswith("clip-00000")
    assert "probe it again" in skipped.reason


def test_a_batch_groups_its_samples_by_frames_and_size(clip_folder):
    sampling = clip_sampling(VideoConfig(num_frames=17))
    records, _ = expand_clip_slots(scan(clip_folder).records, sampling)
    dataset = ImageCaptionDataset(records, 32, "center", False, seed=0, video=sampling)
    batch = collate_examples([dataset[(0, index)] for index in range(len(records))])
    shapes = sorted(tuple(group.pixel_values.shape[2:]) for group in batch.shape_groups())
    assert shapes == [(1, 32, 32), (9, 32, 32), (17, 32, 32), (17, 32, 32)][: len(shapes)]
    assert {s[0] for s in shapes} == {1, 9, 17}
    assert batch.clip_starts.tolist() == [
        s for group in batch.shape_groups() for s in group.clip_starts.tolist()
    ]
    keys = memo_keys(batch)  # a clip's posterior is kept per (record, first frame)
    assert [start for _, start in keys] == batch.clip_starts.tolist()


def test_the_flow_shift_grows_with_a_clips_latent_frames():
    assert flow_shift_at(3.0, 64, (64, 64)) == pytest.approx(3.0)
    assert flow_shift_at(3.0, 64, (4, 64, 64)) == pytest.approx(6.0)  # 4x the tokens: 2x
    assert flow_shift_at(3.0, 64, (1, 64, 64)) == flow_shift_at(3.0, 64, (64, 64))


def test_video_config_errors_name_the_key(tiny_raw):
    with pytest.raises(ValueError, match=r"data\.video\.num_frames must be k·4\+1.*use 13 or 17"):
        build_config({**tiny_raw, "data": {**tiny_raw["data"], "video": {"num_frames": 16}}})
    with pytest.raises(ValueError, match="fps or frame_stride"):
        build_config(
            {**tiny_raw, "data": {**tiny_raw["data"], "video": {"fps": 8, "frame_stride": 2}}}
        )


def test_a_video_run_of_an_image_family_is_refused_in_one_line(tiny_raw):
    from impasto.train.checks import config_problems

    raw = {**tiny_raw, "data": {**tiny_raw["data"], "video": {"num_frames": 9}}}
    raw["cache"] = {"latents": "disk"}
    problems = config_problems(build_config(raw))
    assert any(p.startswith("data.video: the sdxl family trains on images") for p in problems)
    assert any(p.startswith("cache.latents: disk caches each clip's frames once") for p in problems)


def test_the_probe_index_decodes_each_clip_once_until_it_changes(
    clip_folder, tmp_path, monkeypatch
):
    import shutil

    import impasto.data.video.share as share_module

    copy = tmp_path / "clips"
    shutil.copytree(clip_folder / "demo", copy)
    probed: list[str] = []
    real = share_module.probe_clip

    def counting(source, name=None, fps=None):
        probed.append(Path(str(source)).name)
        return real(source, name, fps)

    monkeypatch.setattr(share_module, "probe_clip", counting)
    index_dir = tmp_path / "index"
    first = scan(copy, index_dir)
    assert sorted(probed) == ["clip-00000", "clip-00001", "clip-00002", "clip-00003"]
    probed.clear()
    again = scan(copy, index_dir)
    assert probed == []  # every probe from the index
    assert [r.clip.info for r in again.records] == [r.clip.info for r in first.records]
    (copy / "clip-00001" / "008.png").unlink()  # a frame folder loses its last frame
    changed = scan(copy, index_dir)
    assert probed == ["clip-00001"]
    counts = {Path(r.image_path).name: r.clip.info.num_frames for r in changed.records}
    assert counts["clip-00001"] == 8 and counts["clip-00000"] == 17
    [index] = index_dir.glob("clips-*.json")
    index.write_text("{not json")  # a damaged index: everything is probed again
    probed.clear()
    assert len(scan(copy, index_dir).records) == 4 and len(probed) == 4


def test_a_manifest_lists_videos_frame_folders_and_images(clip_folder, tmp_path):
    import json

    from impasto.data.video.records import clip_manifest_scan

    manifest = tmp_path / "clips.jsonl"
    rows = [
        {"video": str(clip_folder / "demo" / "clip-00000"), "caption": "first", "weight": 2},
        {"image": str(clip_folder / "still.png"), "caption": "a still"},
        {"video": str(clip_folder / "broken.mp4"), "caption": "broken"},
        {"caption": "no path"},
    ]
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    found = clip_manifest_scan(SimpleNamespace(path=str(manifest)), tmp_path / "index")
    assert [(Path(r.image_path).name, r.caption, r.weight) for r in found.records] == [
        ("clip-00000", "first", 2.0), ("still.png", "a still", 1.0)]  # fmt: skip
    assert found.records[0].clip.info.num_frames == 17 and found.records[1].clip is None
    reasons = {Path(item.name).name: item.reason for item in found.skipped}
    assert reasons["clips.jsonl line 4"] == "no 'video' or 'image' field"
    assert reasons["broken.mp4"].startswith("is not a video PyAV can")
