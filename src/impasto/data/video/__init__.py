"""Video data (issue #32, DESIGN §9): clips from videos, frame folders and images, decoded with
PyAV (the ``video`` extra, imported on first use), frames counted by decoding, clips sampled by
pure functions (docs/video.md).

The training pipeline reads clips through :mod:`~impasto.data.video.records`; the disk cache
of clips is :mod:`~impasto.data.video.clip_cache` (keys by :mod:`~impasto.data.video.content`).

- :mod:`~impasto.data.video.frames`: reading frames from each kind of source.
- :mod:`~impasto.data.video.probe`: :func:`probe_clip` (frame count and timestamps) and
  :func:`decode_clips` / :func:`decode_frames` (the frames a clip asks for).
- :mod:`~impasto.data.video.sampling`: :func:`fit_frames` (the 4n+1 rule) and
  :func:`sample_clips` (target fps or stride, clip length, several clips per video).
- :mod:`~impasto.data.video.scan`: :func:`scan_clip_folder` (clips and captions) and
  :func:`probe_clips` (the broken ones left out and listed).
- :mod:`~impasto.data.video.index` and :mod:`~impasto.data.video.share`: the probe index kept
  between runs, and probing split across the ranks of a run (each clip decoded by one rank).
"""

from impasto.data.video.frames import (
    DEFAULT_FRAME_FOLDER_FPS,
    FPS_FILE,
    VIDEO_EXTENSIONS,
    ClipBlob,
    UnreadableClip,
    import_av,
    natural_key,
)
from impasto.data.video.probe import ClipInfo, decode_clips, decode_frames, probe_clip
from impasto.data.video.sampling import (
    CLIP_PLACEMENTS,
    ClipSampling,
    clip_length,
    fit_frames,
    frame_grid,
    sample_clips,
)
from impasto.data.video.scan import (
    ClipRecord,
    ClipScan,
    clip_caption,
    is_frame_folder,
    probe_clips,
    scan_clip_folder,
)

__all__ = [
    "CLIP_PLACEMENTS",
    "DEFAULT_FRAME_FOLDER_FPS",
    "FPS_FILE",
    "VIDEO_EXTENSIONS",
    "ClipBlob",
    "ClipInfo",
    "ClipRecord",
    "ClipSampling",
    "ClipScan",
    "UnreadableClip",
    "clip_caption",
    "clip_length",
    "decode_clips",
    "decode_frames",
    "fit_frames",
    "frame_grid",
    "import_av",
    "is_frame_folder",
    "natural_key",
    "probe_clip",
    "probe_clips",
    "sample_clips",
    "scan_clip_folder",
]
