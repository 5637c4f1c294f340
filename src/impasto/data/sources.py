"""Image sources that are not a folder of files: webdataset tar shards, Parquet manifests and
local Hugging Face datasets (docs/data-sources.md).

Each source returns ``list[ImageRecord]`` in a fixed order. Images that are not plain files get
a small frozen ``blob`` that reads their bytes on demand: training shuffles, so every image is
read by its own position (a byte range, a Parquet row, a dataset index), never by streaming.
Blobs are picklable and open their files lazily, once per process, in the loader's workers.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from braceexpand import braceexpand
from PIL import Image

from impasto.data.folder import ImageRecord
from impasto.data.transforms import IMAGE_LOAD_ERRORS

logger = logging.getLogger(__name__)

SHARD_IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
"""Member suffixes read as a sample's image, in order of preference (any letter case)."""
SHARD_CAPTION_SUFFIXES = ("txt", "caption", "json")
"""Member suffixes read as a sample's caption, in order of preference."""
INDEX_VERSION = 1
# Enough for the header of nearly every JPEG (EXIF blocks are < 64 KiB); the rest of the member
# is read only when PIL cannot find the size in this prefix.
HEADER_BYTES = 64 * 1024
# Indexing is I/O bound (remote latency, pipe commands), so shards are indexed in threads.
NUM_INDEX_THREADS = 8
# Reading one image reads its whole Parquet row group: warn when that is this large.
LARGE_ROW_GROUP_BYTES = 64 * 1024 * 1024


def _image_size(data: bytes) -> tuple[int, int] | None:
    """``(height, width)`` from the image header (pixels are not decoded); None if unreadable."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except IMAGE_LOAD_ERRORS:
        return None
    return height, width


@dataclass(frozen=True)
class FileRangeBlob:
    """``size`` bytes at ``offset`` of a local file (a tar member)."""

    path: str
    offset: int
    size: int

    def read(self) -> bytes:
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read(self.size)
        if len(data) != self.size:
            raise OSError(f"{self.path} is shorter than when it was indexed; delete its index")
        return data


@dataclass(frozen=True)
class FsspecRangeBlob:
    """``size`` bytes at ``offset`` of an fsspec URL, fetched with one range request."""

    url: str
    offset: int
    size: int

    def read(self) -> bytes:
        filesystem, path = fsspec.core.url_to_fs(self.url)
        return filesystem.cat_file(path, start=self.offset, end=self.offset + self.size)


RANGE_BLOBS: dict[str, Callable[[str, int, int], FileRangeBlob | FsspecRangeBlob]] = {
    "file": FileRangeBlob,
    "fsspec": FsspecRangeBlob,
}
"""How an index's ``reader`` reads its ``source``: a local file or an fsspec URL."""


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """Shard URLs with brace patterns expanded (``shard-{000..009}.tar``), in the given order."""
    patterns = [urls] if isinstance(urls, str) else list(urls)
    expanded = [url for pattern in patterns for url in braceexpand(pattern)]
    if not expanded:
        raise ValueError("data: no shard URLs given; set data.urls")
    return expanded


def _local_path(url: str) -> Path | None:
    """The file of a plain or ``file:`` URL; None for ``pipe:`` and other fsspec URLs."""
    for prefix in ("file://", "file:"):
        if url.startswith(prefix):
            return Path(url.removeprefix(prefix))
    return None if url.startswith("pipe:") or "://" in url else Path(url)


def _shard_name(url: str) -> str:
    """The shard's file name for messages: ``pipe:curl -s https://x/a.tar`` gives ``a.tar``."""
    if url.startswith("pipe:"):
        words = shlex.split(url.removeprefix("pipe:")) or [url]
        url = words[-1]
    return url.rstrip("/").rsplit("/", 1)[-1]


def _write_atomic(target: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``target`` through a temporary file in its folder, then rename it into place, so
    readers (other ranks, a later run) never see a half-written file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False)
    try:
        with handle:
            write(handle)
        os.replace(handle.name, target)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def _copy_pipe(url: str, target: Path) -> None:
    """Run the ``pipe:`` command and store its stdout at ``target``."""
    command = url.removeprefix("pipe:")

    def write(handle: IO[bytes]) -> None:
        process = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE)
        with process.stdout:
            shutil.copyfileobj(process.stdout, handle)
        if process.wait() != 0:
            raise ValueError(
                f"data: shard {url}: the command exited with status {process.returncode}; "
                "run it in a shell to see why"
            )

    _write_atomic(target, write)


def _check_member_name(name: str, shard: str) -> None:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"data: shard {shard} member {name!r} has an absolute or '..' path; refusing the shard"
        )


def _member_image_size(member: IO[bytes]) -> tuple[int, int] | None:
    head = member.read(HEADER_BYTES)
    return _image_size(head) or _image_size(head + member.read())


def _json_caption(data: bytes, where: str) -> str:
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"data: {where} is not valid UTF-8 JSON; fix or drop it") from None
    if not isinstance(value, dict):
        return ""
    text = value.get("caption") or value.get("text")
    if isinstance(text, str):
        return text.strip()
    if isinstance(value.get("tags"), list):
        return ", ".join(str(tag).strip() for tag in value["tags"])
    return ""


def _sample_caption(captions: dict[str, tuple[str, bytes]], shard: str) -> str:
    """A sample's caption from its ``txt``, else ``caption``, else ``json`` member, else ""."""
    for suffix in SHARD_CAPTION_SUFFIXES:
        if suffix not in captions:
            continue
        member, data = captions[suffix]
        where = f"shard {shard} member {member}"
        if suffix == "json":
            return _json_caption(data, where)
        try:
            return data.decode("utf-8-sig").strip()
        except UnicodeDecodeError:
            raise ValueError(f"data: {where} is not valid UTF-8; re-save it as UTF-8") from None
    return ""


def _scan_tar(handle: IO[bytes], shard: str) -> dict[str, Any]:
    """Index a seekable, uncompressed tar: each sample's image member, its data offset and size,
    the image's ``(height, width)`` and the caption. Samples are keyed by the member path up to
    the first dot of its file name (the webdataset convention)."""
    images: dict[str, dict[str, Any]] = {}
    captions: dict[str, dict[str, tuple[str, bytes]]] = {}
    try:
        with tarfile.open(fileobj=handle, mode="r:") as archive:
            for member in archive:
                _check_member_name(member.name, shard)
                folder, _, file_name = member.name.rpartition("/")
                stem, dot, suffix = file_name.partition(".")
                suffix = suffix.lower()
                if not member.isfile() or not dot:
                    continue
                key = f"{folder}/{stem}" if folder else stem
                captions.setdefault(key, {})
                if suffix in SHARD_CAPTION_SUFFIXES:
                    captions[key][suffix] = (member.name, archive.extractfile(member).read())
                elif suffix in SHARD_IMAGE_SUFFIXES:
                    rank = SHARD_IMAGE_SUFFIXES.index(suffix)
                    if key not in images or rank < images[key]["rank"]:
                        size = _member_image_size(archive.extractfile(member))
                        images[key] = {"member": member.name, "offset": member.offset_data,
                                       "size": member.size, "hw": size, "rank": rank}  # fmt: skip
            # A whole archive ends with zero blocks; anything else after the last member is a
            # truncated header or garbage that tarfile would silently stop at.
            handle.seek(archive.offset)
            if handle.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
                raise tarfile.ReadError(f"no end-of-archive marker after byte {archive.offset}")
    except tarfile.TarError as error:
        raise ValueError(
            f"data: shard {shard} is truncated or not an uncompressed tar ({error}); "
            "re-download or re-create it"
        ) from None
    samples = [
        {**{k: v for k, v in image.items() if k != "rank"}, "caption": _sample_caption(captions[key], shard)}
        for key, image in images.items()
    ]
    return {"samples": samples, "num_without_image": len(captions) - len(images)}


def _load_index(index_path: Path, url: str) -> dict[str, Any] | None:
    """The stored index of ``url``, or None when there is none usable (or its copy is gone)."""
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if index.get("version") != INDEX_VERSION or index.get("url") != url:
        return None
    if index["reader"] == "file" and not Path(index["source"]).is_file():
        return None
    return index


def _build_index(url: str, digest: str, index_dir: Path) -> dict[str, Any]:
    """Scan the shard; ``pipe:`` and unseekable remote shards are first copied to
    ``index_dir/shards/<digest>.tar``, since their images must later be read by offset."""
    name = _shard_name(url)
    local = _local_path(url)
    copy = index_dir / "shards" / f"{digest}.tar"
    if local is None and url.startswith("pipe:"):
        _copy_pipe(url, copy)
        local = copy
    elif local is None:
        with fsspec.open(url, "rb") as remote:
            if remote.seekable():
                return {"reader": "fsspec", "source": url, **_scan_tar(remote, name)}
            _write_atomic(copy, partial(shutil.copyfileobj, remote))
        local = copy
    with open(local, "rb") as handle:
        return {"reader": "file", "source": str(local.resolve()), **_scan_tar(handle, name)}


def shard_index(url: str, index_dir: Path) -> dict[str, Any]:
    """The index of one shard, read from ``index_dir`` or built and stored there.

    The index file is named by a hash of the URL, plus the size and modification time of a
    local file, so a changed local shard is indexed again. A ``pipe:`` or remote shard is
    identified by its URL only: after changing one, delete its index (or ``index_dir``).
    """
    local = _local_path(url)
    key = url
    if local is not None:
        if not local.is_file():
            raise ValueError(f"data: shard {url} does not exist; check data.urls")
        stat = local.stat()
        key = f"{local.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    index_path = Path(index_dir) / f"{digest}.json"
    index = _load_index(index_path, url)
    if index is None:
        index = {"version": INDEX_VERSION, "url": url, **_build_index(url, digest, index_dir)}
        _write_atomic(index_path, lambda handle: handle.write(json.dumps(index).encode()))
    return index


def webdataset_records(urls: str | Sequence[str], index_dir: Path) -> list[ImageRecord]:
    """The samples of webdataset tar shards, in shard order then member order.

    Args:
        urls: a URL with brace patterns (``data/shard-{000000..000009}.tar``) or a list of
            them. A URL is a local path, ``file:PATH``, ``pipe:COMMAND`` (the command's stdout)
            or an fsspec URL (``s3://``, ``gs://``, ``https://``, ``memory://`` ...).
        index_dir: where each shard's index (and the copy of a ``pipe:`` shard) is kept.

    Returns:
        One :class:`ImageRecord` per sample with an image, named ``<shard>/<member>``, with
        its ``(height, width)`` when the header is readable.

    Raises:
        ValueError: a missing, truncated or compressed shard, a member with an absolute or
            ``..`` path, a bad caption member, a failing ``pipe:`` command, or no images.
    """
    expanded = expand_urls(urls)
    index_dir = Path(index_dir)
    with ThreadPoolExecutor(max_workers=min(NUM_INDEX_THREADS, len(expanded))) as pool:
        indexes = list(pool.map(partial(shard_index, index_dir=index_dir), expanded))
    records = []
    for url, index in zip(expanded, indexes, strict=True):
        name = _shard_name(url)
        if index["num_without_image"]:
            logger.warning(
                "data: shard %s: skipped %d samples without a %s member",
                url, index["num_without_image"], "/".join(SHARD_IMAGE_SUFFIXES),
            )  # fmt: skip
        make_blob = RANGE_BLOBS[index["reader"]]
        for sample in index["samples"]:
            records.append(
                ImageRecord(
                    image_path=f"{name}/{sample['member']}",
                    caption=sample["caption"],
                    blob=make_blob(index["source"], sample["offset"], sample["size"]),
                    size=tuple(sample["hw"]) if sample["hw"] else None,
                )
            )
    if not records:
        raise ValueError(f"data: no images in the {len(expanded)} shards of {urls}")
    return records


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


def _parquet_record(path: Path, row: dict[str, Any], number: int, blob: ParquetRowBlob):
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
    largest = max(parquet.metadata.row_group(g).total_byte_size for g in range(parquet.num_row_groups))
    if any(record.blob for record in records) and largest > LARGE_ROW_GROUP_BYTES:
        logger.warning(
            "data: %s has row groups of up to %d MiB, read whole for each image; rewrite it "
            "with smaller row groups (pyarrow.parquet.write_table(..., row_group_size=64))",
            path, largest >> 20,
        )  # fmt: skip
    return records
