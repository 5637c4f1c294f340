"""Which frames of a clip a training sample takes: pure functions of the clip's
:class:`~impasto.data.video.probe.ClipInfo`, the :class:`ClipSampling` settings and, where they
choose, ``(seed, epoch, index)``.

1. A *grid* of frames at the sample rate: with ``fps``, the target times ``t0 + k / fps`` from
   the first frame's time to the last one's, each taking the decoded frame nearest in time
   (ties to the earlier one), so a variable-frame-rate video is resampled by its real
   timestamps and a rate above the clip's repeats frames; without it, every
   ``frame_stride``-th decoded frame.
2. A clip is ``L`` consecutive grid steps, ``L = fit_frames(min(num_frames, len(grid)))``: the
   autoencoder's frame rule (:func:`fit_frames`), so a short video gives a shorter clip (a
   smaller frame bucket) rather than none, down to ``min_frames``.
3. A long video gives up to ``clips_per_video`` clips that never overlap: the grid is cut into
   ``m = min(clips_per_video, len(grid) // L)`` equal segments and each segment holds one clip,
   placed by ``placement``: ``random`` (a start drawn anew each epoch, from ``(seed, epoch,
   index)``: temporal jitter that still covers the whole video) or ``even`` (centred in its
   segment: the same clips every epoch, evenly spaced over the video).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from impasto.data.seeding import derive_seed
from impasto.data.video.probe import ClipInfo

CLIP_STREAM = 9_173  # separates clip-start seeds from other (seed, epoch, index) streams
# Grid steps are counted as floor(duration · fps) + 1; the tolerance (a millionth of a step)
# keeps a duration such as 23 / 24 s at 24 fps from losing its last step to rounding.
STEP_TOLERANCE = 1e-6


def fit_frames(num_frames: int, temporal_compression: int = 4) -> int:
    """The largest ``k · temporal_compression + 1 <= num_frames``: the frame counts a causal
    video autoencoder with that temporal compression encodes (its first frame alone, then
    ``temporal_compression`` frames per latent frame; 4n+1 for Wan's and HunyuanVideo's 4x).
    1 -> 1, 4 -> 1, 5 -> 5, 16 -> 13, 17 -> 17; an image is 1 frame."""
    if num_frames < 1:
        raise ValueError(f"data: a clip needs at least 1 frame, got {num_frames}")
    if temporal_compression < 1:
        raise ValueError(f"data: temporal compression must be >= 1, got {temporal_compression}")
    return (num_frames - 1) // temporal_compression * temporal_compression + 1


def even_starts(
    segments: list[tuple[int, int]], length: int, generator: torch.Generator
) -> list[int]:
    """Each clip centred in its segment ``[begin, end)`` (draws nothing)."""
    return [begin + (end - begin - length) // 2 for begin, end in segments]


def random_starts(
    segments: list[tuple[int, int]], length: int, generator: torch.Generator
) -> list[int]:
    """Each clip at a uniform start in its segment, one draw per segment, in order."""
    return [
        begin + int(torch.randint(0, end - begin - length + 1, (), generator=generator))
        for begin, end in segments
    ]


CLIP_PLACEMENTS: dict[str, Callable[[list[tuple[int, int]], int, torch.Generator], list[int]]] = {
    "random": random_starts,
    "even": even_starts,
}
"""``placement`` → where each clip starts in its segment of the grid (module docstring)."""


@dataclass(frozen=True)
class ClipSampling:
    """How clips are cut from a video (planned config section ``data.video``; docs/video.md).

    Attributes:
        num_frames: frames per clip at most; must follow the frame rule (``fit_frames``).
        fps: target frame rate (resampled by timestamps); None keeps the decoded frames.
        frame_stride: take every n-th decoded frame (only without ``fps``).
        clips_per_video: clips at most from one video, never overlapping.
        placement: ``random`` or ``even`` (:data:`CLIP_PLACEMENTS`).
        min_frames: a video whose clip would be shorter gives none.
        temporal_compression: the autoencoder's (4 for 4n+1 clips; 1 for any length).
    """

    num_frames: int = 17
    fps: float | None = None
    frame_stride: int = 1
    clips_per_video: int = 1
    placement: str = "random"
    min_frames: int = 1
    temporal_compression: int = 4

    def __post_init__(self) -> None:
        if self.temporal_compression < 1:
            raise ValueError(
                f"data.video.temporal_compression must be >= 1, got {self.temporal_compression}"
            )
        if self.num_frames < 1 or fit_frames(self.num_frames, self.temporal_compression) != (
            self.num_frames
        ):
            lower = fit_frames(max(self.num_frames, 1), self.temporal_compression)
            raise ValueError(
                f"data.video.num_frames must be k·{self.temporal_compression}+1 (the "
                f"autoencoder's frame rule), got {self.num_frames}; use {lower} or "
                f"{lower + self.temporal_compression}"
            )
        if self.fps is not None and not 0 < self.fps < math.inf:
            raise ValueError(f"data.video.fps must be > 0, got {self.fps}")
        if self.frame_stride < 1:
            raise ValueError(f"data.video.frame_stride must be >= 1, got {self.frame_stride}")
        if self.fps is not None and self.frame_stride != 1:
            raise ValueError("data.video: set fps or frame_stride, not both")
        if self.clips_per_video < 1:
            raise ValueError(f"data.video.clips_per_video must be >= 1, got {self.clips_per_video}")
        if not 1 <= self.min_frames <= self.num_frames:
            raise ValueError(
                f"data.video.min_frames must be in [1, num_frames={self.num_frames}], got "
                f"{self.min_frames}"
            )
        if self.placement not in CLIP_PLACEMENTS:
            raise ValueError(
                f"data.video.placement: unknown {self.placement!r}; valid: "
                f"{', '.join(CLIP_PLACEMENTS)}"
            )


def frame_grid(info: ClipInfo, sampling: ClipSampling) -> list[int]:
    """The decoded frame index at each step of the sample rate (module docstring, step 1)."""
    if sampling.fps is None:
        return list(range(0, info.num_frames, sampling.frame_stride))
    times = np.asarray(info.timestamps, dtype=np.float64)
    order = np.argsort(times, kind="stable")  # decoders output in time order; be safe
    sorted_times = times[order]
    num_steps = math.floor(info.duration * sampling.fps + STEP_TOLERANCE) + 1
    targets = sorted_times[0] + np.arange(num_steps) / sampling.fps
    right = np.searchsorted(sorted_times, targets, side="left").clip(0, len(times) - 1)
    left = (right - 1).clip(0, None)
    earlier = targets - sorted_times[left] <= sorted_times[right] - targets  # ties: earlier
    return order[np.where(earlier, left, right)].tolist()


def clip_length(num_steps: int, sampling: ClipSampling) -> int:
    """Frames in each clip of a video whose grid has ``num_steps`` steps (0: too short)."""
    length = fit_frames(min(sampling.num_frames, num_steps), sampling.temporal_compression)
    return length if length >= sampling.min_frames else 0


def sample_clips(
    info: ClipInfo, sampling: ClipSampling, seed: int = 0, epoch: int = 0, index: int = 0
) -> list[tuple[int, ...]]:
    """The clips one video gives for an epoch, each as its decoded frame indices (for
    :func:`~impasto.data.video.probe.decode_clips`), in time order; none when the video is
    shorter than ``min_frames`` at the sample rate.

    Args:
        info: the probed clip.
        sampling: the settings.
        seed: the run's seed; with ``epoch`` and ``index`` (the video's record) it fixes the
            ``random`` placement, so every worker, rank and resume cuts the same clips.
        epoch: the epoch (``random`` placement moves the clips each epoch).
        index: the video's record index.

    Returns:
        Up to ``clips_per_video`` tuples of ``L`` frame indices (module docstring).
    """
    grid = frame_grid(info, sampling)
    length = clip_length(len(grid), sampling)
    if length == 0:
        return []
    num_clips = min(sampling.clips_per_video, len(grid) // length)
    bounds = [len(grid) * segment // num_clips for segment in range(num_clips + 1)]
    segments = list(zip(bounds[:-1], bounds[1:], strict=True))
    generator = torch.Generator().manual_seed(derive_seed(seed, CLIP_STREAM, epoch, index))
    starts = CLIP_PLACEMENTS[sampling.placement](segments, length, generator)
    return [tuple(grid[start : start + length]) for start in starts]
