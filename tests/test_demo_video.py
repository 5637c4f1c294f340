"""The video demo's clips (issue #32): the judge is right on ground truth, the generator is
seeded, balanced and keeps its held-out combinations out of training, its stills are the image
demo's images and read as one-frame samples beside the clips, and errors are one line."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from impasto.cli import main
from impasto.config.load import build_config
from impasto.data.demo import DEMO_BACKGROUNDS, DEMO_COLORS, DEMO_SHAPES, demo_caption
from impasto.data.demo_eval import read_demo_image
from impasto.data.demo_video import (
    DEMO_DIRECTIONS,
    DEMO_VIDEO_HELD_OUT,
    demo_clip_spec,
    demo_still_spec,
    demo_video_held_out_prompts,
    parse_demo_video_caption,
    render_demo_clip,
    write_demo_video_dataset,
)
from impasto.data.demo_video_files import load_demo_clip
from impasto.demo_score_video import read_demo_clip, score_demo_clips

ALL_COMBINATIONS = set(
    itertools.product(DEMO_COLORS, DEMO_SHAPES, DEMO_DIRECTIONS, DEMO_BACKGROUNDS)
)


def _read_dataset(folder: Path, suffix: str = "") -> tuple[list[np.ndarray], list[str]]:
    captions = sorted(folder.glob("clip-*.txt"))
    clips = [load_demo_clip(path.with_suffix(suffix)) for path in captions]
    return clips, [path.read_text(encoding="utf-8").strip() for path in captions]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("size", "frames"), [(32, 17), (64, 9), (45, 13)])
def test_judge_reads_written_frame_folders_exactly(tmp_path, size, frames):
    write_demo_video_dataset(tmp_path / "clips", 36, size, frames, seed=3)
    clips, captions = _read_dataset(tmp_path / "clips")
    assert len(clips) == 36 and all(clip.shape == (frames, size, size, 3) for clip in clips)
    score = score_demo_clips(clips, captions)
    assert (score.color_accuracy, score.shape_accuracy, score.direction_accuracy) == (1, 1, 1)
    # Floats in [0, 1] (a model's output) read the same as uint8.
    assert score_demo_clips([c / 255.0 for c in clips], captions).as_dict() == score.as_dict()


def test_judge_reads_mp4_colour_and_direction_exactly(tmp_path):
    pytest.importorskip("av")
    write_demo_video_dataset(tmp_path / "clips", 36, 64, 9, seed=3, fmt="mp4")
    clips, captions = _read_dataset(tmp_path / "clips", ".mp4")
    assert clips[0].shape == (9, 64, 64, 3)
    score = score_demo_clips(clips, captions)
    assert score.color_accuracy == 1 and score.direction_accuracy == 1
    # yuv420p's chroma fringe can push a circle's fill ratio below the judge's 0.75 (these 36:
    # 1.0; 198 clips of seed 1 at 64 px: 0.98, at 32 px: 0.89): why frames are the default.
    assert score.shape_accuracy >= 0.9
    assert set(score.shape_confusions) <= {"circle->triangle"}


def test_reversed_or_transposed_motion_reads_the_wrong_direction():
    specs = [demo_clip_spec(i, seed=5, size=48, num_frames=11) for i in range(24)]
    clips = [render_demo_clip(spec, 48) for spec in specs]
    captions = [spec.caption for spec in specs]
    backwards = score_demo_clips([clip[::-1] for clip in clips], captions)
    assert backwards.direction_accuracy == 0
    assert (backwards.color_accuracy, backwards.shape_accuracy) == (1, 1)
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    expected = Counter(f"{s.direction}->{opposite[s.direction]}" for s in specs)
    assert backwards.direction_confusions == dict(expected)
    # Swapping rows and columns turns left/right into up/down (triangles stay triangles only
    # upright, so read direction alone).
    sideways = [read_demo_clip(clip.transpose(0, 2, 1, 3)).direction for clip in clips]
    assert not any(read == spec.direction for read, spec in zip(sideways, specs, strict=True))


def test_a_still_or_empty_clip_has_no_direction():
    clip = render_demo_clip(demo_clip_spec(0, seed=1), 64)
    still = np.repeat(clip[:1], 9, axis=0)
    assert read_demo_clip(still).direction is None
    assert read_demo_clip(still).color == demo_clip_spec(0, seed=1).color
    blank = np.zeros((9, 64, 64, 3), dtype=np.uint8)
    reading = read_demo_clip(blank)
    assert (reading.color, reading.shape, reading.direction) == (None, None, None)


def test_shapes_move_at_a_constant_speed_inside_the_frame():
    for size, frames in [(32, 17), (32, 9), (64, 17), (64, 9), (33, 15)]:
        for index in range(60):
            spec = demo_clip_spec(index, seed=2, size=size, num_frames=frames)
            boxes = [spec.frame_spec(t).box for t in range(frames)]
            assert all(0 <= left and 0 <= top for left, top, _ in boxes)
            assert all(max(left, top) + side <= size for left, top, side in boxes)
            dx, dy = DEMO_DIRECTIONS[spec.direction]
            steps = {(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(boxes)}
            assert steps == {(dx * spec.speed, dy * spec.speed)} and spec.speed >= 1


def test_same_seed_same_bytes_and_clips_independent_of_the_count(tmp_path):
    write_demo_video_dataset(tmp_path / "a", 5, 32, 9, seed=4)
    write_demo_video_dataset(tmp_path / "b", 5, 32, 9, seed=4)
    write_demo_video_dataset(tmp_path / "c", 3, 32, 9, seed=4)
    write_demo_video_dataset(tmp_path / "d", 5, 32, 9, seed=5)
    a = _tree(tmp_path / "a")
    assert len(a) == 5 * (9 + 2) and a == _tree(tmp_path / "b")  # 9 frames, fps.txt, caption
    assert _tree(tmp_path / "c").items() <= a.items()
    assert _tree(tmp_path / "d") != a


def test_same_seed_same_mp4_pixels(tmp_path):
    pytest.importorskip("av")
    for name in "ab":
        write_demo_video_dataset(tmp_path / name, 6, 32, 9, seed=4, fmt="mp4")
    first, second = _read_dataset(tmp_path / "a", ".mp4"), _read_dataset(tmp_path / "b", ".mp4")
    assert all(np.array_equal(x, y) for x, y in zip(first[0], second[0], strict=True))


def test_training_shows_every_combination_but_the_held_out_ones():
    training = Counter(
        (s.color, s.shape, s.direction, s.background)
        for s in (demo_clip_spec(i, seed=6, size=32) for i in range(198))
    )
    assert set(training) == ALL_COMBINATIONS - set(DEMO_VIDEO_HELD_OUT)
    assert set(training.values()) == {1}  # 198 clips: each training combination once
    first_block = [demo_clip_spec(i, seed=6, size=32) for i in range(18)]
    assert {(s.color, s.shape) for s in first_block} == set(
        itertools.product(DEMO_COLORS, DEMO_SHAPES)
    )
    held_out = {
        (s.color, s.shape, s.direction, s.background)
        for s in (demo_clip_spec(i, seed=6, size=32, held_out=True) for i in range(18))
    }
    assert held_out == set(DEMO_VIDEO_HELD_OUT) and len(held_out) == 18
    # Every three of the four words of a held-out combination are trained on together.
    for combination in DEMO_VIDEO_HELD_OUT:
        for left_out in range(4):
            words = combination[:left_out] + combination[left_out + 1 :]
            assert any(t[:left_out] + t[left_out + 1 :] == words for t in training)
    # Every (colour, shape) pair is held out once.
    assert {(c, s) for c, s, _, _ in DEMO_VIDEO_HELD_OUT} == set(
        itertools.product(DEMO_COLORS, DEMO_SHAPES)
    )
    prompts = demo_video_held_out_prompts()
    assert prompts[0] == "a red circle moving left on a white background"
    assert [parse_demo_video_caption(p) for p in prompts] == list(DEMO_VIDEO_HELD_OUT)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frames": 8}, "frames must be 9 to 17, got 8"),
        ({"frames": 18}, "frames must be 9 to 17, got 18"),
        ({"size": 31}, "size must be 32 to 64 pixels, got 31"),
        ({"size": 65}, "size must be 32 to 64 pixels, got 65"),
        ({"fmt": "gif"}, "unknown format 'gif'; valid: frames, mp4"),
        ({"num_clips": 0}, "num_clips must be positive, got 0"),
        ({"num_stills": -1}, "num_stills must be 0 or more, got -1"),
        ({"num_stills": 2, "held_out": True}, "stills have no held-out set"),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        write_demo_video_dataset(tmp_path / "clips", **kwargs)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "clips").exists()  # refused before anything is written


def test_mp4_needs_an_even_size_and_an_empty_folder(tmp_path):
    pytest.importorskip("av")
    with pytest.raises(ValueError, match="needs an even size"):
        write_demo_video_dataset(tmp_path / "clips", size=33, fmt="mp4")
    write_demo_video_dataset(tmp_path / "clips", 1, 32)
    with pytest.raises(ValueError, match="already exists and is not empty"):
        write_demo_video_dataset(tmp_path / "clips", 1, 32)


def test_bad_caption_is_refused():
    assert parse_demo_video_caption("a red circle moving left on a white background") == (
        "red",
        "circle",
        "left",
        "white",
    )
    with pytest.raises(ValueError, match="not a demo clip caption"):
        parse_demo_video_caption("a red circle on a white background")


def test_cli_writes_clips_and_refuses_mixed_options(tmp_path, capsys):
    out = tmp_path / "clips"
    argv = ["data", "demo", str(out), "--video", "--num-clips", "2", "--frames", "11"]
    assert main([*argv, "--size", "32", "--seed", "1"]) == 0
    assert "wrote 2 clips" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "clip-00000",
        "clip-00000.txt",
        "clip-00001",
        "clip-00001.txt",
    ]
    assert len(list((out / "clip-00001").glob("*.png"))) == 11
    caption = (out / "clip-00001.txt").read_text().strip()
    assert caption == demo_clip_spec(1, seed=1, size=32, num_frames=11).caption
    assert main(["data", "demo", str(tmp_path / "x"), "--frames", "9"]) == 2
    assert main(["data", "demo", str(tmp_path / "x"), "--video", "--num-images", "2"]) == 2
    assert main(["data", "demo", str(tmp_path / "x"), "--video", "--frames", "20"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        "impasto: error: data demo: --frames: only with --video",
        "impasto: error: data demo: --num-images: not with --video",
        "impasto: error: demo video: frames must be 9 to 17, got 20",
    ]


def test_without_pyav_mp4_is_a_one_line_error_and_frames_still_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'impasto\[video\]'") as error:
        write_demo_video_dataset(tmp_path / "clips", 1, 32, fmt="mp4")
    assert "\n" not in str(error.value) and not (tmp_path / "clips").exists()
    assert write_demo_video_dataset(tmp_path / "frames", 1, 32) == 1


def _stills(folder: Path) -> dict[str, bytes]:
    return {name: data for name, data in _tree(folder).items() if name.startswith("still-")}


def test_stills_are_the_image_demos_images_a_pure_function_of_seed_and_index(tmp_path):
    write_demo_video_dataset(tmp_path / "a", 3, 32, 9, seed=4, num_stills=6)
    write_demo_video_dataset(tmp_path / "b", 3, 32, 9, seed=4, num_stills=6)
    write_demo_video_dataset(tmp_path / "c", 5, 32, 9, seed=4, num_stills=2)
    write_demo_video_dataset(tmp_path / "d", 3, 32, 9, seed=5, num_stills=6)
    write_demo_video_dataset(tmp_path / "e", 3, 32, 9, seed=4)
    a = _tree(tmp_path / "a")
    assert len(a) == 3 * (9 + 2) + 6 * 2 and a == _tree(tmp_path / "b")
    clips_only = {name: data for name, data in a.items() if not name.startswith("still-")}
    assert clips_only == _tree(tmp_path / "e")  # stills leave the clips as they were
    assert _stills(tmp_path / "c").items() <= _stills(tmp_path / "a").items()
    assert _stills(tmp_path / "d") != _stills(tmp_path / "a")
    for index in range(6):
        stem = tmp_path / "a" / f"still-{index:05d}"
        caption = stem.with_suffix(".txt").read_text(encoding="utf-8").strip()
        spec = demo_still_spec(index, seed=4, size=32)
        assert caption == demo_caption(spec.color, spec.shape, spec.background)
        _, color, shape, _, _, background, _ = caption.split()  # the image demo's caption
        pixels = np.asarray(Image.open(stem.with_suffix(".png")))
        assert pixels.shape == (32, 32, 3)  # at the clip size
        colours = {tuple(int(c) for c in rgb) for rgb in pixels.reshape(-1, 3)}
        assert colours == {DEMO_COLORS[color], DEMO_BACKGROUNDS[background]}
        reading = read_demo_image(pixels)
        assert (reading.color, reading.shape) == (color, shape)


def test_stills_show_every_triple_the_clips_hold_out_and_not_the_clips_order():
    stills = [demo_still_spec(i, seed=6) for i in range(54)]
    triples = {(s.color, s.shape, s.background) for s in stills}
    assert triples == set(itertools.product(DEMO_COLORS, DEMO_SHAPES, DEMO_BACKGROUNDS))
    assert {(c, s, b) for c, s, _, b in DEMO_VIDEO_HELD_OUT} <= triples  # no direction: shown
    clips = [demo_clip_spec(i, seed=6) for i in range(54)]
    assert [(s.color, s.shape) for s in stills] != [(c.color, c.shape) for c in clips]
    sides = [s.box[2] for s in stills]  # the image demo's 30-70 %, not the clips' 45-75 %
    assert round(0.3 * 64) <= min(sides) < round(0.45 * 64) < round(0.65 * 64) < max(sides)


def test_a_mixed_folder_scans_as_clips_and_one_frame_stills(tmp_path):
    from types import SimpleNamespace

    from impasto.data.video.records import clip_folder_scan

    folder = tmp_path / "mixed"
    write_demo_video_dataset(folder, 3, variants=[(32, 9), (48, 13)], num_stills=2)
    found = clip_folder_scan(SimpleNamespace(path=str(folder)), tmp_path / "index")
    clips = {Path(r.image_path).name: r for r in found.records if r.clip is not None}
    stills = {Path(r.image_path).name: r for r in found.records if r.clip is None}
    assert not found.skipped and len(found.records) == 5
    assert {name: r.clip.info.num_frames for name, r in clips.items()} == {
        "clip-00000": 9, "clip-00001": 13, "clip-00002": 9}  # fmt: skip
    assert [clips[f"clip-{i:05d}"].caption for i in range(3)] == [
        demo_clip_spec(i, 0, size, frames).caption
        for i, (size, frames) in enumerate([(32, 9), (48, 13), (32, 9)])
    ]
    assert {name: (r.size, r.caption) for name, r in stills.items()} == {
        "still-00000.png": ((32, 32), demo_still_spec(0, 0, 32).caption),
        "still-00001.png": ((48, 48), demo_still_spec(1, 0, 48).caption),
    }


def _video_demo_raw(tiny_raw: dict, tmp_path: Path, **data: object) -> dict:
    return {**tiny_raw, "data": {**tiny_raw["data"], "path": str(tmp_path / "demo"), **data}}


def test_the_config_writes_stills_only_beside_the_video_demos_clips(tiny_raw, tmp_path):
    from impasto.data.records import write_run_demo

    video = {"num_frames": 9}
    for data in ({"generate_demo": True}, {"video": video}):
        raw = _video_demo_raw(tiny_raw, tmp_path, demo_num_stills=3, **data)
        with pytest.raises(ValueError, match="demo_num_stills: stills go beside") as error:
            build_config(raw)
        assert "\n" not in str(error.value)
    raw = _video_demo_raw(tiny_raw, tmp_path, generate_demo=True, video=video, resolution=32,
                          demo_num_images=2, demo_num_stills=3)  # fmt: skip
    write_run_demo(build_config(raw))
    names = sorted(path.name for path in (tmp_path / "demo").iterdir())
    stills = [f"still-{i:05d}{suffix}" for i in range(3) for suffix in (".png", ".txt")]
    assert names == [".impasto-demo.json", "clip-00000", "clip-00000.txt", "clip-00001",
                     "clip-00001.txt", *stills]  # fmt: skip


def test_cli_writes_stills_with_video_only(tmp_path, capsys):
    out = tmp_path / "mixed"
    argv = ["data", "demo", str(out), "--video", "--num-clips", "1", "--num-stills", "2"]
    assert main([*argv, "--size", "32", "--seed", "3"]) == 0
    assert "wrote 1 clips and 2 stills" in capsys.readouterr().out
    assert (out / "still-00001.txt").read_text().strip() == demo_still_spec(1, 3, 32).caption
    assert main(["data", "demo", str(tmp_path / "x"), "--num-stills", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "impasto: error: data demo: --num-stills: only with --video"
    ]
