"""Judge demo clips: do they show the colour, shape and direction their captions ask for?

Model-free, like the image demo's judge (:mod:`impasto.data.demo_eval`), whose reading it
reuses:

- colour and shape: :func:`~impasto.data.demo_eval.read_demo_image` on every frame; the most
  common reading wins (a generated clip may blur its shape in a few frames, and one frame
  decides nothing);
- direction: the shape's centroid (the pixels the image judge calls foreground: far from the
  border's median colour) in each frame, a least-squares line through each coordinate over time,
  and the axis that moves more over the clip: left/right by the sign of x, up/down by the sign
  of y (image rows grow downwards). Under ``MIN_DISPLACEMENT`` pixels on both axes, or fewer
  than two frames with a shape, the clip reads as no direction (wrong).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from impasto.data.demo_eval import MIN_FOREGROUND_PIXELS, foreground_mask, read_demo_image
from impasto.data.demo_video import parse_demo_video_caption

MIN_DISPLACEMENT = 1.0  # pixels over the whole clip; the demo's slowest clip moves 8


@dataclass(frozen=True)
class VideoDemoReading:
    color: str | None  # None when no frame shows a shape
    shape: str | None
    direction: str | None  # None when the shape does not move (or is missing)
    displacement: tuple[float, float]  # (dx, dy) of the fitted centroid, first to last frame


@dataclass(frozen=True)
class VideoDemoScore:
    num_clips: int
    color_accuracy: float
    shape_accuracy: float
    direction_accuracy: float
    color_confusions: dict[str, int] = field(default_factory=dict)  # "asked->read": count
    shape_confusions: dict[str, int] = field(default_factory=dict)
    direction_confusions: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "num_clips": self.num_clips,
            "color_accuracy": round(self.color_accuracy, 4),
            "shape_accuracy": round(self.shape_accuracy, 4),
            "direction_accuracy": round(self.direction_accuracy, 4),
            "color_confusions": self.color_confusions,
            "shape_confusions": self.shape_confusions,
            "direction_confusions": self.direction_confusions,
        }


def _to_uint8_scale(clip: np.ndarray) -> np.ndarray:
    """``[T, H, W, 3]`` as float64 on the image judge's 0..255 scale: uint8 as is, floats
    (e.g. a model's output) taken to be in [0, 1]."""
    clip = np.asarray(clip)
    if clip.ndim != 4 or clip.shape[-1] != 3:
        raise ValueError(f"demo video: a clip is [T, H, W, 3], got shape {list(clip.shape)}")
    if clip.dtype == np.uint8:
        return clip.astype(np.float64)
    return np.clip(clip.astype(np.float64), 0.0, 1.0) * 255.0


def _most_common(values: list[str | None]) -> str | None:
    found = [value for value in values if value is not None]
    return Counter(found).most_common(1)[0][0] if found else None


def read_direction(clip: np.ndarray) -> tuple[str | None, tuple[float, float]]:
    """The direction of motion of a ``[T, H, W, 3]`` 0..255 clip and the fitted centroid's
    ``(dx, dy)`` displacement over it, in pixels."""
    times, centroids = [], []
    for index, frame in enumerate(clip):
        rows, cols = np.nonzero(foreground_mask(frame))
        if len(rows) >= MIN_FOREGROUND_PIXELS:
            times.append(index)
            centroids.append((cols.mean(), rows.mean()))
    if len(times) < 2:
        return None, (0.0, 0.0)
    # Slope of the least-squares line through (t, x) and (t, y), times the clip's duration.
    slopes = np.polyfit(np.asarray(times, float), np.asarray(centroids), deg=1)[0]
    dx, dy = (float(s) * (len(clip) - 1) for s in slopes)
    if max(abs(dx), abs(dy)) < MIN_DISPLACEMENT:
        return None, (dx, dy)
    if abs(dx) >= abs(dy):
        return ("right" if dx > 0 else "left"), (dx, dy)
    return ("down" if dy > 0 else "up"), (dx, dy)


def read_demo_clip(clip: np.ndarray) -> VideoDemoReading:
    """Read a ``[T, H, W, 3]`` clip: uint8, or floats in [0, 1]."""
    pixels = _to_uint8_scale(clip)
    readings = [read_demo_image(frame) for frame in pixels]
    direction, displacement = read_direction(pixels)
    return VideoDemoReading(
        color=_most_common([reading.color for reading in readings]),
        shape=_most_common([reading.shape for reading in readings]),
        direction=direction,
        displacement=displacement,
    )


def score_demo_clips(clips: Sequence[np.ndarray], captions: Sequence[str]) -> VideoDemoScore:
    """Colour, shape and direction accuracy of ``clips`` (each ``[T, H, W, 3]``, uint8 or
    floats in [0, 1]) against the demo ``captions`` they were asked for."""
    if len(clips) != len(captions) or not clips:
        raise ValueError(
            f"demo video: need one caption per clip, got {len(clips)} clips and "
            f"{len(captions)} captions"
        )
    counts = {"color": Counter(), "shape": Counter(), "direction": Counter()}
    for clip, caption in zip(clips, captions, strict=True):
        color, shape, direction, _ = parse_demo_video_caption(caption)
        reading = read_demo_clip(clip)
        counts["color"][(color, reading.color)] += 1
        counts["shape"][(shape, reading.shape)] += 1
        counts["direction"][(direction, reading.direction)] += 1
    return VideoDemoScore(
        num_clips=len(clips),
        color_accuracy=_accuracy(counts["color"]),
        shape_accuracy=_accuracy(counts["shape"]),
        direction_accuracy=_accuracy(counts["direction"]),
        color_confusions=_confusions(counts["color"]),
        shape_confusions=_confusions(counts["shape"]),
        direction_confusions=_confusions(counts["direction"]),
    )


def _accuracy(counts: Counter) -> float:
    return sum(n for (asked, read), n in counts.items() if asked == read) / sum(counts.values())


def _confusions(counts: Counter) -> dict[str, int]:
    return {
        f"{asked}->{read}": n
        for (asked, read), n in sorted(counts.items(), key=str)
        if asked != read
    }


FIRST_SEED = 1000  # away from the validation grid's seeds, as the image demo's score


def demo_video_prompts() -> list[str]:
    """A caption for every (colour, shape, direction): 72 prompts, each background as often
    (background index = colour + shape + direction index, mod 3)."""
    from impasto.data.demo import DEMO_BACKGROUNDS, DEMO_COLORS, DEMO_SHAPES
    from impasto.data.demo_video import DEMO_DIRECTIONS, demo_video_caption

    backgrounds = list(DEMO_BACKGROUNDS)
    return [
        demo_video_caption(color, shape, direction, backgrounds[(i + j + k) % len(backgrounds)])
        for i, color in enumerate(DEMO_COLORS)
        for j, shape in enumerate(DEMO_SHAPES)
        for k, direction in enumerate(DEMO_DIRECTIONS)
    ]


def score_demo_video_checkpoint(
    checkpoint: str | Path, clips_per_prompt: int = 1, held_out: bool = False,
    device: str = "cpu",
) -> VideoDemoScore:  # fmt: skip
    """Colour, shape and direction accuracy of clips sampled from a video demo checkpoint with
    its own validation settings, ``clips_per_prompt`` per prompt: every (colour, shape,
    direction) (:func:`demo_video_prompts`), or with ``held_out`` the 18 combinations no
    training clip shows. Clips have the run's ``sample.frames`` (else ``data.video.num_frames``)
    at ``data.resolution``."""
    import torch

    from impasto.checkpoint.trained import load_trained
    from impasto.data.demo_video import demo_video_held_out_prompts
    from impasto.inference import model_sampling_options
    from impasto.sampling import generate

    config, backbone = load_trained(checkpoint)
    backbone.to(device)
    prompts = demo_video_held_out_prompts() if held_out else demo_video_prompts()
    frames = getattr(config.sample, "frames", None) or config.data.video.num_frames
    with torch.no_grad():
        clips = generate(
            backbone, prompts, num_images_per_prompt=clips_per_prompt,
            num_steps=config.sample.num_steps, guidance_scale=config.sample.guidance_scale,
            sampler=config.sample.sampler, seed=FIRST_SEED, height=config.data.resolution,
            width=config.data.resolution, frames=frames, **model_sampling_options(config),
        )  # fmt: skip
    frames_last = clips.permute(0, 2, 3, 4, 1).numpy()  # [B, T, H, W, 3] in [0, 1]
    captions = [prompt for prompt in prompts for _ in range(clips_per_prompt)]
    return score_demo_clips(list(frames_last), captions)
