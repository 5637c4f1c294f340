"""Where a clip's frames come from: a video (a file or bytes, decoded with PyAV), a frame folder
(numbered images) or a single image (one frame), all read the same way: :func:`open_frames`
yields the decoded frames in presentation order with their times in seconds.

Decoding stops early, keeping every frame decoded so far, at the first error (a truncated or
damaged file: :class:`DecodingStopped`, raised after those frames) and at the first frame whose
size differs from the first frame's. Both :func:`~impasto.data.video.probe.probe_clip` and
:func:`~impasto.data.video.probe.decode_clips` read through here, so a frame's index means the
same to both.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np
from PIL import Image

from impasto.data.folder import IMAGE_EXTENSIONS
from impasto.data.skips import error_reason
from impasto.data.transforms import IMAGE_LOAD_ERRORS
from impasto.video_files import import_av  # PyAV on first use; "video data needs PyAV: ..."

VIDEO_EXTENSIONS: tuple[str, ...] = (".gif", ".m4v", ".mkv", ".mov", ".mp4", ".webm")
"""Lower-case suffixes a folder scan reads as videos (any letter case); PyAV reads more."""
FPS_FILE = "fps.txt"
"""A frame folder's frame rate: one number in this file inside the folder."""
DEFAULT_FRAME_FOLDER_FPS = 24.0
"""The frame rate of a frame folder without :data:`FPS_FILE` (when no ``fps`` is passed)."""
FALLBACK_FPS = 24.0  # spaces frames without a pts when the stream has no rate either
REENCODE = "re-encode it (ffmpeg -i FILE -c:v libx264 -pix_fmt yuv420p OUT.mp4) or remove it"
RESAVE = "re-save the image or remove it"
EMPTY_FIX = "copy it again or remove it"


class ClipBlob(Protocol):
    """A video's bytes when they are not a plain file (a tar member, a Parquet cell): the same
    small picklable readers as :class:`~impasto.data.folder.ImageBlob`."""

    def read(self) -> bytes: ...


ClipSource = str | os.PathLike | ClipBlob
"""A video file, a frame folder, an image file, or a :class:`ClipBlob` holding a video."""


class UnreadableClip(ValueError):
    """A clip that yields no frame: not a video, no video stream, nothing decodes, an empty
    frame folder. ``name`` and ``reason`` are a bad-data report's row
    (:class:`~impasto.data.skips.Skipped`)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"data: clip {name}: {reason}")
        self.name, self.reason = name, reason


class DecodingStopped(Exception):
    """Raised by a frame iterator after the last frame it could decode; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class DecodedFrame:
    """One frame: its time in seconds, its size, and its pixels on demand (``rgb()``: uint8
    ``[H, W, 3]``; converting only the frames a clip keeps saves most of the work)."""

    time: float
    height: int
    width: int
    rgb: Callable[[], np.ndarray]


def clip_name(source: ClipSource, name: str | None = None) -> str:
    """How messages and reports name ``source``: ``name``, else the path, else the blob."""
    return name if name is not None else str(source)


def decode_fix(source: ClipSource) -> str:
    """What to do about ``source`` when nothing of it decodes: re-encode a video, re-save an
    image or a frame folder's first image."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir() or path.suffix.lower() in IMAGE_EXTENSIONS:
            return RESAVE
    return REENCODE


def _av_reason(error: BaseException) -> str:
    strerror = getattr(error, "strerror", None)  # FFmpeg's text, without errno and filename
    return strerror if isinstance(strerror, str) and strerror else error_reason(error)


def _video_frames(av: ModuleType, container: Any, stream: Any) -> Iterator[DecodedFrame]:
    """Every frame PyAV decodes from ``stream``; at the first error, the frames still held by
    the decoder (it delays output for B-frames) are flushed out, then :class:`DecodingStopped`."""
    codec = stream.codec_context
    # One thread per decoder: loader workers decode in parallel already, and frame threading
    # would make what a damaged file yields depend on the number of cores.
    codec.thread_count = 1
    default_step = 1 / float(stream.average_rate or stream.guessed_rate or FALLBACK_FPS)
    previous: list[float] = []

    def decoded(frame: Any) -> DecodedFrame:
        if frame.pts is None:  # raw streams carry no timestamps: space them by the rate
            time = previous[0] + default_step if previous else 0.0
        else:
            time = float(frame.pts * Fraction(frame.time_base or stream.time_base))
        previous[:] = [time]
        return DecodedFrame(time, frame.height, frame.width, lambda: _rgb(frame))

    try:
        for packet in container.demux(stream):
            for frame in codec.decode(packet):  # the last, empty packet flushes the decoder
                yield decoded(frame)
    except (av.error.FFmpegError, EOFError) as error:
        reason = _av_reason(error)
        try:
            for frame in codec.decode(None):
                yield decoded(frame)
        except (av.error.FFmpegError, EOFError):
            pass
        raise DecodingStopped(reason) from None


def _rgb(frame: Any) -> np.ndarray:
    return frame.to_ndarray(format="rgb24")


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders ``frame_2`` before ``frame_10`` (digit runs compare as numbers)."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part.lower())
        for part in re.split(r"(\d+)", name)
        if part
    )


def frame_folder_images(folder: Path) -> list[Path]:
    """The images of a frame folder, sorted naturally by name (hidden files skipped)."""
    images = [
        path
        for path in folder.iterdir()
        if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file() and path.name[0] != "."
    ]
    return sorted(images, key=lambda path: natural_key(path.name))


def frame_folder_fps(folder: Path, name: str, fps: float | None = None) -> float:
    """``fps``, else the number in the folder's :data:`FPS_FILE`, else
    :data:`DEFAULT_FRAME_FOLDER_FPS`."""
    if fps is not None:
        return fps
    fps_file = folder / FPS_FILE
    if not fps_file.is_file():
        return DEFAULT_FRAME_FOLDER_FPS
    text = fps_file.read_text(encoding="utf-8-sig", errors="replace").strip()
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise UnreadableClip(
            name, f"{FPS_FILE} holds {text[:20]!r}, not a frame rate > 0; write one number, e.g. 24"
        )
    return value


def _image_frames(paths: list[Path], fps: float) -> Iterator[DecodedFrame]:
    """Each image decoded in turn, frame ``i`` at ``i / fps`` seconds; :class:`DecodingStopped`
    at the first that does not decode."""
    for index, path in enumerate(paths):
        try:
            with Image.open(path) as image:
                rgb = np.asarray(image.convert("RGB"))
        except IMAGE_LOAD_ERRORS as error:
            raise DecodingStopped(f"{path.name} does not decode ({error_reason(error)})") from None
        yield DecodedFrame(index / fps, rgb.shape[0], rgb.shape[1], lambda rgb=rgb: rgb)


@contextmanager
def open_frames(
    source: ClipSource, name: str, fps: float | None = None
) -> Iterator[Iterator[DecodedFrame]]:
    """The frames of ``source`` in presentation order (module docstring), checked to keep one
    size; the container is closed on exit.

    Args:
        source: a video file, a frame folder, an image file (one frame), or a blob of a video.
        name: how errors name the clip.
        fps: a frame folder's frame rate (default: its :data:`FPS_FILE`, else 24).

    Raises:
        UnreadableClip: the source cannot be opened, is not a video, or has no video stream.
    """
    if not isinstance(source, (str, os.PathLike)):
        try:
            data = source.read()
        except OSError as error:
            raise UnreadableClip(name, f"cannot be read ({error_reason(error)})") from None
        if not data:
            raise UnreadableClip(name, f"is empty (0 bytes); {EMPTY_FIX}")
        yield from _opened_video(io.BytesIO(data), name)
        return
    path = Path(source)
    if path.is_file() and path.stat().st_size == 0:
        raise UnreadableClip(name, f"is empty (0 bytes); {EMPTY_FIX}")
    if path.is_dir():
        images = frame_folder_images(path)
        if not images:
            accepted = " ".join(IMAGE_EXTENSIONS)
            raise UnreadableClip(
                name,
                f"is a frame folder without images ({accepted}); "
                "add the numbered frames or remove it",
            )
        yield _same_size(_image_frames(images, frame_folder_fps(path, name, fps)))
    elif path.suffix.lower() in IMAGE_EXTENSIONS:
        yield _same_size(_image_frames([path], DEFAULT_FRAME_FOLDER_FPS))
    else:
        yield from _opened_video(str(path), name)


def _opened_video(file: str | io.BytesIO, name: str) -> Iterator[Iterator[DecodedFrame]]:
    av = import_av()
    try:
        container = av.open(file, metadata_errors="ignore")
    except OSError as error:  # missing, unreadable: PyAV's errors are OSError's too
        raise UnreadableClip(
            name, f"cannot be opened ({_av_reason(error)}); check that it exists and is readable"
        ) from None
    except av.error.FFmpegError as error:
        raise UnreadableClip(
            name, f"is not a video PyAV can read ({_av_reason(error)}); {REENCODE}"
        ) from None
    frames = None
    try:
        if not container.streams.video:
            raise UnreadableClip(name, "has no video stream (audio only?); remove it")
        frames = _video_frames(av, container, container.streams.video[0])
        yield _same_size(frames)
    finally:
        if frames is not None:
            frames.close()
        container.close()


def _same_size(frames: Iterator[DecodedFrame]) -> Iterator[DecodedFrame]:
    """``frames`` up to the first whose size differs from the first frame's."""
    size = None
    for index, frame in enumerate(frames):
        if size is None:
            size = (frame.height, frame.width)
        elif (frame.height, frame.width) != size:
            raise DecodingStopped(
                f"frame {index} is {frame.height}x{frame.width}, not {size[0]}x{size[1]} as the "
                "first frame"
            )
        yield frame
