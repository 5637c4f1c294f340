"""Local Hugging Face datasets, loaded offline (docs/data-sources.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from impasto.data.folder import ImageRecord
from impasto.data.sources._common import _image_size


@contextmanager
def _hf_offline() -> Iterator[None]:
    """Offline mode for ``datasets`` and ``huggingface_hub`` while loading: both read their
    ``HF_*_OFFLINE`` variables at import, so the flags are set on their config modules."""
    import datasets.config
    import huggingface_hub.constants

    flags = [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),  # older datasets read this one
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
    ]
    saved = [
        (module, name, getattr(module, name)) for module, name in flags if hasattr(module, name)
    ]
    for module, name, _ in saved:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _load_hf_dataset(path: str, split: str | None):
    """The split of a ``save_to_disk`` folder, or of a folder ``load_dataset`` reads, offline.
    A plain saved ``Dataset`` has no splits: ``split`` is ignored for it."""
    import datasets

    with _hf_offline():
        try:
            loaded = datasets.load_from_disk(path)
        except FileNotFoundError:
            try:
                loaded = datasets.load_dataset(path)
            except (FileNotFoundError, ValueError) as error:
                reason = (str(error).splitlines() or [type(error).__name__])[0]
                raise ValueError(
                    f"data: {path} is neither a save_to_disk folder nor a dataset folder "
                    f"load_dataset reads ({reason})"
                ) from None
    if isinstance(loaded, datasets.Dataset):
        return loaded
    splits = list(loaded)
    if split is None and len(splits) == 1:
        return loaded[splits[0]]
    if split not in loaded:
        raise ValueError(f"data: {path} has no split {split!r}; its splits: {', '.join(splits)}")
    return loaded[split]


def _image_column(dataset, column: str, where: str, other_columns: Sequence[str] = ()):
    """``dataset`` with ``column`` read as undecoded images ``{"bytes", "path"}``, and
    ``other_columns``."""
    import datasets

    for name in (column, *other_columns):
        if name not in dataset.column_names:
            names = ", ".join(dataset.column_names)
            raise ValueError(f"data: {where} has no column {name!r}; its columns: {names}")
    try:
        selected = dataset.select_columns([column, *other_columns])
        return selected.cast_column(column, datasets.Image(decode=False))
    except (TypeError, ValueError, pa.ArrowException) as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"data: {where} column {column!r} does not hold images ({reason})"
        ) from None


# One loaded dataset per (process, path, split, column); loaded lazily in each loader worker.
_HF_IMAGES: dict[tuple[int, str, str | None, str], Any] = {}


def _hf_images(path: str, split: str | None, column: str):
    key = (os.getpid(), path, split, column)
    if key not in _HF_IMAGES:
        _HF_IMAGES[key] = _image_column(_load_hf_dataset(path, split), column, path)
    return _HF_IMAGES[key]


def _hf_image_file(value: dict[str, Any] | None) -> bytes | str | None:
    """An undecoded image value's bytes, or else its local file (an image folder's rows)."""
    return (value.get("bytes") or value.get("path")) if value else None


@dataclass(frozen=True)
class HFRowBlob:
    """The image bytes of ``dataset[index][column]`` of a local Hugging Face dataset."""

    path: str
    split: str | None
    index: int
    column: str

    def read(self) -> bytes:
        image_file = _hf_image_file(
            _hf_images(self.path, self.split, self.column)[self.index][self.column]
        )
        if image_file is None:
            raise OSError(f"{self.path} index {self.index}: no image bytes or path")
        return image_file if isinstance(image_file, bytes) else Path(image_file).read_bytes()


def hf_dataset_records(
    path: str | Path,
    split: str | None = "train",
    image_column: str = "image",
    caption_column: str | None = "text",
) -> list[ImageRecord]:
    """The rows of a local Hugging Face dataset, in index order, without touching the network.

    Args:
        path: a local folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``,
            or one ``datasets.load_dataset(path)`` reads (Parquet files, an image folder).
        split: the split to read; ``None`` takes the only one. Ignored for a plain ``Dataset``.
        image_column: the images (``datasets.Image``, or bytes or paths castable to it).
        caption_column: the caption strings; ``None`` gives every image the empty caption.

    Raises:
        ValueError: not a local folder, no such split or column, or a row without an image.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"data: Hugging Face dataset {path} is not a local folder; download it first "
            "(huggingface-cli download --repo-type dataset NAME --local-dir DIR) and pass DIR"
        )
    resolved = str(folder.resolve())
    where = resolved if split is None else f"{resolved} split {split!r}"
    dataset = _load_hf_dataset(resolved, split)
    other_columns = [caption_column] if caption_column is not None else []
    rows = _image_column(dataset, image_column, where, other_columns)
    # The blobs of this process (a loader without workers) reuse the dataset loaded here.
    _HF_IMAGES[(os.getpid(), resolved, split, image_column)] = rows.select_columns([image_column])
    prefix = folder.name if split is None else f"{folder.name}/{split}"
    records = []
    for batch in rows.iter(batch_size=256):
        captions = (
            batch[caption_column] if caption_column is not None else [""] * len(batch[image_column])
        )
        for image, caption in zip(batch[image_column], captions, strict=True):
            index = len(records)
            if caption is not None and not isinstance(caption, str):
                raise ValueError(f"data: {where} index {index}: the caption is not a string")
            image_file = _hf_image_file(image)
            if image_file is None:
                raise ValueError(f"data: {where} index {index}: no image")
            records.append(
                ImageRecord(
                    image_path=f"{prefix}/{index}",
                    caption=(caption or "").strip(),
                    blob=HFRowBlob(resolved, split, index, image_column),
                    size=_image_size(image_file),
                )
            )
    if not records:
        raise ValueError(f"data: {where} has no rows")
    return records
