"""Image folders and manifests: find image files and their captions.

A folder's captions are same-stem sidecars: ``.txt``, else ``.caption``, else ``.json`` (its
``caption`` or ``text`` string, or its ``tags`` list joined with ", "). A manifest is a JSONL
or CSV file with one row per image: ``image`` (a path, relative to the manifest's folder or
absolute), and optionally ``caption`` and ``weight``.

One bad item never stops a scan: an image whose caption file cannot be read, or a manifest row
that is not usable, is left out and returned as a :class:`~impasto.data.skips.Skipped` in the
:class:`Scan` (:func:`scan_folder`, :func:`scan_manifest`), for the run's bad-data report.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from PIL import Image

from impasto.data.skips import SCANNED, Skipped, UnreadableSource, error_reason

if TYPE_CHECKING:
    from impasto.data.video.records import ClipSlot

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS: tuple[str, ...] = (".bmp", ".jpeg", ".jpg", ".png", ".webp")
"""Lower-case suffixes accepted as images; matching ignores case (``.PNG`` works too)."""


class ImageBlob(Protocol):
    """Where an image's bytes live when they are not a plain file (a tar member, a dataset
    row). Implementations are small, picklable values (loader workers receive them)."""

    def read(self) -> bytes:
        """The encoded image file (JPEG, PNG, ...)."""
        ...


@dataclass(frozen=True)
class ImageRecord:
    """One training example: an image, its caption ("" when it has none), and a loss weight
    (a subfolder's or manifest row's; 1 by default).

    Attributes:
        image_path: the image file; for other sources (``blob`` set) a name that identifies
            the image in messages and reports (e.g. ``shard-0003.tar/000123.jpg``).
        caption: the caption text.
        weight: loss weight.
        blob: reads the image bytes when they are not the file ``image_path``.
        size: ``(height, width)`` when the source already knows it (saves opening the image
            to place it in a bucket).
        clip: a video run's video or frame folder (:mod:`impasto.data.video.records`): its
            probe and clip slot; None for an image (a one-frame sample in a video run).
    """

    image_path: Path | str
    caption: str
    weight: float = 1.0
    blob: ImageBlob | None = None
    size: tuple[int, int] | None = None
    clip: ClipSlot | None = None

    def read_bytes(self) -> bytes:
        """The encoded image file."""
        return self.blob.read() if self.blob is not None else Path(self.image_path).read_bytes()

    def open_image(self) -> Image.Image:
        """The image, opened lazily (``Image.open``: only the header is read until ``load()``)."""
        if self.blob is None:
            return Image.open(self.image_path)
        return Image.open(io.BytesIO(self.blob.read()))


def is_image_path(path: Path) -> bool:
    """Whether ``path`` has one of :data:`IMAGE_EXTENSIONS` (case-insensitive)."""
    return path.suffix.lower() in IMAGE_EXTENSIONS


@dataclass
class Scan:
    """What reading a source found: its records, and the items it left out with the reason
    (each named once). ``groups``: each image's group (its name → a folder's top-level
    subfolder, else the source's name), filled in by :func:`~impasto.data.records.scan_sources`
    for the run summary and the tag frequency of checkpoints (:mod:`impasto.data.census`).
    ``held_out``: the images ``data.validation_split`` keeps out of ``records``, each once, in
    their fixed order (:mod:`impasto.data.holdout`)."""

    records: list[ImageRecord] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    groups: dict[str, str] = field(default_factory=dict)
    held_out: list[ImageRecord] = field(default_factory=list)  # data.validation_split's images

    def skip(self, name: str | Path, reason: str) -> None:
        self.skipped.append(Skipped(SCANNED, str(name), reason))

    def logged_records(self) -> list[ImageRecord]:
        """The records, after a warning for each item left out (for callers that keep no
        report)."""
        for item in self.skipped:
            logger.warning("data: left out %s: %s", item.name, item.reason)
        return self.records


CAPTION_SUFFIXES = (".txt", ".caption", ".json")


class CaptionError(ValueError):
    """A caption file that exists but cannot be used; ``reason`` names it and the problem."""

    def __init__(self, path: Path, problem: str) -> None:
        self.reason = f"caption file {path.name} {problem}"
        super().__init__(f"data: caption file {path} {problem}")


def _json_caption(path: Path) -> str:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as error:
        raise CaptionError(path, f"is not valid JSON ({error.msg})") from None
    if isinstance(data, dict):
        if isinstance(data.get("caption") or data.get("text"), str):
            return (data.get("caption") or data.get("text")).strip()
        if isinstance(data.get("tags"), list):
            return ", ".join(str(tag).strip() for tag in data["tags"])
    raise CaptionError(path, "has no 'caption' or 'text' string nor a 'tags' list")


def read_caption(image_path: Path) -> str:
    """The caption stored next to ``image_path``: ``<stem>.txt``, ``.caption`` or ``.json``.

    The first that exists wins. Text is decoded as UTF-8 (a leading byte-order mark is dropped)
    and stripped of surrounding whitespace. No caption file gives ``""``, which trains the
    unconditional branch for that image.

    Raises:
        CaptionError: the caption file is not UTF-8, not valid JSON, a folder, or unreadable.
    """
    for suffix in CAPTION_SUFFIXES:
        caption_path = image_path.with_suffix(suffix)
        if not caption_path.exists():
            continue
        if not caption_path.is_file():
            raise CaptionError(caption_path, "is not a file")
        try:
            if suffix == ".json":
                return _json_caption(caption_path)
            return caption_path.read_text(encoding="utf-8-sig").strip()
        except UnicodeDecodeError as error:
            raise CaptionError(
                caption_path, f"is {error_reason(error)}; re-save it as UTF-8"
            ) from None
        except OSError as error:
            raise CaptionError(caption_path, f"cannot be read ({error_reason(error)})") from None
    return ""


def _is_hidden(relative_path: Path) -> bool:
    # Skips e.g. ".ipynb_checkpoints/" or ".git/", which would silently duplicate images.
    return any(part.startswith(".") for part in relative_path.parts)


def scan_image_folder(
    root: Path, subfolders: Mapping[str, tuple[int, float]] | None = None
) -> list[ImageRecord]:
    """:func:`scan_folder`'s records; each image left out is logged as a warning."""
    return scan_folder(root, subfolders).logged_records()


KOHYA_FOLDER = re.compile(r"^(\d+)_(.+)$")  # kohya's "10_sks dog": 10 repeats
MAX_FOLDER_REPEATS = 10000  # as data.subfolders.*.repeats


def folder_repeats(
    names: Iterable[str], subfolders: Mapping[str, tuple[int, float]]
) -> dict[str, tuple[int, float]]:
    """``subfolders`` plus, for each other top-level folder named ``N_name``, ``N`` repeats
    (weight 1), as kohya's trainers read such folders; printed, so the repeats never come as a
    surprise. An ``N`` above :data:`MAX_FOLDER_REPEATS` (a date, say) is a one-line error."""
    found = dict(subfolders)
    for name in sorted(set(names) - set(subfolders)):
        match = KOHYA_FOLDER.match(name)
        if match is None:
            continue
        repeats = int(match.group(1))
        if not 1 <= repeats <= MAX_FOLDER_REPEATS:
            raise ValueError(
                f"data: subfolder {name!r} reads as {repeats} repeats (kohya's N_name); rename "
                "it, set its repeats in data.subfolders, or set data.folder_repeats: false"
            )
        found[name] = (repeats, 1.0)
        print(f"impasto: subfolder {name}: {repeats} repeats (N_name; data.folder_repeats: "
              "false turns this off)")  # fmt: skip
    return found


def scan_folder(
    root: Path,
    subfolders: Mapping[str, tuple[int, float]] | None = None,
    kohya_repeats: bool = False,
) -> Scan:
    """Every image under ``root`` (recursively) with its caption.

    Images are files whose suffix is in :data:`IMAGE_EXTENSIONS`, in any letter case. Files and
    folders whose name starts with ``.`` are skipped. The order is sorted by the path relative
    to ``root`` (compared folder by folder), so it does not depend on the file system, and the
    sample indices used by the sampler stay stable between runs.

    Args:
        root: the dataset folder.
        subfolders: top-level subfolder name → (repeats, weight): its images appear
            ``repeats`` times per epoch (consecutive copies, each its own augmentation) and
            carry loss weight ``weight`` (kohya's ``N_name`` folders, made explicit).
        kohya_repeats: a top-level folder named ``N_name`` that ``subfolders`` does not list
            repeats its images ``N`` times (:func:`folder_repeats`).

    Returns:
        One :class:`ImageRecord` per image (and repeat), sorted by relative path; an image
        whose caption file cannot be read (not UTF-8, not JSON, a folder) is left out and
        named in ``skipped`` with the reason.

    Raises:
        ValueError: ``root`` does not exist, is not a folder, or holds no images.
    """
    root = Path(root)
    if not root.exists():
        raise ValueError(
            f"data: image folder {root} does not exist; check the path (a relative path in a "
            "config file is relative to the file's folder)"
        )
    if not root.is_dir():
        raise ValueError(f"data: {root} is not a folder; point the dataset at a folder of images")
    relative_paths = sorted(
        path.relative_to(root)
        for path in root.rglob("*")
        if is_image_path(path) and path.is_file() and not _is_hidden(path.relative_to(root))
    )
    if not relative_paths:
        accepted = " ".join(IMAGE_EXTENSIONS)
        raise ValueError(
            f"data: no images found in {root}; accepted extensions are {accepted} (any case)"
        )
    subfolders = subfolders or {}
    present = {relative.parts[0] for relative in relative_paths if len(relative.parts) > 1}
    missing = sorted(set(subfolders) - present)
    if missing:
        raise ValueError(
            f"data.subfolders: {root} has no subfolder {missing[0]!r} with images; "
            f"subfolders with images: {', '.join(sorted(present)) or 'none'}"
        )
    if kohya_repeats:
        subfolders = folder_repeats(present, subfolders)
    scan = Scan()
    for relative in relative_paths:
        try:
            caption = read_caption(root / relative)
        except CaptionError as error:
            scan.skip(root / relative, error.reason)
            continue
        repeats, weight = (
            subfolders.get(relative.parts[0], (1, 1.0)) if len(relative.parts) > 1 else (1, 1.0)
        )
        scan.records.extend([ImageRecord(root / relative, caption, weight)] * repeats)
    return scan


def read_manifest(path: Path) -> list[ImageRecord]:
    """:func:`scan_manifest`'s records; each row left out is logged as a warning."""
    return scan_manifest(path).logged_records()


def row_weight(raw_weight: object) -> float:
    """A manifest row's loss weight (1 when empty); ``ValueError`` (the reason) when it is not
    a finite number > 0."""
    try:
        weight = 1.0 if raw_weight in (None, "") else float(raw_weight)
    except (TypeError, ValueError):
        raise ValueError(f"weight {raw_weight!r} is not a number") from None
    if not 0 < weight < math.inf:
        raise ValueError(f"weight must be > 0 and finite, got {weight}")
    return weight


def _manifest_rows(path: Path) -> list[tuple[str, object]]:
    """``(where, row)`` for each row: ``line N`` of a JSONL file (a line that is not JSON is
    its ``ValueError``), ``row N`` of a CSV file."""
    try:
        if path.suffix == ".jsonl":
            lines = enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1)
            rows = []
            for number, line in lines:
                if line.strip():
                    try:
                        rows.append((f"line {number}", json.loads(line)))
                    except json.JSONDecodeError as error:
                        rows.append((f"line {number}", ValueError(f"not JSON ({error.msg})")))
            return rows
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return [(f"row {n}", row) for n, row in enumerate(csv.DictReader(handle), 1)]
    except (UnicodeDecodeError, OSError, csv.Error) as error:
        raise UnreadableSource(str(path), f"cannot be read ({error_reason(error)})") from None


def scan_manifest(path: Path, columns: tuple[str, ...] = ("image",)) -> Scan:
    """The rows of a JSONL (``.jsonl``) or CSV (``.csv``) manifest (module docstring).

    A row without ``image``, a line that is not JSON, or a weight that is not a number > 0 is
    left out and named (``file line N`` / ``file row N``) in ``skipped`` with the reason.
    ``columns``: where a row's path may be, the first given wins (a video run's manifest:
    ``video``, else ``image``).

    Raises:
        ValueError: no such file, an unknown suffix, or no usable rows;
            :class:`~impasto.data.skips.UnreadableSource` when the file does not decode.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"data: manifest {path} does not exist; check the path (a relative path in a config "
            "file is relative to the file's folder)"
        )
    if path.suffix not in (".jsonl", ".csv"):
        raise ValueError(f"data: manifest {path} must be .jsonl or .csv")
    scan = Scan()
    for where, row in _manifest_rows(path):
        name = f"{path} {where}"
        if isinstance(row, ValueError):
            scan.skip(name, str(row))
            continue
        column = next((c for c in columns if isinstance(row, dict) and row.get(c)), None)
        if column is None:
            scan.skip(name, f"no {' or '.join(repr(c) for c in columns)} field")
            continue
        try:
            weight = row_weight(row.get("weight"))
        except ValueError as error:
            scan.skip(name, str(error))
            continue
        image = Path(row[column])
        image = image if image.is_absolute() else path.parent / image
        scan.records.append(ImageRecord(image, str(row.get("caption") or "").strip(), weight))
    if not scan.records:
        reason = f" ({scan.skipped[0].name}: {scan.skipped[0].reason})" if scan.skipped else ""
        raise ValueError(f"data: manifest {path} has no usable rows{reason}")
    return scan
