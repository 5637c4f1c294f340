"""Demo clips on disk: a folder of lossless PNG frames, or an H.264 ``.mp4`` through PyAV.

A frame folder ``clip-00000/`` holds ``000.png``, ``001.png`` ... (frame order = name order)
and ``fps.txt`` (its rate, and the mark of a frame folder in a folder scan);
an ``.mp4`` is H.264 in yuv420p, the pixel format every player decodes. yuv420p keeps one
chroma sample per 2x2 pixels and H.264 is lossy: a decoded clip's colours drift by a few levels
and the shape's edges blur, which is why the demo writes frame folders unless asked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from impasto.video_files import import_av, write_mp4

DEMO_VIDEO_FPS = 8
AV_PURPOSE = "demo video: an .mp4 clip"  # what import_av says needs PyAV


def _write_frames(frames: np.ndarray, stem: Path) -> Path:
    stem.mkdir()
    for index, frame in enumerate(frames):
        Image.fromarray(frame).save(stem / f"{index:03d}.png", format="PNG")
    (stem / "fps.txt").write_text(f"{DEMO_VIDEO_FPS}\n", encoding="utf-8")  # marks a frame folder
    return stem


def _write_mp4(frames: np.ndarray, stem: Path) -> Path:
    path = stem.with_suffix(".mp4")
    write_mp4(frames, path, DEMO_VIDEO_FPS)
    return path


CLIP_WRITERS: dict[str, Callable[[np.ndarray, Path], Path]] = {
    "frames": _write_frames,
    "mp4": _write_mp4,
}
"""Write ``[T, H, W, 3]`` uint8 frames as the clip ``stem`` (a folder, or ``stem.mp4``)."""


def check_clip_format(fmt: str, size: int) -> None:
    """Refuse an unknown format, or an .mp4 PyAV cannot write, before anything is written."""
    if fmt not in CLIP_WRITERS:
        raise ValueError(f"demo video: unknown format {fmt!r}; valid: {', '.join(CLIP_WRITERS)}")
    if fmt == "mp4":
        import_av(AV_PURPOSE)
        if size % 2:
            raise ValueError(f"demo video: .mp4 needs an even size (yuv420p), got {size}")


def load_demo_clip(path: str | Path) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 RGB frames of a clip: a folder of PNGs or a video file (PyAV)."""
    path = Path(path)
    if path.is_dir():
        names = sorted(path.glob("*.png"))
        if not names:
            raise ValueError(f"demo video: {path} holds no .png frames")
        return np.stack([np.asarray(Image.open(name).convert("RGB")) for name in names])
    if not path.exists():
        raise FileNotFoundError(f"demo video: {path} does not exist")
    av = import_av(AV_PURPOSE)
    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return np.stack(frames)
