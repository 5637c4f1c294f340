"""Parquet manifests: one row per image, given as a path or as the image bytes
(docs/data-sources.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from impasto.data.folder import ImageRecord, Scan, row_weight
from impasto.data.skips import UnreadableSource, error_reason
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


def _fields(media: Sequence[str]) -> str:
    """``media`` for messages: "'image'", or "'video' or 'image'"."""
    return " or ".join(f"'{column}'" for column in media)


def _parquet_record(
    path: Path, row: dict[str, Any], number: int, blob: ParquetRowBlob,
    media: Sequence[str] = ("image",),
) -> ImageRecord:  # fmt: skip
    """The record of row ``number``: its first non-empty column of ``media`` (a path or
    bytes; ``blob`` is pointed at that column); ``ValueError`` (the reason) when the row is
    unusable."""
    image, column = None, media[0]
    for column in media:
        image = row.get(column)
        if isinstance(image, dict):  # a Hugging Face Image struct {"bytes": ..., "path": ...}
            image = image.get("bytes") or image.get("path")
        if image:
            break
    if not image:
        raise ValueError(f"no {_fields(media)} field")
    caption = str(row.get("caption") or "").strip()
    weight = row_weight(row.get("weight"))
    if isinstance(image, bytes):
        name = f"{path.name}/row-{number}"
        size = _image_size(image) if column == "image" else None  # a video's: probed later
        return ImageRecord(name, caption, weight, blob=replace(blob, column=column), size=size)
    if not isinstance(image, str):
        raise ValueError(f"'{column}' is {type(image).__name__}, not a path or bytes")
    image_path = Path(image) if Path(image).is_absolute() else path.parent / image
    return ImageRecord(image_path, caption, weight)


def parquet_records(path: Path) -> list[ImageRecord]:
    """:func:`parquet_scan`'s records; each row left out is logged as a warning."""
    return parquet_scan(path).logged_records()


def parquet_scan(path: Path, media: Sequence[str] = ("image",)) -> Scan:
    """The rows of a Parquet manifest, in row order.

    Columns: ``image`` (a path relative to the file's folder or absolute, image bytes, or a
    Hugging Face image struct ``{"bytes", "path"}``), and optionally ``caption`` and ``weight``.
    Images stored as bytes are read back one row at a time (:class:`ParquetRowBlob`), which
    reads the row's whole row group: write such files with small row groups.

    A row without an image, or with a weight that is not a number > 0, is left out and named
    (``file.parquet row N``, rows count from 1) in ``skipped`` with the reason; so are the rows
    of a row group that does not decode.

    ``media``: the columns a row's media is read from, the first non-empty one (a video run
    reads ``("video", "image")``: a ``video`` is a video file, a frame folder or a video's
    bytes, whose ``size`` is then None).

    Raises:
        ValueError: no file, no ``image`` column, or no usable rows.
        UnreadableSource: the file is not a readable Parquet file.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: parquet manifest {path} does not exist; check data.path")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        reason = f"is not a readable Parquet file ({error_reason(error)})"
        raise UnreadableSource(str(path), reason) from None
    names = parquet.schema_arrow.names
    if not any(column in names for column in media):
        raise ValueError(
            f"data: {path} has no {_fields(media)} column; its columns: {', '.join(names)}"
        )
    columns = [name for name in (*media, "caption", "weight") if name in names]
    scan, number = Scan(), 0
    for group in range(parquet.num_row_groups):
        try:
            rows = parquet.read_row_group(group, columns=columns).to_pylist()
        except (pa.ArrowException, OSError) as error:
            count = parquet.metadata.row_group(group).num_rows
            reason = f"row group {group} does not decode ({error_reason(error)})"
            scan.skip(f"{path} rows {number + 1}-{number + count}", reason)
            number += count
            continue
        for row_in_group, row in enumerate(rows):
            number += 1
            blob = ParquetRowBlob(str(path.resolve()), group, row_in_group)
            try:
                scan.records.append(_parquet_record(path, row, number, blob, media))
            except ValueError as error:
                scan.skip(f"{path} row {number}", str(error))
    if not scan.records:
        reason = f" ({scan.skipped[0].name}: {scan.skipped[0].reason})" if scan.skipped else ""
        raise ValueError(f"data: parquet manifest {path} has no usable rows{reason}")
    _warn_large_row_groups(path, parquet, scan.records)
    return scan


def _warn_large_row_groups(path: Path, parquet: pq.ParquetFile, records: list[ImageRecord]) -> None:
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
