"""Image folders: find image files and their same-stem ``.txt`` captions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

IMAGE_EXTENSIONS: tuple[str, ...] = (".bmp", ".jpeg", ".jpg", ".png", ".webp")
"""Lower-case suffixes accepted as images; matching ignores case (``.PNG`` works too)."""


@dataclass(frozen=True)
class ImageRecord:
    """One training example on disk: an image file and its caption ("" when it has none)."""

    image_path: Path
    caption: str


def is_image_path(path: Path) -> bool:
    """Whether ``path`` has one of :data:`IMAGE_EXTENSIONS` (case-insensitive)."""
    return path.suffix.lower() in IMAGE_EXTENSIONS


def read_caption(image_path: Path) -> str:
    """Read the caption stored next to ``image_path`` as ``<stem>.txt``.

    The text is decoded as UTF-8 (a leading byte-order mark is dropped) and stripped of
    surrounding whitespace. A missing caption file gives ``""``, which trains the unconditional
    branch for that image.
    """
    caption_path = image_path.with_suffix(".txt")
    if not caption_path.is_file():
        return ""
    try:
        return caption_path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError:
        raise ValueError(
            f"data: caption file {caption_path} is not valid UTF-8; re-save it as UTF-8"
        ) from None


def _is_hidden(relative_path: Path) -> bool:
    # Skips e.g. ".ipynb_checkpoints/" or ".git/", which would silently duplicate images.
    return any(part.startswith(".") for part in relative_path.parts)


def scan_image_folder(root: Path) -> list[ImageRecord]:
    """List every image under ``root`` (recursively) with its caption.

    Images are files whose suffix is in :data:`IMAGE_EXTENSIONS`, in any letter case. Files and
    folders whose name starts with ``.`` are skipped. The order is sorted by the path relative
    to ``root`` (compared folder by folder), so it does not depend on the file system, and the
    sample indices used by the sampler stay stable between runs.

    Args:
        root: the dataset folder.

    Returns:
        One :class:`ImageRecord` per image, sorted by relative path.

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
    return [
        ImageRecord(image_path=root / relative, caption=read_caption(root / relative))
        for relative in relative_paths
    ]
