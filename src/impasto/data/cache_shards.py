"""The cache's shard files: writing them atomically with a checksum per entry, finding which
entry lives where, reading entries back and checking them (:mod:`impasto.data.cache`).

Each shard is a safetensors file whose header metadata holds the shard format
(:data:`SHARD_FORMAT`) and the crc32 of every entry's bytes. Checks happen at two moments:

- **filling** (every ``impasto cache`` and every run's start): each shard not known good is
  read whole and every entry checked. A shard is known good by a ``<shard>.verified`` file
  holding its size and modification time when it was last found (or written) whole; a shard
  overwritten in place gets a new modification time, so it is checked again. A damaged shard is
  renamed ``*.corrupt`` with one printed line, and its entries, now missing, are encoded again
  by that same fill, so training never sees them.
- **reading** (training): every entry is checked as it is read. A mismatch (bit rot under an
  unchanged modification time) skips that example like an unreadable image, reported with the
  reason (a text embedding is encoded on the fly instead, and reported as re-encoded), and
  deletes the shard's ``.verified`` file so that the next fill checks the shard, sets it aside
  and encodes its entries again. The shard is not moved during the run: every loader worker
  then reads the same entries, whatever their number.

Shards written before checksums (no format in their metadata) are still read, unchecked; the
fill says how many there are (delete them, or the cache, to encode them again with checksums).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from impasto.faults import fault_point
from impasto.permissions import apply_umask

logger = logging.getLogger(__name__)

SHARD_FORMAT = "2"
"""``impasto_shard_format`` of the shards written now; 2: a crc32 per entry. (Format 1 had no
metadata.)"""
FORMAT_KEY, CHECKSUMS_KEY = "impasto_shard_format", "impasto_crc32"
SHARD_ERRORS = (SafetensorError, OSError)


class DamagedEntry(OSError):
    """A cache entry whose bytes do not match the checksum stored when it was written."""


def checksum(tensor: Tensor) -> int:
    """crc32 of a tensor's bytes (as safetensors stores them: contiguous, native order)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data)


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp_path)``, flush to disk, then rename to ``path`` (a reader sees all or none)."""
    tmp = path.with_name(f".tmp-{path.name}.partial")  # matches no reader's pattern
    write(tmp)
    apply_umask(tmp)  # the cache is shared by runs and users: safetensors writes 0600
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    fault_point("cache.shard")
    os.replace(tmp, path)


def stamped_name(prefix: str, rank: int, suffix: str) -> str:
    return f"{prefix}-{time.strftime('%Y%m%d%H%M%S')}-r{rank}-{uuid.uuid4().hex[:8]}{suffix}"


def _verified_path(shard: Path) -> Path:
    return shard.with_suffix(".verified")


def _stat_text(shard: Path) -> str:
    stat = shard.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def mark_verified(shard: Path) -> None:
    """Remember that ``shard``, as it is now on disk, is whole (not on a read-only cache: it
    is then checked at every fill)."""
    try:
        _verified_path(shard).write_text(_stat_text(shard))
    except OSError:
        pass


def is_verified(shard: Path) -> bool:
    """Whether ``shard`` was found whole and has not changed since."""
    try:
        return _verified_path(shard).read_text() == _stat_text(shard)
    except OSError:
        return False


def forget_verified(shard: Path) -> None:
    """Make the next fill check ``shard`` again."""
    try:
        _verified_path(shard).unlink(missing_ok=True)
    except OSError:
        pass  # a read-only cache: every fill checks every shard anyway


def _stored_checksums(handle) -> dict[str, int] | None:
    """The entries' crc32 from a shard's metadata; None for a shard written without them."""
    metadata = handle.metadata() or {}
    if metadata.get(FORMAT_KEY) != SHARD_FORMAT:
        return None
    return json.loads(metadata[CHECKSUMS_KEY])


def shard_damage(shard: Path) -> str | None:
    """Why ``shard`` is damaged (a header that does not parse, entries that fail their
    checksum), or None when it is whole or has no checksums to check."""
    try:
        with safe_open(str(shard), "pt") as handle:
            sums = _stored_checksums(handle)
            if sums is None:
                return None
            bad = [
                name for name in handle.keys() if checksum(handle.get_tensor(name)) != sums[name]
            ]
    except (*SHARD_ERRORS, KeyError, ValueError) as error:
        return f"it does not read ({' '.join(str(error).split()) or type(error).__name__})"
    if bad:
        return f"{len(bad)} of its entries fail their checksum (first: {bad[0]})"
    return None


def set_aside(shard: Path, reason: str) -> None:
    """Rename a damaged shard ``*.corrupt`` (its entries then count as missing) and say so."""
    print(f"impasto: cache shard {shard.name} is damaged ({reason}); set aside as "
          f"{shard.with_suffix('.corrupt').name}, its entries will be encoded again")  # fmt: skip
    forget_verified(shard)
    try:
        os.replace(shard, shard.with_suffix(".corrupt"))
    except OSError:
        pass  # another rank moved it first


def verify_shards(root: Path, rank: int = 0, world: int = 1) -> list[str]:
    """Check every shard not known good (this rank: every ``world``-th of them); set the damaged
    ones aside. Returns their names."""
    folder = Path(root) / "shards"
    unknown = [
        path
        for path in sorted(folder.glob("*.safetensors"))
        if not path.name.startswith(".") and not is_verified(path)
    ]
    damaged = []
    for shard in unknown[rank::world]:
        reason = shard_damage(shard)
        if reason is None:
            mark_verified(shard)
        else:
            set_aside(shard, reason)
            damaged.append(shard.name)
    return damaged


class ShardStore:
    """The cache's shards: which tensor lives in which file, and reading tensors lazily, each
    checked against its stored checksum.

    Opened handles are per process and never pickled, so a store can go to loader workers.
    """

    def __init__(self, root: Path) -> None:
        self.folder = Path(root) / "shards"
        self.shards: list[Path] = []
        self.where: dict[str, int] = {}
        self.corrupt: list[Path] = []
        self.unchecked: list[Path] = []  # written without checksums
        self._handles: dict[int, tuple[object, dict[str, int] | None]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Index every complete shard (new ones included); set aside those that do not open."""
        known = set(self.shards)
        for path in sorted(self.folder.glob("*.safetensors")):
            if path in known or path.name.startswith("."):
                continue
            try:
                with safe_open(str(path), "pt") as handle:
                    names = list(handle.keys())
                    unchecked = (handle.metadata() or {}).get(FORMAT_KEY) != SHARD_FORMAT
            except SHARD_ERRORS as error:
                set_aside(path, " ".join(str(error).split()) or type(error).__name__)
                self.corrupt.append(path)
                continue
            number = len(self.shards)
            self.shards.append(path)
            if unchecked:
                self.unchecked.append(path)
            for name in names:
                self.where[name] = number

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> Tensor:
        """The stored tensor ``name``: KeyError if absent, :class:`DamagedEntry` if its bytes
        fail their checksum, one of :data:`SHARD_ERRORS` if its shard does not read (the shard
        is then checked by the next fill)."""
        number = self.where[name]
        shard = self.shards[number]
        try:
            if number not in self._handles:
                handle = safe_open(str(shard), "pt")
                self._handles[number] = (handle, _stored_checksums(handle))
            handle, sums = self._handles[number]
            tensor = handle.get_tensor(name)
        except SHARD_ERRORS:
            forget_verified(shard)
            raise
        if sums is not None and checksum(tensor) != sums.get(name):
            forget_verified(shard)
            raise DamagedEntry(f"cache entry {name} in shard {shard.name} fails its checksum")
        return tensor

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": {}}


class ShardWriter:
    """Collects tensors and writes them as immutable shards of about ``max_bytes``, each with
    its entries' checksums, known good from the start."""

    def __init__(self, root: Path, kind: str, rank: int, max_bytes: int) -> None:
        self.folder = Path(root) / "shards"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.kind, self.rank, self.max_bytes = kind, rank, max_bytes
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.written: list[Path] = []
        for stale in self.folder.glob(f".tmp-{kind}-*-r{rank}-*.partial"):
            stale.unlink(missing_ok=True)  # this rank's leftovers from a crash

    def add(self, tensors: dict[str, Tensor]) -> None:
        for name, tensor in tensors.items():
            self.pending[name] = tensor.detach().cpu().contiguous()
            self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.folder / stamped_name(self.kind, self.rank, ".safetensors")
        pending = self.pending
        sums = {name: checksum(tensor) for name, tensor in pending.items()}
        metadata = {FORMAT_KEY: SHARD_FORMAT, CHECKSUMS_KEY: json.dumps(sums)}
        write_atomically(path, lambda tmp: save_file(pending, str(tmp), metadata=metadata))
        mark_verified(path)
        self.written.append(path)
        self.pending, self.pending_bytes = {}, 0
