"""``data.video``: clips as training samples (issue #32; docs/video.md).

Set, the run reads videos (``.mp4``, ``.webm``, ``.mov``, ``.gif``, ...), frame folders and
images from its sources; each video gives up to ``clips_per_video`` clips of up to
``num_frames`` frames, and each image is a one-frame sample
(:class:`~impasto.data.video.sampling.ClipSampling`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from impasto.config.section import Float, Int, Section

MAX_FRAMES = 4097  # frames per clip (Wan trains 81, MovieGen 256)
MAX_CLIPS_PER_VIDEO = 10_000
DEFAULT_TEMPORAL_COMPRESSION = 4  # Wan 2.1's and HunyuanVideo's VAEs: clips of k·4+1 frames


def frame_rule_problem(key: str, frames: int, step: int) -> str | None:
    """Why ``frames`` (the value of ``key``) is not a frame count a causal video autoencoder
    with temporal compression ``step`` encodes, ``k·step + 1 >= 1`` (its first frame alone,
    then ``step`` frames per latent frame), naming the nearest valid counts; None if it is."""
    if frames >= 1 and (frames - 1) % step == 0:
        return None
    lower = max(1, (frames - 1) // step * step + 1)
    nearest = str(lower) if frames < 1 else f"{lower} or {lower + step}"
    return f"{key} must be k·{step}+1 (the autoencoder's frame rule), got {frames}; use {nearest}"


class VideoConfig(Section):
    """How clips are cut from each video, and how frame folders are timed."""

    num_frames: Int = Field(
        17,
        ge=1,
        le=MAX_FRAMES,
        description="frames per clip at most, k·4+1 for a 4x temporal autoencoder (a shorter "
        "video gives a shorter clip of that form)",
    )
    fps: Float | None = Field(
        None, gt=0, description="resample every video to this rate by its timestamps (null: "
        "keep the decoded frames, every frame_stride-th)",
    )  # fmt: skip
    frame_stride: Int = Field(1, ge=1, le=1000, description="take every n-th decoded frame")
    clips_per_video: Int = Field(
        1, ge=1, le=MAX_CLIPS_PER_VIDEO,
        description="clips at most from one video per epoch, never overlapping",
    )  # fmt: skip
    placement: Literal["random", "even"] = Field(
        "random",
        description="random: each clip starts anywhere in its segment of the video, drawn anew "
        "each epoch; even: each clip centred in its segment, the same every epoch",
    )
    min_frames: Int = Field(
        1, ge=1, le=MAX_FRAMES, description="a video whose clip would be shorter is left out"
    )
    temporal_compression: Int = Field(
        DEFAULT_TEMPORAL_COMPRESSION, ge=1, le=64,
        description="the video autoencoder's frames per latent frame (Wan 2.1: 4, clips of "
        "k·4+1 frames); the run checks it against the autoencoder",
    )  # fmt: skip

    @model_validator(mode="after")
    def _fits_together(self) -> VideoConfig:
        problem = frame_rule_problem(
            "data.video.num_frames", self.num_frames, self.temporal_compression
        )
        if problem:
            raise ValueError(problem)
        if self.fps is not None and self.frame_stride != 1:
            raise ValueError("data.video: set fps or frame_stride, not both")
        if self.min_frames > self.num_frames:
            raise ValueError(
                f"data.video.min_frames {self.min_frames} is above num_frames {self.num_frames}; "
                "lower it"
            )
        return self
