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


def _image_size(image_file: bytes | str) -> tuple[int, int] | None:
    """``(height, width)`` from the header of encoded image bytes or an image file (pixels are
    not decoded); None when unreadable: the loader reports bad images when it reads them."""
    try:
        with Image.open(
            io.BytesIO(image_file) if isinstance(image_file, bytes) else image_file
        ) as image:
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


RANGE_BLOBS: dict[str, type[FileRangeBlob | FsspecRangeBlob]] = {
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
        try:
            url = shlex.split(url.removeprefix("pipe:"))[-1]
        except (ValueError, IndexError):  # unbalanced quotes, or no command
            pass
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
        with subprocess.Popen(command, shell=True, stdout=subprocess.PIPE) as process:
            shutil.copyfileobj(process.stdout, handle)
        if process.returncode != 0:
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


def _sample_caption(
    archive: tarfile.TarFile, members: dict[str, tarfile.TarInfo], shard: str
) -> str:
    """A sample's caption from its ``txt``, else ``caption``, else ``json`` member, else ""."""
    suffix = next((suffix for suffix in SHARD_CAPTION_SUFFIXES if suffix in members), None)
    if suffix is None:
        return ""
    where = f"shard {shard} member {members[suffix].name}"
    data = archive.extractfile(members[suffix]).read()
    if suffix == "json":
        return _json_caption(data, where)
    try:
        return data.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        raise ValueError(f"data: {where} is not valid UTF-8; re-save it as UTF-8") from None


def _scan_tar(handle: IO[bytes], shard: str) -> dict[str, Any]:
    """Index a seekable, uncompressed tar: each sample's image member, its data offset and size,
    the image's ``(height, width)`` and the caption. A sample is the members that share a key:
    the member path up to the first dot of its file name (the webdataset convention)."""
    samples = []
    try:
        with tarfile.open(fileobj=handle, mode="r:") as archive:
            groups: dict[str, dict[str, tarfile.TarInfo]] = {}
            for member in archive:
                _check_member_name(member.name, shard)
                folder, _, file_name = member.name.rpartition("/")
                stem, dot, suffix = file_name.partition(".")
                if member.isfile() and dot:
                    key = f"{folder}/{stem}" if folder else stem
                    groups.setdefault(key, {}).setdefault(suffix.lower(), member)
            # A whole archive ends with zero blocks; anything else after the last member is a
            # truncated header or garbage, where tarfile silently stops.
            handle.seek(archive.offset)
            if handle.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
                raise tarfile.ReadError(f"no end-of-archive marker after byte {archive.offset}")
            for members in groups.values():
                suffix = next((s for s in SHARD_IMAGE_SUFFIXES if s in members), None)
                if suffix is None:
                    continue
                image = members[suffix]
                samples.append(
                    {
                        "member": image.name,
                        "offset": image.offset_data,
                        "size": image.size,
                        "hw": _member_image_size(archive.extractfile(image)),
                        "caption": _sample_caption(archive, members, shard),
                    }
                )
    except tarfile.TarError as error:
        raise ValueError(
            f"data: shard {shard} is truncated or not an uncompressed tar ({error}); "
            "re-download or re-create it"
        ) from None
    return {"samples": samples, "num_without_image": len(groups) - len(samples)}


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
                url,
                index["num_without_image"],
                "/".join(SHARD_IMAGE_SUFFIXES),
            )
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
        raise ValueError(f"data: no images in the {len(expanded)} shards from {expanded[0]}")
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
