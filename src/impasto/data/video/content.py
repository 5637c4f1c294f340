"""What a clip's cached latents are keyed by (:mod:`impasto.data.video.clip_cache`): the
content of its frames, and what says that content is unchanged since it was hashed.

- A video (a file or a blob): the sha256 of its bytes, read a megabyte at a time.
- A frame folder: the sha256 over its frames in order (each frame's name and the sha256 of
  its bytes), so a frame added, removed, renamed or rewritten gives a new id; ``fps.txt`` is
  left out (it moves no frame: a sample's frame indices are part of its key).

The content id is memoised by :func:`clip_stat_identity` (the probe index's
:func:`~impasto.data.video.index.clip_identity`: a file's size and time, a folder's listing),
so a start after the first hashes only the clips that changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from impasto.data.folder import ImageRecord
from impasto.data.video.frames import frame_folder_images
from impasto.data.video.index import clip_identity

READ_BYTES = 1 << 20


def clip_stat_identity(record: ImageRecord) -> str:
    """What must not change for a clip record's memoised content id to hold (a blob's own
    identity is the caller's); ``OSError`` when the clip cannot be read."""
    path = Path(record.image_path)
    identity = clip_identity(path)
    if identity is None:
        raise FileNotFoundError(f"{path} cannot be read")
    return f"clip|{path.resolve()}|{identity}"


def clip_sha256(record: ImageRecord) -> str:
    """The content hash of a clip record's frames (module docstring); ``OSError`` when a file
    cannot be read."""
    if record.blob is not None:
        return hashlib.sha256(record.blob.read()).hexdigest()
    path = Path(record.image_path)
    if not path.is_dir():
        return _file_sha256(path)
    digest = hashlib.sha256()
    for frame in frame_folder_images(path):
        digest.update(f"{frame.name}|{_file_sha256(frame)}|".encode())
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(READ_BYTES):
            digest.update(block)
    return digest.hexdigest()
