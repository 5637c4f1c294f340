"""Clips from webdataset tar shards (issue #32): video members probed by decoding their byte
ranges, probes kept by shard and member, bad members and shards left out and listed, samples
decoded, cached and resumed like a folder's clips."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import impasto.data.video.share as share
from impasto.config.video import VideoConfig
from impasto.data import build_dataloader
from impasto.data.cache import compute_image_id
from impasto.data.dataset import ImageCaptionDataset
from impasto.data.sources import FileRangeBlob
from impasto.data.video.probe import decode_frames
from impasto.data.video.records import (
    clip_reader,
    clip_sampling,
    clip_shard_scan,
    expand_clip_slots,
    sample_shapes,
)

av = pytest.importorskip("av", reason="video data needs PyAV: pip install -e '.[video]'")

SIZE = 32


def grey(index: int) -> np.ndarray:
    """Frame ``index`` of every fixture video: a flat grey of level 20·index + 10."""
    return np.full((SIZE, SIZE, 3), 20 * index + 10, dtype=np.uint8)


def video_bytes(num_frames: int, container: str, codec: str) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=8)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(grey(index), format="rgb24")
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def levels(frames: torch.Tensor) -> list[int]:
    """Which fixture frame each of ``frames`` ``[T, H, W, 3]`` is (by its grey level)."""
    return [round((float(frame.float().mean()) - 10) / 20) for frame in frames]


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 20, 20)).save(buffer, format="PNG")
    return buffer.getvalue()


MP4 = video_bytes(9, "mp4", "libx264")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """shard-0: an mp4, a gif with a json caption, a still image, a broken mp4 and a sample
    without media; shard-1: a .mov (mpeg4); shard-2: not a tar."""
    folder = tmp_path_factory.mktemp("clip-shards")
    write_tar(folder / "shard-0.tar", [
        ("a.mp4", MP4), ("a.txt", b" a ramp of nine \n"),
        ("b.gif", video_bytes(5, "gif", "gif")), ("b.json", b'{"caption": "five"}'),
        ("c.png", png(48, 32)), ("c.txt", b"a red still"),
        ("d.mp4", b"not a video at all" * 20), ("d.txt", b"broken"),
        ("e.txt", b"no media"),
    ])  # fmt: skip
    write_tar(folder / "shard-1.tar", [("f.mov", video_bytes(13, "mov", "mpeg4"))])
    (folder / "shard-2.tar").write_bytes(b"garbage" * 100)
    return folder


def scan(folder: Path, index_dir: Path):
    return clip_shard_scan(SimpleNamespace(path=str(folder / "shard-{0..2}.tar")), index_dir)


def test_shards_read_clips_counted_by_decoding_with_captions(shards, tmp_path):
    found = scan(shards, tmp_path / "index")
    names = [str(r.image_path) for r in found.records]
    assert names == ["shard-0.tar/a.mp4", "shard-0.tar/b.gif", "shard-0.tar/c.png",
                     "shard-1.tar/f.mov"]  # fmt: skip
    assert [r.clip and r.clip.info.num_frames for r in found.records] == [9, 5, None, 13]
    assert [r.caption for r in found.records] == ["a ramp of nine", "five", "a red still", ""]
    assert [r.size for r in found.records] == [(SIZE, SIZE), (SIZE, SIZE), (32, 48), (SIZE, SIZE)]
    reasons = {item.name: item.reason for item in found.skipped}
    assert reasons["shard-0.tar/d.mp4"].startswith("is not a video PyAV can read")
    assert reasons["shard-0.tar/e"].startswith("no video or image member")
    assert "truncated or not an uncompressed tar" in reasons[str(shards / "shard-2.tar")]
    assert len(reasons) == 3 and all("\n" not in reason for reason in reasons.values())
    # A video is read from its byte range of the shard, no copy.
    blob = found.records[0].blob
    assert isinstance(blob, FileRangeBlob) and blob.read() == MP4
    assert levels(decode_frames(blob, [0, 4, 8])) == [0, 4, 8]


def test_probes_are_kept_by_shard_and_member_and_redone_when_a_shard_changes(
    shards, tmp_path, monkeypatch
):
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    probed: list[str] = []
    real = share.probe_clip
    monkeypatch.setattr(share, "probe_clip", lambda s, n: probed.append(n) or real(s, n))
    index_dir = tmp_path / "index"
    first = scan(copy, index_dir)
    assert sorted(probed) == ["shard-0.tar/a.mp4", "shard-0.tar/b.gif", "shard-0.tar/d.mp4",
                              "shard-1.tar/f.mov"]  # fmt: skip
    probed.clear()
    again = scan(copy, index_dir)
    assert probed == ["shard-0.tar/d.mp4"]  # only the broken one (never stored) again
    assert [r.clip and r.clip.info for r in again.records] == [
        r.clip and r.clip.info for r in first.records
    ]
    # shard-1 rewritten with a shorter .mov: its member is probed again, shard-0's are not.
    write_tar(copy / "shard-1.tar", [("f.mov", video_bytes(7, "mov", "mpeg4"))])
    stat = (copy / "shard-1.tar").stat()
    os.utime(copy / "shard-1.tar", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    probed.clear()
    changed = scan(copy, index_dir)
    assert sorted(probed) == ["shard-0.tar/d.mp4", "shard-1.tar/f.mov"]
    assert changed.records[-1].clip.info.num_frames == 7


def test_a_shard_clip_trains_cuts_caches_and_resumes_like_a_folder_clip(shards, tmp_path):
    sampling = clip_sampling(VideoConfig(num_frames=5, clips_per_video=2, placement="even"))
    records, short = expand_clip_slots(scan(shards, tmp_path / "index").records, sampling)
    assert short == []
    # a.mp4: 9 frames → one clip of 5 (9 // 5); b.gif: 5 → one; f.mov: 13 → two of 5.
    assert [(str(r.image_path).split("/")[1], r.clip and r.clip.slot) for r in records] == [
        ("a.mp4", 0), ("b.gif", 0), ("c.png", None), ("f.mov", 0), ("f.mov", 1)]  # fmt: skip
    shapes = sample_shapes(records, None, SIZE)
    assert shapes == [(5, SIZE, SIZE)] * 2 + [(1, SIZE, SIZE)] + [(5, SIZE, SIZE)] * 2
    dataset = ImageCaptionDataset(records, SIZE, "center", False, seed=0, video=sampling)
    slot = dataset[(0, 4)]  # f.mov's second clip: centred in frames [6, 12)
    assert slot.pixel_values.shape == (3, 5, SIZE, SIZE) and slot.clip_start == 7
    frames = ((slot.pixel_values.permute(1, 2, 3, 0) + 1) * 127.5).round()
    assert levels(frames) == [7, 8, 9, 10, 11]
    # The latent cache keys a shard clip by its bytes, read from the shard.
    assert compute_image_id(records[0]).sha256 == hashlib.sha256(MP4).hexdigest()

    def batches(start: tuple[int, int]) -> list[tuple[list[int], torch.Tensor]]:
        loader, _ = build_dataloader(
            records, SIZE, "center", False, 1, seed=3, start_position=start, video=sampling,
            sample_keys=shapes,
        )  # fmt: skip
        return [(b.indices.tolist(), b.pixel_values) for b in loader]

    whole = batches((0, 0))
    assert sorted(index for indices, _ in whole for index in indices) == list(range(5))
    resumed = batches((0, 2))  # a run resumed after two batches of the epoch
    assert [indices for indices, _ in resumed] == [indices for indices, _ in whole[2:]]
    for (_, got), (_, want) in zip(resumed, whole[2:], strict=True):
        assert torch.equal(got, want)


def test_hf_sources_still_refuse_clips_in_one_line():
    assert clip_reader("webdataset") is clip_shard_scan
    with pytest.raises(ValueError, match=r"^data\.source hf: clips are read from folders, ") as hf:
        clip_reader("hf")
    assert "\n" not in str(hf.value)


def test_a_parquet_manifest_reads_video_bytes_paths_and_images(shards, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from impasto.data.sources import ParquetRowBlob
    from impasto.data.video.records import clip_manifest_scan

    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "five.gif").write_bytes(video_bytes(5, "gif", "gif"))
    rows = [
        {"video": MP4, "image": None, "caption": "nine from bytes"},
        {"video": None, "image": png(48, 32), "caption": "a still"},
        {"video": None, "image": None, "caption": "no media"},
        {"video": b"not a video" * 9, "image": None, "caption": "broken"},
        {"video": None, "image": None, "caption": "nothing"},
    ]
    table = pa.table({
        "video": pa.array([row["video"] for row in rows], pa.binary()),
        "image": pa.array([row["image"] for row in rows], pa.binary()),
        "caption": [row["caption"] for row in rows],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=2)
    probed: list[str] = []
    real = share.probe_clip
    monkeypatch.setattr(share, "probe_clip", lambda s, n: probed.append(n) or real(s, n))
    source = SimpleNamespace(path=str(tmp_path / "rows.parquet"))
    found = clip_manifest_scan(source, tmp_path / "index")
    assert [(r.image_path, r.caption) for r in found.records] == [
        ("rows.parquet/row-1", "nine from bytes"), ("rows.parquet/row-2", "a still")]  # fmt: skip
    video, still = found.records
    assert video.clip.info.num_frames == 9 and still.clip is None and still.size == (32, 48)
    assert isinstance(video.blob, ParquetRowBlob) and video.blob.column == "video"
    assert levels(decode_frames(video.blob, [1, 7])) == [1, 7]
    reasons = {item.name: item.reason for item in found.skipped}
    assert reasons["rows.parquet/row-4"].startswith("is not a video PyAV can read")
    assert reasons[f"{tmp_path / 'rows.parquet'} row 3"] == "no 'video' or 'image' field"
    assert reasons[f"{tmp_path / 'rows.parquet'} row 5"] == "no 'video' or 'image' field"
    assert sorted(probed) == ["rows.parquet/row-1", "rows.parquet/row-4"]
    probed.clear()
    again = clip_manifest_scan(source, tmp_path / "index")
    assert probed == ["rows.parquet/row-4"]  # the good probe came from the index
    assert again.records[0].clip.info == video.clip.info
    # A path (a string cell, relative to the file's folder) is read as a folder row is.
    paths = pa.table({"video": ["clips/five.gif"], "caption": ["a path"]})
    pq.write_table(paths, tmp_path / "paths.parquet")
    [gif] = clip_manifest_scan(SimpleNamespace(path=str(tmp_path / "paths.parquet")),
                               tmp_path / "index").records  # fmt: skip
    assert gif.image_path == tmp_path / "clips" / "five.gif" and gif.clip.info.num_frames == 5


def test_a_clip_shard_source_without_media_is_one_line(tmp_path):
    from impasto.data.skips import UnreadableSource

    write_tar(tmp_path / "s.tar", [("x.txt", b"caption only"), ("y.wav", b"RIFF")])
    with pytest.raises(UnreadableSource, match="no readable videos or images"):
        clip_shard_scan(SimpleNamespace(path=str(tmp_path / "s.tar")), tmp_path / "index")
