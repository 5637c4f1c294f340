"""Image folders and manifests: find image files and their captions.

A folder's captions are same-stem sidecars: ``.txt``, else ``.caption``, else ``.json`` (its
``caption`` or ``text`` string, or its ``tags`` list joined with ", "). A manifest is a JSONL
or CSV file with one row per image: ``image`` (a path, relative to the manifest's folder or
absolute), and optionally ``caption`` and ``weight``.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from PIL import Image

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
    """

    image_path: Path | str
    caption: str
    weight: float = 1.0
    blob: ImageBlob | None = None
    size: tuple[int, int] | None = None

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


CAPTION_SUFFIXES = (".txt", ".caption", ".json")


def _json_caption(path: Path) -> str:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as error:
        raise ValueError(f"data: caption file {path} is not valid JSON ({error.msg})") from None
    if isinstance(data, dict):
        if isinstance(data.get("caption") or data.get("text"), str):
            return (data.get("caption") or data.get("text")).strip()
        if isinstance(data.get("tags"), list):
            return ", ".join(str(tag).strip() for tag in data["tags"])
    raise ValueError(
        f"data: caption file {path} has no 'caption' or 'text' string nor a 'tags' list"
    )


def read_caption(image_path: Path) -> str:
    """The caption stored next to ``image_path``: ``<stem>.txt``, ``.caption`` or ``.json``.

    The first that exists wins. Text is decoded as UTF-8 (a leading byte-order mark is dropped)
    and stripped of surrounding whitespace. No caption file gives ``""``, which trains the
    unconditional branch for that image.
    """
    for suffix in CAPTION_SUFFIXES:
        caption_path = image_path.with_suffix(suffix)
        if not caption_path.is_file():
            continue
        if suffix == ".json":
            return _json_caption(caption_path)
        try:
            return caption_path.read_text(encoding="utf-8-sig").strip()
        except UnicodeDecodeError:
            raise ValueError(
                f"data: caption file {caption_path} is not valid UTF-8; re-save it as UTF-8"
            ) from None
    return ""


def _is_hidden(relative_path: Path) -> bool:
    # Skips e.g. ".ipynb_checkpoints/" or ".git/", which would silently duplicate images.
    return any(part.startswith(".") for part in relative_path.parts)


def scan_image_folder(
    root: Path, subfolders: Mapping[str, tuple[int, float]] | None = None
) -> list[ImageRecord]:
    """List every image under ``root`` (recursively) with its caption.

    Images are files whose suffix is in :data:`IMAGE_EXTENSIONS`, in any letter case. Files and
    folders whose name starts with ``.`` are skipped. The order is sorted by the path relative
    to ``root`` (compared folder by folder), so it does not depend on the file system, and the
    sample indices used by the sampler stay stable between runs.

    Args:
        root: the dataset folder.
        subfolders: top-level subfolder name → (repeats, weight): its images appear
            ``repeats`` times per epoch (consecutive copies, each its own augmentation) and
            carry loss weight ``weight`` (kohya's ``N_name`` folders, made explicit).

    Returns:
        One :class:`ImageRecord` per image (and repeat), sorted by relative path.

    Raises:
        ValueError: ``root`` does not exist, is not a folder, or holds no images.
    """
    root = Path(root)
    if not root.exists():
        raise ValueError(f"data: image folder {root} does not exist; check the path")
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
    records = []
    for relative in relative_paths:
        record = ImageRecord(image_path=root / relative, caption=read_caption(root / relative))
        repeats, weight = (
            subfolders.get(relative.parts[0], (1, 1.0)) if len(relative.parts) > 1 else (1, 1.0)
        )
        records.extend([replace(record, weight=weight)] * repeats)
    return records


def read_manifest(path: Path) -> list[ImageRecord]:
    """The rows of a JSONL (``.jsonl``) or CSV (``.csv``) manifest (module docstring).

    A row without ``image``, a bad line, a non-positive weight or an unknown suffix is a
    one-line error naming the file and row.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: manifest {path} does not exist; check data.path")
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"data: {path} line {number}: not JSON ({error.msg})") from None
    elif path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.DictReader(handle))
    else:
        raise ValueError(f"data: manifest {path} must be .jsonl or .csv")
    records = []
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not row.get("image"):
            raise ValueError(f"data: {path} row {number}: no 'image' field")
        raw_weight = row.get("weight")
        try:
            weight = 1.0 if raw_weight in (None, "") else float(raw_weight)
        except ValueError:
            raise ValueError(
                f"data: {path} row {number}: weight {raw_weight!r} is not a number"
            ) from None
        if weight <= 0:
            raise ValueError(f"data: {path} row {number}: weight must be > 0, got {weight}")
        image = Path(row["image"])
        image = image if image.is_absolute() else path.parent / image
        records.append(ImageRecord(image, str(row.get("caption") or "").strip(), weight))
    if not records:
        raise ValueError(f"data: manifest {path} has no rows")
    return records
