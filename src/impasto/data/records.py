"""A run's records: every source of ``data`` read, and what had to be left out, and why.

One bad item never stops a run (issue #16): a caption file that is not UTF-8, a manifest row
without an image, a truncated tar shard, a Parquet or Arrow file that does not load, an image
without a caption (``data.missing_captions: skip``) is left out as a
:class:`~impasto.data.skips.Skipped`, named once, and reported in ``RUN/bad-data.tsv`` with the
reason. A source that cannot be read at all is left out the same way while another source still
has images; only when nothing readable remains, or more than ``data.max_bad_fraction`` of the
items are unusable, does the run stop, with one line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from impasto.data.demo import DEMO_GENERATOR, write_demo_dataset
from impasto.data.demo_stamp import check_stamp, write_stamped
from impasto.data.folder import ImageRecord, Scan, scan_folder, scan_manifest
from impasto.data.holdout import ordered_images, record_identity, split_held_out
from impasto.data.prompts import read_prompts
from impasto.data.skips import Skipped, UnreadableSource, distinct
from impasto.data.sources import hf_dataset_scan, parquet_scan, webdataset_scan
from impasto.data.video.records import clip_reader
from impasto.distributed import barrier

NO_CAPTION = "no caption (left out by data.missing_captions: skip)"
"""The reason reported for an image left out for having no caption."""
NUM_NAMED = 20  # items named on the console; the report names them all


def shard_index_dir(config: Any) -> Path:
    """``data.index_dir``, or ``$XDG_CACHE_HOME/impasto/shards`` (``~/.cache/...``)."""
    if config.data.index_dir:
        return Path(config.data.index_dir)
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "impasto" / "shards"


def _folder_scan(source: Any, index_dir: Path) -> Scan:
    subfolders = {name: (sub.repeats, sub.weight) for name, sub in source.subfolders.items()}
    return scan_folder(Path(source.path), subfolders, source.folder_repeats)


def _manifest_scan(source: Any, index_dir: Path) -> Scan:
    path = Path(source.path)
    return parquet_scan(path) if path.suffix == ".parquet" else scan_manifest(path)


SOURCE_READERS = {
    "folder": _folder_scan,
    "manifest": _manifest_scan,
    "webdataset": lambda source, index_dir: webdataset_scan(source.path, index_dir),
    "hf": lambda source, index_dir: hf_dataset_scan(
        source.path, source.split, source.image_column, source.caption_column
    ),
}
"""``data.source`` → the reader of one source: ``(source, shard index dir) -> Scan``."""


def scan_sources(config: Any, main: bool = True) -> Scan:
    """Every source's records, each repeated ``repeats`` times with its ``loss_weight``, then
    (``data.missing_captions: skip``) the images without a caption left out; every item left
    out, once per name; and each image's group (:func:`group_of`). The fraction is not checked
    here (:func:`check_bad_fraction`).

    ``main``: this process writes the demo dataset when it is missing (the other ranks of a
    run wait for it).

    ``data.validation_split`` holds images out of the records, into ``held_out``
    (:mod:`impasto.data.holdout`: by a hash of each image's identity and ``eval.seed``).
    """
    data = config.data
    if main and data.generate_demo and not Path(data.path).exists():
        write_run_demo(config)
    barrier()
    if data.generate_demo:  # every rank: each stops with the same line
        check_stamp(Path(data.path), run_demo_settings(config), "data.path")
    if data.prompts is not None:
        prompts = read_prompts(data.prompts)
        name = Path(data.prompts).name
        return Scan(prompts, groups={str(record.image_path): name for record in prompts})
    scan, unreadable, identities = Scan(), [], {}
    for source in data.source_list():
        reader = SOURCE_READERS[source.source] if data.video is None else clip_reader(source.source)
        try:
            found = reader(source, shard_index_dir(config))
        except UnreadableSource as error:  # left out while another source has images
            unreadable.append(error)
            scan.skip(error.name, error.reason)
            continue
        records = found.records
        if source.loss_weight != 1.0:
            records = [
                replace(record, weight=record.weight * source.loss_weight) for record in records
            ]
        scan.records.extend(record for record in records for _ in range(source.repeats))
        scan.skipped.extend(found.skipped)
        scan.groups.update((str(record.image_path), group_of(source, record)) for record in records)
        identities.update((str(r.image_path), record_identity(source.path, r)) for r in records)
    if not scan.records and unreadable:  # nothing readable remains
        more = (
            f" (and {len(unreadable) - 1} more unreadable sources)" if len(unreadable) > 1 else ""
        )
        raise ValueError(f"{unreadable[0]}{more}")
    if data.missing_captions == "skip":
        scan = leave_out_uncaptioned(scan)
    # After the captions: an image left out for having none is neither trained nor held out.
    records, held_out = split_held_out(
        scan.records, identities, data.validation_split, config.eval.seed
    )
    if data.validation_split and not records:
        raise ValueError(
            f"data.validation_split: {data.validation_split:g} held out every image; lower it "
            "or add images"
        )
    return Scan(records, distinct(scan.skipped), scan.groups, held_out)


def run_demo_settings(config: Any) -> dict[str, Any]:
    """What the demo data of ``data.generate_demo`` is written for (its stamp; not the seed)."""
    data = config.data
    settings = {"demo_num_images": data.demo_num_images, "resolution": data.resolution,
                "demo_sizes": data.demo_sizes}  # fmt: skip
    if data.video is None:
        return {"generator": f"demo images {DEMO_GENERATOR}"} | settings
    from impasto.data.demo_video import DEMO_VIDEO_GENERATOR

    video = {"video.num_frames": data.video.num_frames, "demo_num_stills": data.demo_num_stills}
    return {"generator": f"demo clips {DEMO_VIDEO_GENERATOR}"} | settings | video


def write_run_demo(config: Any) -> None:
    """``data.generate_demo``: the demo images at ``data.path`` (or with ``data.video``, the
    demo clips: ``data.video.num_frames`` frames, or 9 .. num_frames in turn, at each side of
    ``data.demo_sizes`` in turn, and ``data.demo_num_stills`` still images), written whole and
    stamped (:mod:`impasto.data.demo_stamp`)."""
    data, path = config.data, Path(config.data.path)
    if data.video is None:
        write_stamped(path, run_demo_settings(config), lambda folder: write_demo_dataset(
            folder, data.demo_num_images, data.resolution, seed=config.train.seed,
            sizes=data.demo_sizes,
        ))  # fmt: skip
        print(f"impasto: wrote {data.demo_num_images} demo images to {data.path}")
        return
    from impasto.data.demo_video import write_demo_video_dataset

    sides = [height for height, _ in data.demo_sizes or [(data.resolution, data.resolution)]]
    frames = range(min(9, data.video.num_frames), data.video.num_frames + 1, 4)
    variants = [(side, count) for count in frames for side in sides]
    write_stamped(path, run_demo_settings(config), lambda folder: write_demo_video_dataset(
        folder, data.demo_num_images, seed=config.train.seed, variants=variants,
        num_stills=data.demo_num_stills,
    ))  # fmt: skip
    stills = f" and {data.demo_num_stills} stills" if data.demo_num_stills else ""
    print(f"impasto: wrote {data.demo_num_images} demo clips{stills} to {data.path}")


def source_name(source: Any) -> str:
    """How the summary and ``dataset.json`` name a source: its folder's or file's name."""
    return Path(str(source.path)).name or str(source.path)


def group_of(source: Any, record: ImageRecord) -> str:
    """The group ``record`` counts in: for a folder, the top-level subfolder it lies in
    (``3_cat``, as kohya names a dataset directory), else the source's name."""
    if source.source == "folder":
        parts = Path(record.image_path).relative_to(Path(source.path)).parts
        if len(parts) > 1:
            return parts[0]
    return source_name(source)


def leave_out_uncaptioned(scan: Scan) -> Scan:
    """The scan without the records that have no caption, each named once in ``skipped``
    (and the first :data:`NUM_NAMED` on the console)."""
    missing = sorted({str(record.image_path) for record in scan.records if not record.caption})
    if not missing:
        return scan
    print(f"impasto: left out {len(missing)} images without a caption: {_named(missing)}")
    kept = [record for record in scan.records if record.caption]
    left_out = Scan(kept, list(scan.skipped), scan.groups)
    for name in missing:
        left_out.skip(name, NO_CAPTION)
    return left_out


def _named(names: list[str]) -> str:
    named = ", ".join(names[:NUM_NAMED])
    return named + (f" and {len(names) - NUM_NAMED} more" if len(names) > NUM_NAMED else "")


def check_bad_fraction(
    skipped: Sequence[Skipped], num_usable: int, max_bad_fraction: float, report: Path | None = None
) -> None:
    """Stop, with one line, when the items left out before training (``skipped``, distinct
    names) are more than ``max_bad_fraction`` of all items (they and ``num_usable`` good ones);
    ``report``: where they are listed."""
    if not skipped:
        return
    bad = len(skipped)
    fraction = bad / (bad + num_usable)
    if fraction <= max_bad_fraction:
        return
    uncaptioned = sum(item.reason == NO_CAPTION for item in skipped)
    parts = [f"{uncaptioned} without a caption"] if uncaptioned else []
    if bad > uncaptioned:
        parts.append(f"{bad - uncaptioned} unreadable")
    fixes = "fix or remove them"
    if uncaptioned:
        fixes = "add captions (or set data.missing_captions: empty), " + fixes
    where = f"see {report}" if report else f"e.g. {skipped[0].name}: {skipped[0].reason}"
    raise ValueError(
        f"data: {bad} of {bad + num_usable} images unusable ({', '.join(parts)}); allowed: "
        f"{bad_fraction_text(max_bad_fraction)}; {where}; {fixes}"
    )


def bad_fraction_text(max_bad_fraction: float) -> str:
    """``data.max_bad_fraction`` as a reader takes it: "5% (data.max_bad_fraction)"."""
    return f"{max_bad_fraction * 100:g}% (data.max_bad_fraction)"


def num_items(records: Sequence[ImageRecord]) -> int:
    """Distinct images among ``records`` (repeats and copies listed by two sources are one)."""
    return len({str(record.image_path) for record in records})


def load_records(config: Any, main: bool = True) -> list[ImageRecord]:
    """:func:`scan_sources`' records, after :func:`check_bad_fraction`; what was left out is
    named on the console only (a run reports it in ``RUN/bad-data.tsv``:
    :func:`~impasto.data.pipeline.prepare_run_data`)."""
    scan = scan_sources(config, main)
    if main:
        print_left_out(scan.skipped, None)
    check_bad_fraction(scan.skipped, num_items(scan.records), config.data.max_bad_fraction)
    return scan.records


def print_left_out(skipped: Sequence[Skipped], report: Path | None) -> None:
    """One console line for the items left out other than for a missing caption (printed
    already)."""
    unreadable = [item.name for item in skipped if item.reason != NO_CAPTION]
    if unreadable:
        where = f" (reasons in {report})" if report else ""
        print(f"impasto: left out {len(unreadable)} unusable items{where}: {_named(unreadable)}")


def read_eval_set(config: Any, eval_set: Any) -> list[ImageRecord]:
    """The images of one of ``eval.sets``, each once, in their fixed order
    (:func:`~impasto.data.holdout.ordered_images`); images without a caption are left out with
    ``data.missing_captions: skip``. A one-line error when the set cannot be read or holds no
    usable image."""
    where = f"eval.sets {eval_set.name} ({eval_set.path})"
    video = config.data.video is not None
    reader = clip_reader(eval_set.source) if video else SOURCE_READERS[eval_set.source]
    try:
        scan = reader(eval_set, shard_index_dir(config))
    except UnreadableSource as error:
        raise ValueError(f"{where}: {error.reason}") from None
    except (ValueError, OSError) as error:
        raise ValueError(f"{where}: {str(error).removeprefix('data: ')}") from None
    records = scan.records
    if config.data.missing_captions == "skip":
        records = [record for record in records if record.caption]
    if not records:
        raise ValueError(f"{where}: no usable image with a caption in it")
    return ordered_images(records, str(eval_set.path), config.eval.seed)
