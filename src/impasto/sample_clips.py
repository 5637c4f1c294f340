"""How a sampled clip is made: the frame counts a model's autoencoder encodes (issue #32), the
frame rate and the files a clip is written as (:mod:`impasto.video_files`). Used by ``impasto
sample --frames`` (:mod:`impasto.inference`) and the validation clips of a run that sets
``sample.frames`` (:mod:`impasto.train.validation`); docs/video.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from impasto.config import Config
from impasto.config.video import DEFAULT_TEMPORAL_COMPRESSION, frame_rule_problem
from impasto.models.autoencoder import is_video_vae, temporal_compression
from impasto.models.backbone import Backbone
from impasto.video_files import CLIP_FPS

DEFAULT_CLIP_FORMATS = ("mp4", "webp")  # beside each clip's frame grid PNG


@dataclass(frozen=True)
class ClipOutput:
    """Clips instead of images: ``num_frames`` frames each, written as ``formats`` at ``fps``
    beside a PNG of their frames."""

    num_frames: int
    generate_frames: int | None  # generate's ``frames``; None: an image model's one frame
    formats: tuple[str, ...]
    fps: float


def frame_rule(backbone: Backbone) -> int | None:
    """The temporal compression c of the backbone's autoencoder (it encodes clips of k·c + 1
    frames), or None when it encodes images. Asked in turn: its ``vae`` when that is a video
    VAE (Wan 2.1's), the backbone's own ``temporal_compression()`` where it has one (None:
    images), its ``vae`` (an image VAE); a backbone that shows none of them is taken for a 4x
    video model (:data:`DEFAULT_TEMPORAL_COMPRESSION`)."""
    vae = backbone.frozen().get("vae")
    if vae is not None and is_video_vae(vae):
        return temporal_compression(vae)
    own = getattr(backbone, "temporal_compression", None)
    if callable(own):
        return own()
    return DEFAULT_TEMPORAL_COMPRESSION if vae is None else None


def clip_frames_option(backbone: Backbone, frames: int, setting: str) -> int | None:
    """``generate``'s ``frames`` for clips of ``frames`` frames from ``backbone``: ``frames``
    if its autoencoder encodes that many (:func:`frame_rule`), None for an image model asked
    for one frame (an image is a one-frame clip); else a one-line error naming ``setting``."""
    step = frame_rule(backbone)
    if step is None:
        if frames == 1:
            return None
        raise ValueError(
            f"{setting} {frames}: this model's VAE encodes images; {setting} needs a video model"
        )
    problem = frame_rule_problem(setting, frames, step)
    if problem:
        raise ValueError(problem)
    return frames


def clip_fps(config: Config | None) -> float:
    """Frames per second of a run's sampled clips: its ``data.video.fps``, else
    :data:`~impasto.video_files.CLIP_FPS`."""
    video = None if config is None else config.data.video
    return CLIP_FPS if video is None or video.fps is None else video.fps
