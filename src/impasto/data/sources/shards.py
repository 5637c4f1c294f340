"""Webdataset tar shards: shard URLs, the per-shard index, and blobs that read byte ranges
(docs/data-sources.md).

A shard that cannot be read (missing, truncated, garbage, refused) is left out and reported
while the other shards train; a sample whose caption member cannot be read, or that has no
image, is left out and reported while its shard's other samples train (issue #16)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO, Any

import fsspec
from braceexpand import braceexpand

from impasto.data.folder import ImageRecord, Scan
from impasto.data.skips import UnreadableSource, error_reason
from impasto.data.sources._common import _image_size

logger = logging.getLogger(__name__)

SHARD_IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
"""Member suffixes read as a sample's image, in order of preference (any letter case)."""
SHARD_VIDEO_SUFFIXES = ("mp4", "webm", "mov", "m4v", "mkv", "gif")
"""Member suffixes read as a sample's video in a video run (``data.video``), before the image
suffixes (a sample with a video and a thumbnail trains on the video)."""
SHARD_CLIP_SUFFIXES = SHARD_VIDEO_SUFFIXES + SHARD_IMAGE_SUFFIXES
"""What a video run reads from a shard: a video, else an image (a one-frame sample)."""
SHARD_CAPTION_SUFFIXES = ("txt", "caption", "json")
"""Member suffixes read as a sample's caption, in order of preference."""
INDEX_VERSION = 2  # 2: samples left out are listed (``skipped``)
# Enough for the header of nearly every JPEG (EXIF blocks are < 64 KiB); the rest of the member
# is read only when PIL cannot find the size in this prefix.
HEADER_BYTES = 64 * 1024
# Indexing is I/O bound (remote latency, pipe commands), so shards are indexed in threads.
NUM_INDEX_THREADS = 8


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
                f"shard {url}: the command exited with status {process.returncode}; "
                "run it in a shell to see why"
            )

    _write_atomic(target, write)


def _check_member_name(name: str, shard: str) -> None:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"shard {shard} member {name!r} has an absolute or '..' path; refusing the shard"
        )


def _member_image_size(member: IO[bytes]) -> tuple[int, int] | None:
    head = member.read(HEADER_BYTES)
    return _image_size(head) or _image_size(head + member.read())


class _BadSample(ValueError):
    """A sample that cannot be used; its shard's other samples can."""


def _json_caption(data: bytes) -> str:
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except json.JSONDecodeError as error:
        raise _BadSample(f"is not valid JSON ({error.msg})") from None
    if not isinstance(value, dict):
        return ""
    text = value.get("caption") or value.get("text")
    if isinstance(text, str):
        return text.strip()
    if isinstance(value.get("tags"), list):
        return ", ".join(str(tag).strip() for tag in value["tags"])
    return ""


def _sample_caption(archive: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> str:
    """A sample's caption from its ``txt``, else ``caption``, else ``json`` member, else "";
    :class:`_BadSample` naming the member when it does not decode."""
    suffix = next((suffix for suffix in SHARD_CAPTION_SUFFIXES if suffix in members), None)
    if suffix is None:
        return ""
    member = members[suffix]
    data = archive.extractfile(member).read()
    try:
        return _json_caption(data) if suffix == "json" else data.decode("utf-8-sig").strip()
    except UnicodeDecodeError as error:
        problem = f"is {error_reason(error)}; re-save it as UTF-8"
        raise _BadSample(f"caption member {member.name} {problem}") from None
    except _BadSample as error:
        raise _BadSample(f"caption member {member.name} {error}") from None


def _index_sample(
    archive: tarfile.TarFile, members: dict[str, tarfile.TarInfo], suffixes: Sequence[str]
) -> dict[str, Any]:
    """One sample's index entry: its first member of ``suffixes``, with the size from an
    image's header (a video's: None, it is probed later); :class:`_BadSample` when it has no
    such member or its caption does not decode."""
    suffix = next((s for s in suffixes if s in members), None)
    if suffix is None:
        found = ", ".join(sorted(members))
        raise _BadSample(f"no {_media(suffixes)} member ({'/'.join(suffixes)}); it has {found}")
    image = members[suffix]
    is_image = suffix in SHARD_IMAGE_SUFFIXES
    return {
        "member": image.name,
        "offset": image.offset_data,
        "size": image.size,
        "hw": _member_image_size(archive.extractfile(image)) if is_image else None,
        "caption": _sample_caption(archive, members),
    }


def _media(suffixes: Sequence[str]) -> str:
    """What ``suffixes`` read, for messages: "image", or "video or image"."""
    return "image" if tuple(suffixes) == SHARD_IMAGE_SUFFIXES else "video or image"


def _scan_tar(
    handle: IO[bytes], shard: str, suffixes: Sequence[str] = SHARD_IMAGE_SUFFIXES
) -> dict[str, Any]:
    """Index a seekable, uncompressed tar: each sample's image member, its data offset and size,
    the image's ``(height, width)`` and the caption, and the samples left out with the reason.
    A sample is the members that share a key: the member path up to the first dot of its file
    name (the webdataset convention)."""
    samples, skipped, num_without_image = [], [], 0
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
            for key, members in groups.items():
                num_without_image += not any(s in members for s in suffixes)
                try:
                    samples.append(_index_sample(archive, members, suffixes))
                except _BadSample as error:
                    skipped.append([key, str(error)])
    except (tarfile.TarError, EOFError) as error:
        raise ValueError(
            f"shard {shard} is truncated or not an uncompressed tar ({error_reason(error)}); "
            "re-download or re-create it"
        ) from None
    return {"samples": samples, "skipped": skipped, "num_without_image": num_without_image}


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


def _build_index(url: str, digest: str, index_dir: Path, suffixes: Sequence[str]) -> dict[str, Any]:
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
                return {"reader": "fsspec", "source": url, **_scan_tar(remote, name, suffixes)}
            _write_atomic(copy, partial(shutil.copyfileobj, remote))
        local = copy
    with open(local, "rb") as handle:
        return {
            "reader": "file",
            "source": str(local.resolve()),
            **_scan_tar(handle, name, suffixes),
        }


def shard_index(
    url: str, index_dir: Path, suffixes: Sequence[str] = SHARD_IMAGE_SUFFIXES
) -> dict[str, Any]:
    """The index of one shard, read from ``index_dir`` or built and stored there; a sample's
    media is its first member of ``suffixes`` (a video run's index, with
    :data:`SHARD_CLIP_SUFFIXES`, is a file of its own).

    The index file is named by a hash of the URL, plus the size and modification time of a
    local file, so a changed local shard is indexed again. A ``pipe:`` or remote shard is
    identified by its URL only: after changing one, delete its index (or ``index_dir``).
    """
    local = _local_path(url)
    key = url
    if local is not None:
        if not local.is_file():
            raise ValueError(f"shard {url} does not exist; check the shard URLs (data.path)")
        stat = local.stat()
        key = f"{local.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    if tuple(suffixes) != SHARD_IMAGE_SUFFIXES:
        key += "\0" + ",".join(suffixes)
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    index_path = Path(index_dir) / f"{digest}.json"
    index = _load_index(index_path, url)
    if index is None:
        index = {
            "version": INDEX_VERSION,
            "url": url,
            **_build_index(url, digest, index_dir, suffixes),
        }
        _write_atomic(index_path, lambda handle: handle.write(json.dumps(index).encode()))
    return index


def webdataset_records(urls: str | Sequence[str], index_dir: Path) -> list[ImageRecord]:
    """:func:`webdataset_scan`'s records; each shard or sample left out is logged."""
    return webdataset_scan(urls, index_dir).logged_records()


def _index_or_reason(url: str, index_dir: Path, suffixes: Sequence[str]) -> dict[str, Any] | str:
    """The shard's index, or why it cannot be read (one shard never stops the others)."""
    try:
        return shard_index(url, index_dir, suffixes)
    except (ValueError, OSError) as error:
        if isinstance(error, ValueError) and not isinstance(error, UnicodeDecodeError):
            return str(error).removeprefix("data: ")
        return f"shard {url} cannot be read ({error_reason(error)})"


def webdataset_scan(
    urls: str | Sequence[str], index_dir: Path, suffixes: Sequence[str] = SHARD_IMAGE_SUFFIXES
) -> Scan:
    """The samples of webdataset tar shards, in shard order then member order.

    Args:
        urls: a URL with brace patterns (``data/shard-{000000..000009}.tar``) or a list of
            them. A URL is a local path, ``file:PATH``, ``pipe:COMMAND`` (the command's stdout)
            or an fsspec URL (``s3://``, ``gs://``, ``https://``, ``memory://`` ...).
        index_dir: where each shard's index (and the copy of a ``pipe:`` shard) is kept.
        suffixes: the member suffixes read as a sample's media, in order of preference
            (:data:`SHARD_CLIP_SUFFIXES` in a video run: then a video's ``size`` is None).

    Returns:
        One :class:`ImageRecord` per sample with an image, named ``<shard>/<member>``, with
        its ``(height, width)`` when the header is readable. Left out, each with the reason:
        a shard that is missing, truncated, compressed, has a member with an absolute or
        ``..`` path, or whose ``pipe:`` command fails (named by its URL); a sample without an
        image, or whose caption member does not decode (named ``<shard>/<key>``).

    Raises:
        UnreadableSource: no shard could be read (the first reason is given), or no images.
    """
    expanded = expand_urls(urls)
    index_dir = Path(index_dir)
    with ThreadPoolExecutor(max_workers=min(NUM_INDEX_THREADS, len(expanded))) as pool:
        indexes = list(
            pool.map(partial(_index_or_reason, index_dir=index_dir, suffixes=suffixes), expanded)
        )
    scan = Scan()
    for url, index in zip(expanded, indexes, strict=True):
        if isinstance(index, str):
            scan.skip(url, index)
            continue
        name = _shard_name(url)
        if index["num_without_image"]:
            logger.warning(
                "data: shard %s: skipped %d samples without a %s member",
                url,
                index["num_without_image"],
                "/".join(suffixes),
            )
        for key, reason in index["skipped"]:
            scan.skip(f"{name}/{key}", reason)
        make_blob = RANGE_BLOBS[index["reader"]]
        for sample in index["samples"]:
            scan.records.append(
                ImageRecord(
                    image_path=f"{name}/{sample['member']}",
                    caption=sample["caption"],
                    blob=make_blob(index["source"], sample["offset"], sample["size"]),
                    size=tuple(sample["hw"]) if sample["hw"] else None,
                )
            )
    if not scan.records:
        where = f"the {len(expanded)} shards from {expanded[0]}"
        first = f"; {scan.skipped[0].reason}" if scan.skipped else ""
        raise UnreadableSource(
            where, f"no readable {_media(suffixes).replace('video', 'videos')}s{first}"
        )
    return scan
