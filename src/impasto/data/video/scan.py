"""Clips in a folder, with their captions, and the probe that leaves out the broken ones.

A folder holds videos (:data:`~impasto.data.video.frames.VIDEO_EXTENSIONS`), frame folders
(a folder with an ``fps.txt`` in it: its numbered images are the frames) and images (one-frame
samples), found recursively, hidden files and folders skipped. Captions follow the image rules
(:func:`~impasto.data.folder.read_caption`): ``clip.mp4`` → ``clip.txt``, else ``.caption``,
else ``.json``; a frame folder ``clip/`` → ``clip.txt`` beside it.

A clip that does not decode is left out and listed like an unreadable image: a
:class:`~impasto.data.skips.Skipped` with the reason, for ``RUN/bad-data.tsv``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from impasto.data.folder import IMAGE_EXTENSIONS, CaptionError, read_caption
from impasto.data.skips import SCANNED, Skipped
from impasto.data.video.frames import FPS_FILE, VIDEO_EXTENSIONS, ClipBlob, UnreadableClip
from impasto.data.video.probe import ClipInfo, probe_clip


@dataclass(frozen=True)
class ClipRecord:
    """One video, frame folder or image, with its caption ("" when it has none) and loss
    weight; ``blob`` reads a video's bytes when they are not the file ``path`` (then ``path``
    only names it), and ``identity`` says what must not change for a stored probe of the blob
    to hold (its shard's identity and member; None: the blob is probed every time)."""

    path: Path | str
    caption: str
    weight: float = 1.0
    blob: ClipBlob | None = None
    identity: str | None = None

    @property
    def source(self) -> Path | str | ClipBlob:
        """What :func:`~impasto.data.video.probe.probe_clip` and ``decode_clips`` read."""
        return self.blob if self.blob is not None else self.path


@dataclass
class ClipScan:
    """The clips a folder scan found, and the items it left out with the reason."""

    records: list[ClipRecord] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def is_frame_folder(path: Path) -> bool:
    """Whether ``path`` is a frame folder: a folder holding ``fps.txt``. The file marks it
    (a folder of numbered images is otherwise a folder of separate images) and gives its
    frame rate."""
    return path.is_dir() and (path / FPS_FILE).is_file()


def clip_caption(path: Path) -> str:
    """The caption of a video or image (its same-stem sidecar) or of a frame folder (the
    sidecar beside it, named after the folder); "" without one.

    Raises:
        CaptionError: the caption file cannot be used (not UTF-8, not JSON, a folder).
    """
    path = Path(path)
    if path.is_dir():
        # read_caption swaps the suffix: give it one to swap, so "clip.v2/" reads "clip.v2.txt".
        return read_caption(path.with_name(path.name + ".frames"))
    return read_caption(path)


def _find_clips(folder: Path, found: list[Path]) -> None:
    for entry in folder.iterdir():
        if entry.name.startswith("."):  # .git/, .ipynb_checkpoints/: never data
            continue
        if entry.is_dir():
            if is_frame_folder(entry):
                found.append(entry)
            else:
                _find_clips(entry, found)
        elif entry.suffix.lower() in VIDEO_EXTENSIONS + IMAGE_EXTENSIONS and entry.is_file():
            found.append(entry)


def scan_clip_folder(root: Path) -> ClipScan:
    """Every clip under ``root`` with its caption (module docstring), sorted by path relative
    to ``root``; one whose caption file cannot be read is left out, named in ``skipped``.
    Nothing is decoded here (:func:`probe_clips` does).

    Raises:
        ValueError: ``root`` is not a folder, or holds no video, frame folder nor image.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(
            f"data: video folder {root} does not exist or is not a folder; check the path"
        )
    found: list[Path] = []
    _find_clips(root, found)
    if not found:
        accepted = " ".join(VIDEO_EXTENSIONS + IMAGE_EXTENSIONS)
        raise ValueError(
            f"data: no clips found in {root}; accepted: {accepted} (any case) and "
            f"frame folders (a folder with {FPS_FILE})"
        )
    scan = ClipScan()
    for path in sorted(found, key=lambda path: path.relative_to(root).parts):
        try:
            scan.records.append(ClipRecord(path, clip_caption(path)))
        except CaptionError as error:
            scan.skipped.append(Skipped(SCANNED, str(path), error.reason))
    return scan


def probe_clips(
    records: Sequence[ClipRecord],
) -> tuple[list[tuple[ClipRecord, ClipInfo]], list[Skipped]]:
    """Each record with its :class:`ClipInfo`; a clip that does not decode is left out and
    named once (however often it is listed) in the second list with the reason. A clip cut
    short by damage is kept with the frames that decode (:attr:`ClipInfo.damage`)."""
    infos: dict[str, ClipInfo | UnreadableClip] = {}
    probed, skipped = [], []
    for record in records:
        name = str(record.path)
        if name not in infos:
            try:
                infos[name] = probe_clip(record.source, name)
            except UnreadableClip as error:
                infos[name] = error
                skipped.append(Skipped(SCANNED, name, error.reason))
        if isinstance(infos[name], ClipInfo):
            probed.append((record, infos[name]))
    return probed, skipped
