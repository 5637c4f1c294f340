"""Video data (issue #32): frames counted by decoding, clip sampling, broken clips left out.

Every fixture is written here with PyAV: frame ``i`` of a clip is black with a white bar at
``x = 8 i``, so a decoded frame says which frame it is (:func:`bar_indices`).
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.data.skips import BadDataLog
from impasto.data.video import (
    ClipInfo,
    ClipSampling,
    UnreadableClip,
    decode_clips,
    decode_frames,
    fit_frames,
    frame_grid,
    import_av,
    natural_key,
    probe_clip,
    probe_clips,
    sample_clips,
    scan_clip_folder,
)

av = pytest.importorskip("av", reason="video data needs PyAV: pip install -e '.[video]'")

NUM_FRAMES = 24
HEIGHT, BAR = 32, 8
WIDTH = BAR * NUM_FRAMES
# Milliseconds: irregular gaps (33, 84, 200, 10 ms ...) as a phone's variable-rate video has.
VFR_PTS_MS = [0, 33, 66, 150, 200, 400, 433, 466, 500, 700, 710, 720, 730, 1000, 1100, 1200,
              1300, 1333, 1366, 1400, 1600, 1700, 1800, 1900]  # fmt: skip


def bar_image(index: int) -> np.ndarray:
    """Frame ``index``: ``[HEIGHT, WIDTH, 3]`` uint8, white at columns ``8 index .. 8 index+7``."""
    image = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
    image[:, BAR * index : BAR * (index + 1)] = 255
    return image


def bar_indices(frames: torch.Tensor) -> list[int]:
    """Which frame each of ``frames`` (``[T, H, W, 3]``) is: the brightest bar."""
    bars = frames.float().reshape(len(frames), HEIGHT, NUM_FRAMES, BAR, 3).mean(dim=(1, 3, 4))
    return bars.argmax(dim=1).tolist()


def write_video(
    path: Path,
    codec: str = "libx264",
    rate: int = 24,
    pts_ms: list[int] | None = None,
    options: dict[str, str] | None = None,
) -> Path:
    """NUM_FRAMES bar frames; with ``pts_ms``, each frame's time in milliseconds (a variable
    frame rate), else ``rate`` frames per second."""
    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = WIDTH, HEIGHT
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        if pts_ms is not None:
            stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        for index in range(NUM_FRAMES):
            frame = av.VideoFrame.from_ndarray(bar_image(index), format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = pts_ms[index], Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def plain_decode_times(path: Path) -> list[float]:
    """What a plain PyAV loop decodes: each frame's time, until the stream ends or fails."""
    times = []
    with av.open(str(path)) as container:
        try:
            for frame in container.decode(video=0):
                times.append(float(frame.pts * frame.time_base))
        except av.error.FFmpegError:
            pass
    return times


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("videos")
    write_video(folder / "cfr.mp4")
    write_video(folder / "vfr.mkv", pts_ms=VFR_PTS_MS)
    write_video(folder / "vfr.mp4", pts_ms=VFR_PTS_MS)
    # The index (moov) first, as web videos are: cut off, the file still opens and its index
    # still lists every frame, so the metadata count is wrong.
    write_video(folder / "faststart.mp4", options={"movflags": "faststart"})
    return folder


@pytest.mark.parametrize(
    ("num_frames", "compression", "expected"),
    [(1, 4, 1), (4, 4, 1), (5, 4, 5), (16, 4, 13), (17, 4, 17), (81, 4, 81), (16, 8, 9),
     (7, 1, 7)],
)  # fmt: skip
def test_fit_frames(num_frames: int, compression: int, expected: int) -> None:
    assert fit_frames(num_frames, compression) == expected


def test_fit_frames_refuses_no_frames() -> None:
    with pytest.raises(ValueError, match="at least 1 frame"):
        fit_frames(0)


def test_constant_rate_mp4_is_counted_and_timed_by_decoding(videos: Path) -> None:
    info = probe_clip(videos / "cfr.mp4")
    assert info.num_frames == NUM_FRAMES
    assert (info.height, info.width) == (HEIGHT, WIDTH)
    assert info.timestamps == pytest.approx([index / 24 for index in range(NUM_FRAMES)], abs=1e-9)
    assert info.fps == pytest.approx(24.0)
    assert info.damage is None


def test_decode_frames_returns_the_frames_asked_for(videos: Path) -> None:
    frames = decode_frames(videos / "cfr.mp4", [5, 0, 23, 5, 6])
    assert frames.shape == (5, HEIGHT, WIDTH, 3) and frames.dtype == torch.uint8
    assert bar_indices(frames) == [5, 0, 23, 5, 6]


def test_decode_clips_reads_several_clips_in_one_pass(videos: Path) -> None:
    first, second = decode_clips(videos / "cfr.mp4", [(0, 1, 2), (10, 12, 14, 16, 18)])
    assert bar_indices(first) == [0, 1, 2] and bar_indices(second) == [10, 12, 14, 16, 18]
    with pytest.raises(UnreadableClip, match="decodes 24 frames, not frame 24.*probe it again"):
        decode_frames(videos / "cfr.mp4", [3, 24])
    with pytest.raises(ValueError, match="asks for no frames"):
        decode_clips(videos / "cfr.mp4", [(1,), ()])


@pytest.mark.parametrize("name", ["vfr.mkv", "vfr.mp4"])
def test_variable_frame_rate_is_resampled_by_timestamps(videos: Path, name: str) -> None:
    info = probe_clip(videos / name)
    assert info.num_frames == NUM_FRAMES
    assert info.timestamps == pytest.approx([pts / 1000 for pts in VFR_PTS_MS], abs=1e-9)
    assert info.fps == pytest.approx(23 / 1.9)
    # 10 fps: target times 0, 0.1, ..., 1.9 s, each the nearest decoded frame (0.1 s -> the
    # frame at 0.066 s, not 0.15 s; 0.8 s -> 0.73 s; 0.9 s -> 1.0 s; ties go to the earlier).
    grid = frame_grid(info, ClipSampling(fps=10))
    assert grid[:3] == [0, 2, 4] and grid[7:10] == [9, 12, 13] and grid[-1] == 23
    assert len(grid) == 20
    clips = sample_clips(info, ClipSampling(num_frames=5, fps=10, placement="even"))
    assert clips == [tuple(grid[7:12])]  # 20 steps, one 5-step clip centred
    assert bar_indices(decode_frames(videos / name, clips[0])) == list(clips[0])


def test_frames_are_counted_by_decoding_not_metadata(videos: Path) -> None:
    with av.open(str(videos / "vfr.mkv")) as container:
        assert container.streams.video[0].frames == 0  # Matroska stores no count
    assert probe_clip(videos / "vfr.mkv").num_frames == NUM_FRAMES


def truncate(source: Path, target: Path, fraction: float) -> Path:
    data = source.read_bytes()
    target.write_bytes(data[: int(len(data) * fraction)])
    return target


def test_truncated_file_keeps_the_frames_that_decode(videos: Path, tmp_path: Path) -> None:
    cut = truncate(videos / "vfr.mkv", tmp_path / "cut.mkv", 0.8)
    info = probe_clip(cut)
    plain = plain_decode_times(cut)
    assert 0 < info.num_frames == len(plain) < NUM_FRAMES
    assert info.timestamps == pytest.approx(plain, abs=1e-9)
    frames = decode_frames(cut, range(info.num_frames))
    assert bar_indices(frames) == list(range(info.num_frames))


def test_truncated_mp4_beats_its_index(videos: Path, tmp_path: Path) -> None:
    cut = truncate(videos / "faststart.mp4", tmp_path / "cut.mp4", 0.9)
    with av.open(str(cut)) as container:
        assert container.streams.video[0].frames == NUM_FRAMES  # the index lists the lost tail
    info = probe_clip(cut)
    assert info.damage == "Invalid data found when processing input"
    # The frames the decoder still held at the damage are flushed out, so at least as many as
    # a plain loop (which stops at the error) gives; each one is the frame its time says.
    assert len(plain_decode_times(cut)) <= info.num_frames < NUM_FRAMES
    frames = decode_frames(cut, range(info.num_frames))
    assert bar_indices(frames) == [round(time * 24) for time in info.timestamps]


def test_broken_files_raise_one_line_naming_the_file(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(UnreadableClip, match=r"garbage\.mp4: is not a video .*re-encode it"):
        probe_clip(garbage)
    (tmp_path / "empty.webm").write_bytes(b"")
    with pytest.raises(UnreadableClip, match=r"empty\.webm: is empty \(0 bytes\)"):
        probe_clip(tmp_path / "empty.webm")
    with pytest.raises(UnreadableClip, match="cannot be opened .*check that it exists"):
        probe_clip(tmp_path / "missing.mp4")
    with av.open(str(tmp_path / "sound.wav"), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000, layout="mono")
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), "s16", "mono")
        samples.sample_rate = 8000
        container.mux(stream.encode(samples))
        container.mux(stream.encode(None))
    with pytest.raises(UnreadableClip, match="has no video stream") as raised:
        probe_clip(tmp_path / "sound.wav")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("file", "codec"),
    [("a.mov", "libx264"), ("a.webm", "libvpx-vp9"), ("b.webm", "libvpx"), ("a.gif", "gif")],
)
def test_containers(tmp_path: Path, file: str, codec: str) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV wheel has no {codec} encoder")
    rate = 10 if codec == "gif" else 24  # GIF delays are in hundredths of a second
    path = write_video(tmp_path / file, codec=codec, rate=rate)
    info = probe_clip(path)
    assert info.num_frames == NUM_FRAMES
    # WebM stores milliseconds: 1/24 s is rounded to 42 ms.
    expected = [index / rate for index in range(NUM_FRAMES)]
    assert info.timestamps == pytest.approx(expected, abs=1e-3)
    assert bar_indices(decode_frames(path, range(NUM_FRAMES))) == list(range(NUM_FRAMES))


class BytesBlob:
    """A video's bytes, as a tar member or Parquet cell hands them over."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self) -> bytes:
        return self.data


def test_a_blob_reads_like_its_file(videos: Path) -> None:
    blob = BytesBlob((videos / "vfr.mkv").read_bytes())
    info = probe_clip(blob, name="shard-0001.tar/000007.mkv")
    assert info.timestamps == probe_clip(videos / "vfr.mkv").timestamps
    assert bar_indices(decode_frames(blob, [3, 4])) == [3, 4]
    with pytest.raises(UnreadableClip, match=r"shard-0001\.tar/000008\.mkv: is empty"):
        probe_clip(BytesBlob(b""), name="shard-0001.tar/000008.mkv")


def write_frame_folder(folder: Path, num_frames: int, fps: str | None) -> Path:
    folder.mkdir()
    for index in range(num_frames):  # frame_2 before frame_10: a natural sort, not a text one
        Image.fromarray(bar_image(index)).save(folder / f"frame_{index}.png")
    if fps is not None:
        (folder / "fps.txt").write_text(fps)
    return folder


def test_frame_folder(tmp_path: Path) -> None:
    folder = write_frame_folder(tmp_path / "clip", 12, "12.5\n")
    info = probe_clip(folder)
    assert info.num_frames == 12 and info.fps == pytest.approx(12.5)
    assert info.timestamps == pytest.approx([index / 12.5 for index in range(12)])
    assert bar_indices(decode_frames(folder, [11, 2, 10])) == [11, 2, 10]
    assert probe_clip(folder, fps=30).fps == pytest.approx(30)
    plain = write_frame_folder(tmp_path / "plain", 3, None)
    assert probe_clip(plain).fps == pytest.approx(24.0)  # DEFAULT_FRAME_FOLDER_FPS
    (folder / "frame_7.png").write_bytes(b"not a png")
    damaged = probe_clip(folder)
    assert damaged.num_frames == 7 and "frame_7.png does not decode" in damaged.damage
    (plain / "fps.txt").write_text("fast")
    with pytest.raises(UnreadableClip, match="fps.txt holds 'fast', not a frame rate"):
        probe_clip(plain)
    (tmp_path / "none").mkdir()
    with pytest.raises(UnreadableClip, match="frame folder without images"):
        probe_clip(tmp_path / "none")


def test_natural_key() -> None:
    names = ["f10.png", "f2.png", "F1.png", "f1b.png"]
    assert sorted(names, key=natural_key) == ["F1.png", "f1b.png", "f2.png", "f10.png"]


def test_an_image_is_a_one_frame_clip(tmp_path: Path) -> None:
    Image.fromarray(bar_image(3)).save(tmp_path / "still.png")
    info = probe_clip(tmp_path / "still.png")
    assert (info.num_frames, info.fps, info.timestamps) == (1, None, (0.0,))
    assert sample_clips(info, ClipSampling(num_frames=17, fps=8)) == [(0,)]
    assert bar_indices(decode_frames(tmp_path / "still.png", [0])) == [3]


def constant_rate(num_frames: int, fps: float) -> ClipInfo:
    return ClipInfo("clip", tuple(index / fps for index in range(num_frames)), 8, 8)


def test_stride_fps_and_clip_length() -> None:
    info = constant_rate(100, 25)
    stride = sample_clips(info, ClipSampling(num_frames=17, frame_stride=2, placement="even"))
    # 50 grid steps, one 17-step clip centred: steps 16..32 are frames 32, 34, ..., 64.
    assert stride == [tuple(range(32, 65, 2))]
    fps = sample_clips(info, ClipSampling(num_frames=17, fps=12.5, placement="even"))
    assert fps == stride  # half the rate takes every other frame
    # Shorter than num_frames: the longest clip that keeps the 4n+1 rule, else none.
    assert sample_clips(constant_rate(10, 25), ClipSampling(placement="even")) == [tuple(range(9))]
    assert sample_clips(constant_rate(10, 25), ClipSampling(min_frames=13)) == []


def test_a_rate_above_the_clips_repeats_frames() -> None:
    grid = frame_grid(constant_rate(10, 10), ClipSampling(fps=30))
    assert len(grid) == 28 and grid[:6] == [0, 0, 1, 1, 1, 2] and grid[-1] == 9
    assert grid == sorted(grid)


def test_several_clips_per_video_never_overlap() -> None:
    info = constant_rate(100, 25)
    even = sample_clips(info, ClipSampling(num_frames=17, clips_per_video=4, placement="even"))
    assert [clip[0] for clip in even] == [4, 29, 54, 79]  # centred in 0-25, 25-50, ...
    assert all(clip == tuple(range(clip[0], clip[0] + 17)) for clip in even)
    most = sample_clips(info, ClipSampling(num_frames=17, clips_per_video=10, placement="even"))
    assert [clip[0] for clip in most] == [1, 21, 41, 61, 81]  # 100 // 17 = 5 fit
    sampling = ClipSampling(num_frames=17, clips_per_video=4)
    epochs = [sample_clips(info, sampling, seed=3, epoch=epoch, index=7) for epoch in range(4)]
    assert epochs[0] == sample_clips(info, sampling, seed=3, epoch=0, index=7)  # replays
    assert len({tuple(clips) for clips in epochs}) > 1  # random placement moves each epoch
    for clips in epochs:
        for segment, clip in enumerate(clips):  # each in its own quarter, consecutive frames
            assert 25 * segment <= clip[0] and clip[-1] < 25 * (segment + 1)
            assert clip == tuple(range(clip[0], clip[0] + 17))


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"num_frames": 16}, "use 13 or 17"), ({"fps": 8, "frame_stride": 2}, "not both"),
     ({"placement": "middle"}, "valid: random, even"), ({"fps": 0}, "fps must be > 0"),
     ({"min_frames": 21}, "min_frames must be in")],
)  # fmt: skip
def test_sampling_settings_are_checked(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClipSampling(**settings)


def test_scan_finds_clips_and_captions_and_lists_broken_clips(videos: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "walks").mkdir(parents=True)
    (root / "walks" / "dog.mp4").write_bytes((videos / "cfr.mp4").read_bytes())
    (root / "walks" / "dog.txt").write_text("a dog walks\n")
    (root / "broken.mov").write_bytes(b"\x00\x01 not a movie")
    (root / "broken.txt").write_text("never trained")
    write_frame_folder(root / "spin.v2", 5, "8")
    (root / "spin.v2.txt").write_text("a bar spins")
    Image.fromarray(bar_image(0)).save(root / "still.png")
    (root / "still.txt").write_text("a still")
    (root / "latin.gif").write_bytes(b"")
    (root / "latin.txt").write_bytes(b"caf\xe9")
    (root / ".trash").mkdir()
    (root / ".trash" / "old.mp4").write_bytes(b"")
    scan = scan_clip_folder(root)
    assert [(Path(r.path).relative_to(root).as_posix(), r.caption) for r in scan.records] == [
        ("broken.mov", "never trained"),
        ("spin.v2", "a bar spins"),
        ("still.png", "a still"),
        ("walks/dog.mp4", "a dog walks"),
    ]
    assert [(Path(s.name).name, s.reason) for s in scan.skipped] == [
        ("latin.gif", "caption file latin.txt is not UTF-8 (byte 0xe9 at offset 3); re-save it as "
         "UTF-8")
    ]  # fmt: skip
    probed, skipped = probe_clips(scan.records + scan.records)  # listed twice, left out once
    assert [info.num_frames for _, info in probed] == [5, 1, NUM_FRAMES] * 2
    assert [(Path(s.name).name, s.reason.split(" (")[0]) for s in skipped] == [
        ("broken.mov", "is not a video PyAV can read")
    ]
    report = BadDataLog(tmp_path / "bad-data.tsv")
    report.record(skipped)
    assert (tmp_path / "bad-data.tsv").read_text().startswith(f"{root / 'broken.mov'}\tis not a")


def test_missing_pyav_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ValueError, match=r"pip install 'impasto\[video\]'"):
        import_av()


def test_resampling_follows_timestamps_without_decoding() -> None:
    """Sampling is a pure function of the ClipInfo: a clip that slows down (frame i at
    sqrt(i) s) at 4 fps takes frame (k/4)^2 at step k, ties going to the earlier frame."""
    info = ClipInfo("slowing", tuple(math.sqrt(index) for index in range(50)), 4, 4)
    grid = frame_grid(info, ClipSampling(fps=4))
    assert len(grid) == 29  # 0 .. 7 s
    assert [grid[step] for step in (0, 2, 4, 8, 12, 28)] == [0, 0, 1, 4, 9, 49]
