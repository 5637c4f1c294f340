"""Parquet manifests: one row per image, given as a path or as the image bytes
(docs/data-sources.md)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from impasto.data.folder import ImageRecord
from impasto.data.sources._common import _image_size

logger = logging.getLogger(__name__)

# Reading one image reads its whole Parquet row group: warn when that is this large.
LARGE_ROW_GROUP_BYTES = 64 * 1024 * 1024


# One open ParquetFile per (process, path): loader workers are forked from the main process, so
# the key holds the pid and a worker never shares the parent's file handle.
_PARQUET_FILES: dict[tuple[int, str], pq.ParquetFile] = {}


def _parquet_file(path: str) -> pq.ParquetFile:
    key = (os.getpid(), path)
    if key not in _PARQUET_FILES:
        _PARQUET_FILES[key] = pq.ParquetFile(path)
    return _PARQUET_FILES[key]


@dataclass(frozen=True)
class ParquetRowBlob:
    """The image bytes of one Parquet row: reads its row group's ``column``, takes the row."""

    path: str
    row_group: int
    row: int
    column: str = "image"

    def read(self) -> bytes:
        table = _parquet_file(self.path).read_row_group(self.row_group, columns=[self.column])
        value = table.column(0)[self.row].as_py()
        data = value.get("bytes") if isinstance(value, dict) else value
        if not isinstance(data, bytes):
            raise OSError(f"{self.path} row group {self.row_group} row {self.row}: no bytes")
        return data


def _row_weight(raw_weight: Any, where: str) -> float:
    """A manifest row's loss weight (1 when empty); the same rules as ``read_manifest``."""
    try:
        weight = 1.0 if raw_weight in (None, "") else float(raw_weight)
    except (TypeError, ValueError):
        raise ValueError(f"data: {where}: weight {raw_weight!r} is not a number") from None
    if not weight > 0:
        raise ValueError(f"data: {where}: weight must be > 0, got {weight}")
    return weight


def _parquet_record(
    path: Path, row: dict[str, Any], number: int, blob: ParquetRowBlob
) -> ImageRecord:
    where = f"{path} row {number}"
    image = row["image"]
    if isinstance(image, dict):  # a Hugging Face Image struct {"bytes": ..., "path": ...}
        image = image.get("bytes") or image.get("path")
    if not image:
        raise ValueError(f"data: {where}: no 'image' field")
    caption = str(row.get("caption") or "").strip()
    weight = _row_weight(row.get("weight"), where)
    if isinstance(image, bytes):
        name = f"{path.name}/row-{number}"
        return ImageRecord(name, caption, weight, blob=blob, size=_image_size(image))
    if not isinstance(image, str):
        raise ValueError(f"data: {where}: 'image' is {type(image).__name__}, not a path or bytes")
    image_path = Path(image) if Path(image).is_absolute() else path.parent / image
    return ImageRecord(image_path, caption, weight)


def parquet_records(path: Path) -> list[ImageRecord]:
    """The rows of a Parquet manifest, in row order.

    Columns: ``image`` (a path relative to the file's folder or absolute, image bytes, or a
    Hugging Face image struct ``{"bytes", "path"}``), and optionally ``caption`` and ``weight``.
    Images stored as bytes are read back one row at a time (:class:`ParquetRowBlob`), which
    reads the row's whole row group: write such files with small row groups.

    Raises:
        ValueError: no file, no ``image`` column, or a row without an image or with a bad
            weight (the messages of ``read_manifest``; rows count from 1).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: parquet manifest {path} does not exist; check data.path")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"data: {path} is not a Parquet file ({error})") from None
    names = parquet.schema_arrow.names
    if "image" not in names:
        raise ValueError(f"data: {path} has no 'image' column; its columns: {', '.join(names)}")
    columns = [name for name in ("image", "caption", "weight") if name in names]
    records = []
    for group in range(parquet.num_row_groups):
        rows = parquet.read_row_group(group, columns=columns).to_pylist()
        for row_in_group, row in enumerate(rows):
            blob = ParquetRowBlob(str(path.resolve()), group, row_in_group)
            records.append(_parquet_record(path, row, len(records) + 1, blob))
    if not records:
        raise ValueError(f"data: parquet manifest {path} has no rows")
    largest = max(
        parquet.metadata.row_group(g).total_byte_size for g in range(parquet.num_row_groups)
    )
    if any(record.blob for record in records) and largest > LARGE_ROW_GROUP_BYTES:
        logger.warning(
            "data: %s has row groups of up to %d MiB, read whole for each image; rewrite it "
            "with smaller row groups (pyarrow.parquet.write_table(..., row_group_size=64))",
            path,
            largest >> 20,
        )
    return records
