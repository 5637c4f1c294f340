"""``impasto data demo``: the image demo's dataset or the video demo's clips, from the
command's options (an option of the other kind of dataset is a one-line error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Options of one kind of dataset only (keyword: flag); unset ones take the writer's default.
IMAGE_OPTIONS = {"num_images": "--num-images"}
VIDEO_OPTIONS = {
    "num_clips": "--num-clips",
    "frames": "--frames",
    "fmt": "--format",
    "held_out": "--held-out",
    "num_stills": "--num-stills",
}


def write_demo(out_dir: Path, video: bool, size: int, seed: int, **given: Any) -> str:
    """Write the demo dataset (``video``: clips) to ``out_dir``; ``given``: the options of
    :data:`IMAGE_OPTIONS` and :data:`VIDEO_OPTIONS`, None where unset. Returns what was
    written, as one line."""
    own, other = (VIDEO_OPTIONS, IMAGE_OPTIONS) if video else (IMAGE_OPTIONS, VIDEO_OPTIONS)
    stray = [flag for key, flag in other.items() if given.get(key) is not None]
    if stray:
        where = "not with" if video else "only with"
        raise ValueError(f"data demo: {', '.join(stray)}: {where} --video")
    options = {key: given[key] for key in own if given.get(key) is not None}
    if video:
        from impasto.data.demo_video import write_demo_video_dataset

        count = write_demo_video_dataset(out_dir, size=size, seed=seed, **options)
        stills = f" and {options['num_stills']} stills" if options.get("num_stills") else ""
        return f"impasto: wrote {count} clips{stills} with captions to {out_dir}"
    from impasto.data.demo import write_demo_dataset

    count = write_demo_dataset(out_dir, size=size, seed=seed, **options)
    return f"impasto: wrote {count} images with captions to {out_dir}"
