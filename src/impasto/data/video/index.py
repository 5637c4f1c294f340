"""The probe index: what decoding found in each clip, kept between runs.

Counting a clip's frames means decoding all of it (:func:`~impasto.data.video.probe.probe_clip`),
which for a folder of long videos takes longer than a short training run. Each source keeps its
probes in one JSON file under ``data.index_dir`` (``~/.cache/impasto/shards`` by default, where
the webdataset shard indexes live), keyed by each clip's path and checked against what the file
system says of it now: a video's size and modification time, a frame folder's listing (names,
sizes and times of its files); a clip in a tar shard by its shard's identity and its member
(:attr:`~impasto.data.video.scan.ClipRecord.identity`). A clip that changed is probed again;
one that does not decode is never stored (it is probed, and reported, every time). The ranks
of a run split the probing (:mod:`impasto.data.video.share`) and rank 0 alone writes the file,
which is replaced atomically, so runs that share it never read half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from impasto.data.skips import SCANNED, Skipped
from impasto.data.video.probe import ClipInfo
from impasto.data.video.scan import ClipRecord
from impasto.data.video.share import probe_across_ranks, rank_in_group
from impasto.distributed import barrier

INDEX_VERSION = 1


def clip_identity(path: Path) -> str | None:
    """What must not change for a stored probe of ``path`` to hold: a file's size and
    modification time; a folder's (frame folder's) names, sizes and times; None when it
    cannot be read (it is probed, and reported, afresh)."""
    try:
        if path.is_dir():
            entries = sorted(
                (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                for entry in os.scandir(path)
            )
            return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:32]
        stat = path.stat()
    except OSError:
        return None
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def index_file(index_dir: Path, source: str | Path) -> Path:
    """The probe index of the source at ``source``: its absolute path names it, or for shard
    URLs (``s3://...``, ``pipe:...``, brace patterns of them) the URL text."""
    text = str(source)
    name = text if "://" in text or text.startswith("pipe:") else str(Path(text).resolve())
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return Path(index_dir) / f"clips-{digest}.json"


def _read(file: Path) -> dict[str, dict]:
    try:
        stored = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or damaged: probe everything again
    if not isinstance(stored, dict) or stored.get("version") != INDEX_VERSION:
        return {}
    clips = stored.get("clips")
    return clips if isinstance(clips, dict) else {}


def _info(entry: dict) -> ClipInfo | None:
    try:
        return ClipInfo(entry["name"], tuple(entry["timestamps"]), entry["height"],
                        entry["width"], entry.get("damage"))  # fmt: skip
    except (KeyError, TypeError):
        return None


def _entry(identity: str, info: ClipInfo) -> dict:
    return {"identity": identity, "name": info.name, "timestamps": list(info.timestamps),
            "height": info.height, "width": info.width, "damage": info.damage}  # fmt: skip


def _write(file: Path, clips: dict[str, dict]) -> None:
    """Replace ``file`` atomically; an index that cannot be written only costs time."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False,
                                         encoding="utf-8") as handle:  # fmt: skip
            json.dump({"version": INDEX_VERSION, "clips": clips}, handle)
        os.replace(handle.name, file)
    except OSError:
        pass


def record_identity(record: ClipRecord) -> str | None:
    """What must not change for a stored probe of ``record`` to hold: a blob's ``identity``
    (its shard's and member's, given by its source; None: probed every time), else
    :func:`clip_identity` of its path."""
    if record.blob is not None:
        return record.identity
    return clip_identity(Path(record.path))


def probe_indexed(
    records: Sequence[ClipRecord], file: Path | None
) -> tuple[list[tuple[ClipRecord, ClipInfo]], list[Skipped]]:
    """Each record with its :class:`ClipInfo`, and the clips that do not decode (named once,
    in record order, with the reason), as :func:`~impasto.data.video.scan.probe_clips` gives
    them, reusing the probes stored in ``file`` for clips that did not change (``file`` None:
    no index).

    In a process group every rank must call it with the same records: the clips to probe are
    split across the ranks and the results exchanged (:mod:`impasto.data.video.share`), and
    rank 0 alone writes ``file``.
    """
    stored = _read(file) if file is not None else {}
    known: dict[str, ClipInfo] = {}
    identities: dict[str, str | None] = {}
    for record in records:
        name = str(record.path)
        if name in identities:
            continue
        identities[name] = identity = record_identity(record)
        entry = stored.get(name)
        info = _info(entry) if identity is not None and entry else None
        if info is not None and entry.get("identity") == identity:
            known[name] = info
    fresh = [record for record in records if str(record.path) not in known]
    results = probe_across_ranks(fresh, records)
    infos = {**known, **{n: r for n, r in results.items() if isinstance(r, ClipInfo)}}
    if file is not None and rank_in_group()[0] == 0 and len(infos) > len(known):
        _write(file, {name: _entry(identities[name], info) for name, info in infos.items()
                      if identities.get(name) is not None})  # fmt: skip
    barrier()  # the other ranks' next read of the index finds what rank 0 wrote
    kept, skipped, named = [], [], set()
    for record in records:
        name = str(record.path)
        if name in infos:
            kept.append((record, infos[name]))
        elif isinstance(results.get(name), str) and name not in named:
            named.add(name)
            skipped.append(Skipped(SCANNED, name, results[name]))
    return kept, skipped
