"""The probe index: what decoding found in each clip, kept between runs.

Counting a clip's frames means decoding all of it (:func:`~impasto.data.video.probe.probe_clip`),
which for a folder of long videos takes longer than a short training run. Each source keeps its
probes in one JSON file under ``data.index_dir`` (``~/.cache/impasto/shards`` by default, where
the webdataset shard indexes live), keyed by each clip's path and checked against what the file
system says of it now: a video's size and modification time, a frame folder's listing (names,
sizes and times of its files). A clip that changed is probed again; one that does not decode
is never stored (it is probed, and reported, every time). The file is replaced atomically, so
ranks and runs that share it never read half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from impasto.data.skips import Skipped
from impasto.data.video.probe import ClipInfo
from impasto.data.video.scan import ClipRecord, probe_clips

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
    """The probe index of the source at ``source`` (its absolute path names it)."""
    digest = hashlib.sha256(str(Path(source).resolve()).encode()).hexdigest()[:16]
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


def probe_indexed(
    records: Sequence[ClipRecord], file: Path | None
) -> tuple[list[tuple[ClipRecord, ClipInfo]], list[Skipped]]:
    """:func:`~impasto.data.video.scan.probe_clips` that reuses the probes stored in ``file``
    for clips that did not change, and stores the new ones (``file`` None: no index)."""
    if file is None:
        return probe_clips(records)
    stored = _read(file)
    known: dict[str, ClipInfo] = {}
    fresh: list[ClipRecord] = []
    identities: dict[str, str | None] = {}
    for record in records:
        name = str(record.path)
        if record.blob is not None or name in identities:
            fresh.append(record)
            continue
        identities[name] = identity = clip_identity(Path(record.path))
        entry = stored.get(name)
        info = _info(entry) if entry and entry.get("identity") == identity else None
        if info is not None and identity is not None:
            known[name] = info
        else:
            fresh.append(record)
    probed, skipped = probe_clips([record for record in fresh if str(record.path) not in known])
    infos = {**known, **{str(record.path): info for record, info in probed}}
    if len(infos) > len(known):
        clips = {name: _entry(identities[name], info) for name, info in infos.items()
                 if identities.get(name) is not None}  # fmt: skip
        _write(file, clips)
    bad = {item.name for item in skipped}
    kept = [(record, infos[str(record.path)]) for record in records
            if str(record.path) not in bad and str(record.path) in infos]  # fmt: skip
    return kept, skipped
