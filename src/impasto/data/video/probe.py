"""What a clip holds, counted by decoding it, and the frames a clip sample asks for.

A clip's frame count and timestamps come from decoding every frame, never from the container's
metadata (``stream.frames``, the duration): those are missing in some containers (WebM, MKV,
GIF), and wrong in a truncated file, whose index still lists the frames cut off. A damaged file
keeps the frames that decode before the damage (:attr:`ClipInfo.damage` says why it stopped).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from impasto.data.video.frames import (
    ClipSource,
    DecodingStopped,
    UnreadableClip,
    clip_name,
    decode_fix,
    open_frames,
)


@dataclass(frozen=True)
class ClipInfo:
    """A clip as decoding found it.

    Attributes:
        name: the clip, as messages and reports name it.
        timestamps: each decoded frame's time in seconds (``pts × time_base``; a frame folder's
            frame ``i`` at ``i / fps``; an image's one frame at 0), in presentation order. A
            truncated file's decoder may drop a frame before the damage (a B-frame whose
            reference was cut off), so the times may jump there, as in a variable-frame-rate
            video.
        height: frame height in pixels (every frame has it).
        width: frame width in pixels.
        damage: why decoding stopped before the end of the file (a truncated or damaged file,
            a frame of another size), None when it read to the end.
    """

    name: str
    timestamps: tuple[float, ...]
    height: int
    width: int
    damage: str | None = None

    @property
    def num_frames(self) -> int:
        """Frames decoded: what :func:`decode_clips` can return, indices ``0 .. n-1``."""
        return len(self.timestamps)

    @property
    def duration(self) -> float:
        """Seconds from the first frame's time to the last one's (0 for one frame)."""
        return max(self.timestamps) - min(self.timestamps)

    @property
    def fps(self) -> float | None:
        """Average frame rate from the timestamps, ``(n - 1) / duration``; None for one frame
        (an image) or when every frame has the same time."""
        return (self.num_frames - 1) / self.duration if self.duration > 0 else None


def probe_clip(source: ClipSource, name: str | None = None, fps: float | None = None) -> ClipInfo:
    """Decode every frame of ``source`` to count them and read their times.

    Args:
        source: a video file (``.mp4``, ``.webm``, ``.mov``, ``.gif``, ... anything PyAV
            reads), a frame folder (numbered images, sorted naturally; its frame rate in
            ``fps.txt``, else 24), an image file (one frame), or a blob with the bytes of a
            video (a tar member, a Parquet cell).
        name: how messages name the clip (default: the path, or the blob).
        fps: a frame folder's frame rate, over its ``fps.txt``; ignored for videos.

    Returns:
        The :class:`ClipInfo`: frames that decode before any damage, each with its time.

    Raises:
        UnreadableClip: not a video, no video stream, or no frame decodes (the message names
            the clip and the fix).
        ValueError: PyAV is not installed (``pip install 'impasto[video]'``).
    """
    name = clip_name(source, name)
    timestamps: list[float] = []
    size, damage = (0, 0), None
    with open_frames(source, name, fps) as frames:
        try:
            for frame in frames:  # only counted and timed: no pixel conversion
                timestamps.append(frame.time)
                size = (frame.height, frame.width)
        except DecodingStopped as stop:
            damage = stop.reason
    if not timestamps:
        raise UnreadableClip(
            name, f"decodes no frame ({damage or 'empty video stream'}); {decode_fix(source)}"
        )
    return ClipInfo(name, tuple(timestamps), size[0], size[1], damage)


def decode_clips(
    source: ClipSource,
    clips: Sequence[Sequence[int]],
    name: str | None = None,
    fps: float | None = None,
) -> list[torch.Tensor]:
    """The frames each clip asks for, decoded in one pass over ``source``.

    Frames are decoded in order up to the last one asked for (the rest of the file is not
    read); only the frames asked for are converted to RGB and kept, so memory is bounded by
    the clips, not the file. An index may appear several times (a target frame rate above the
    clip's repeats frames).

    Args:
        source: as :func:`probe_clip`.
        clips: frame indices per clip (as :func:`~impasto.data.video.sampling.sample_clips`
            returns them), each in ``[0, ClipInfo.num_frames)``.
        name: how messages name the clip.
        fps: as :func:`probe_clip` (it does not change which frame an index is).

    Returns:
        One uint8 tensor ``[T, H, W, 3]`` (RGB) per clip, ``T`` its number of indices.

    Raises:
        ValueError: a clip without indices, or a negative index.
        UnreadableClip: the source no longer decodes as far as the indices ask (it changed
            since it was probed), or does not open.
    """
    name = clip_name(source, name)
    wanted: dict[int, list[tuple[int, int]]] = defaultdict(list)  # frame → (clip, position)
    for clip_number, indices in enumerate(clips):
        if not indices:
            raise ValueError(f"data: clip {name}: clip {clip_number} asks for no frames")
        for position, index in enumerate(indices):
            if index < 0:
                raise ValueError(f"data: clip {name}: frame index {index} is negative")
            wanted[int(index)].append((clip_number, position))
    last = max(wanted)
    outputs: list[np.ndarray | None] = [None] * len(clips)
    num_decoded, damage = 0, "it ends there"
    with open_frames(source, name, fps) as frames:
        try:
            for index, frame in enumerate(frames):
                num_decoded = index + 1
                if index in wanted:
                    rgb = frame.rgb()
                    for clip_number, position in wanted[index]:
                        if outputs[clip_number] is None:
                            shape = (len(clips[clip_number]), *rgb.shape)
                            outputs[clip_number] = np.empty(shape, dtype=np.uint8)
                        outputs[clip_number][position] = rgb
                if index == last:
                    break
        except DecodingStopped as stop:
            damage = stop.reason
    if num_decoded <= last:
        raise UnreadableClip(
            name,
            f"decodes {num_decoded} frames, not frame {last} ({damage}); "
            "it changed since it was probed: probe it again",
        )
    return [torch.from_numpy(output) for output in outputs]


def decode_frames(
    source: ClipSource, indices: Sequence[int], name: str | None = None, fps: float | None = None
) -> torch.Tensor:
    """The frames ``indices`` of ``source`` as a uint8 tensor ``[T, H, W, 3]`` (RGB), in the
    order given (:func:`decode_clips` with one clip)."""
    return decode_clips(source, [indices], name, fps)[0]
