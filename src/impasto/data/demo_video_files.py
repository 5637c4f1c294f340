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
from types import ModuleType

import numpy as np
from PIL import Image

DEMO_VIDEO_FPS = 8
# Constant quality: 12 is visually lossless for flat colours (the default, 23, smears the
# shape's edges at 32 px); the rate stays tiny either way.
MP4_CRF = 12


def import_av() -> ModuleType:
    """PyAV, or a one-line error that says how to install it."""
    try:
        import av
    except ImportError:
        raise ValueError(
            "demo video: .mp4 clips need PyAV: pip install 'impasto[video]' (in a checkout: "
            "pip install -e '.[video]')"
        ) from None
    return av


def _write_frames(frames: np.ndarray, stem: Path) -> Path:
    stem.mkdir()
    for index, frame in enumerate(frames):
        Image.fromarray(frame).save(stem / f"{index:03d}.png", format="PNG")
    (stem / "fps.txt").write_text(f"{DEMO_VIDEO_FPS}\n", encoding="utf-8")  # marks a frame folder
    return stem


def _write_mp4(frames: np.ndarray, stem: Path) -> Path:
    av = import_av()
    path = stem.with_suffix(".mp4")
    height, width = frames.shape[1:3]
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=DEMO_VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # mbtree off: with it, libx264 gave other bytes for the same tiny clip now and then
        # (decoded pixels up to 20 levels apart); without it, and on one thread, the same bytes.
        stream.options = {"crf": str(MP4_CRF), "threads": "1", "x264-params": "mbtree=0"}
        for index, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = index
            container.mux(stream.encode(picture))
        container.mux(stream.encode())  # flush the encoder's delayed frames
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
        import_av()
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
    av = import_av()
    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return np.stack(frames)
