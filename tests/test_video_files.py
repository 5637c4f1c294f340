"""Clips on disk (issue #32): ``.mp4`` read back by the repo's own decoder, animated ``.webp``
and ``.gif`` previews, and frame grids (``impasto.video_files``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.video_files import (
    GRID_BACKGROUND,
    GRID_PADDING,
    check_clip_formats,
    clip_frames,
    clip_grid,
    grid_frame_indices,
    tile_frames,
    write_gif,
    write_mp4,
    write_webp,
)

NUM_FRAMES, HEIGHT, WIDTH = 9, 32, 48


def synthetic_clip(num_frames: int = NUM_FRAMES) -> torch.Tensor:
    """``[3, T, H, W]`` in [0, 1]: frame i is two flat 16-px-aligned halves whose colours
    change with i (flat blocks survive H.264's 4:2:0 chroma and quantisation), every frame
    different from the last."""
    clip = torch.empty(3, num_frames, HEIGHT, WIDTH)
    for index in range(num_frames):
        left = torch.tensor([0.9, 0.1 + 0.08 * index, 0.2])
        right = torch.tensor([0.05 * index, 0.3, 0.95 - 0.07 * index])
        clip[:, index, :, :32] = left[:, None, None]
        clip[:, index, :, 32:] = right[:, None, None]
    return clip


def test_clip_frames_rounds_as_to_pil():
    clip = torch.tensor([0.0, 0.5, 1.0, 1.2, -0.1, 0.2]).view(3, 1, 1, 2)
    frames = clip_frames(clip)
    assert frames.shape == (1, 1, 2, 3) and frames.dtype == np.uint8
    assert frames[0, 0].tolist() == [[0, 255, 0], [128, 255, 51]]


def test_an_mp4_decodes_back_to_the_clip_with_the_repos_decoder(tmp_path):
    pytest.importorskip("av", reason="writing .mp4 needs PyAV: pip install -e '.[video]'")
    from impasto.data.video import decode_frames, probe_clip

    frames = clip_frames(synthetic_clip())
    path = tmp_path / "clip.mp4"
    write_mp4(frames, path, fps=16)
    info = probe_clip(path)
    assert (info.num_frames, info.height, info.width) == (NUM_FRAMES, HEIGHT, WIDTH)
    assert info.damage is None and info.fps == pytest.approx(16)
    decoded = decode_frames(path, range(NUM_FRAMES)).numpy().astype(np.int16)
    difference = np.abs(decoded - frames.astype(np.int16))
    # yuv420p and H.264 at crf 12: flat blocks aligned to the 2x2 chroma samples come back
    # within a few levels (measured: 2 at most, 1.2 on average).
    assert difference.max() <= 6 and difference.mean() <= 2.0, difference.max()
    # The frames differ from each other: a frame mix-up would fail the bound above.
    assert np.abs(np.diff(frames.astype(np.int16), axis=0)).max() > 10


def test_an_mp4_with_odd_sides_is_refused_in_one_line(tmp_path):
    frames = np.zeros((5, 33, 48, 3), np.uint8)
    with pytest.raises(ValueError) as error:
        write_mp4(frames, tmp_path / "odd.mp4", fps=16)
    assert str(error.value) == (
        "an .mp4 (H.264, yuv420p) needs even sides, got 48x33; use an even size or write .webp"
    )
    assert not (tmp_path / "odd.mp4").exists()


@pytest.mark.parametrize(("writer", "lossless"), [(write_webp, True), (write_gif, False)])
def test_previews_are_looping_animations_of_every_frame(tmp_path, writer, lossless):
    frames = clip_frames(synthetic_clip())
    path = tmp_path / "preview"
    with open(path, "xb") as handle:  # an open file, as impasto sample writes them
        writer(frames, handle, fps=8)
    with Image.open(path) as preview:
        assert preview.n_frames == NUM_FRAMES and preview.size == (WIDTH, HEIGHT)
        assert preview.info["loop"] == 0
        for index in range(NUM_FRAMES):
            preview.seek(index)
            preview.load()  # WebP reads a frame's duration as it decodes it
            assert preview.info["duration"] in (120, 125)  # 1000 / 8 ms (GIF: 10 ms steps)
            pixels = np.asarray(preview.convert("RGB")).astype(np.int16)
            difference = np.abs(pixels - frames[index])
            assert difference.max() == 0 if lossless else difference.max() <= 8


def test_grid_frames_are_every_frame_or_evenly_spaced():
    assert grid_frame_indices(9) == list(range(9))
    assert grid_frame_indices(17) == list(range(17))
    assert grid_frame_indices(81) == list(range(0, 81, 5))
    assert grid_frame_indices(33) == list(range(0, 33, 2))
    spaced = grid_frame_indices(21, max_frames=5)
    assert spaced == [0, 5, 10, 15, 20]


def test_a_frame_grid_tiles_the_frames_exactly():
    frames = clip_frames(synthetic_clip())
    grid = np.asarray(clip_grid(frames))
    pad = GRID_PADDING
    assert grid.shape == (HEIGHT + 2 * pad, NUM_FRAMES * (WIDTH + pad) + pad, 3)
    for index, frame in enumerate(frames):
        left = pad + index * (WIDTH + pad)
        assert np.array_equal(grid[pad : pad + HEIGHT, left : left + WIDTH], frame)
    assert (grid[:pad] == GRID_BACKGROUND).all() and (grid[:, :pad] == GRID_BACKGROUND).all()
    # Enlarged 3x in rows of 4: every pixel an exact 3x3 square.
    tiled = tile_frames(frames[:6], num_columns=4, factor=3)
    assert tiled.shape == (2 * (3 * HEIGHT + pad) + pad, 4 * (3 * WIDTH + pad) + pad, 3)
    top, left = pad + 3 * HEIGHT + pad, pad + (3 * WIDTH + pad)  # frame 5: row 1, column 1
    for dy, dx in [(0, 0), (2, 1), (1, 2)]:  # any pixel of a 3x3 square is the frame's
        square = tiled[top + dy : top + 3 * HEIGHT : 3, left + dx : left + 3 * WIDTH : 3]
        assert np.array_equal(square, frames[5])


def test_a_long_clips_grid_wraps_and_shows_every_fifth_frame():
    frames = np.arange(81, dtype=np.uint8)[:, None, None, None].repeat(3, -1)
    frames = np.broadcast_to(frames, (81, 8, 600, 3))
    grid = np.asarray(clip_grid(frames))  # 17 frames of 600 px: 6 per row under 4096 px
    pad = GRID_PADDING
    assert grid.shape == (3 * (8 + pad) + pad, 6 * (600 + pad) + pad, 3)
    shown = [grid[pad + row * (8 + pad), pad + column * (600 + pad), 0]
             for row in range(3) for column in range(6)][:17]  # fmt: skip
    assert shown == list(range(0, 81, 5))


def test_clip_format_mistakes_are_one_line(monkeypatch):
    with pytest.raises(ValueError) as error:
        check_clip_formats(["webp", "webm"], "--format")
    assert str(error.value) == "--format: unknown clip format 'webm'; valid: mp4, webp, gif"
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    check_clip_formats(["webp", "gif"], "--format")  # Pillow writes these
    with pytest.raises(ValueError) as error:
        check_clip_formats(["mp4"], "--format")
    assert str(error.value) == (
        "--format: an .mp4 clip needs PyAV: pip install 'impasto[video]' (in a checkout: "
        "pip install -e '.[video]')"
    )
