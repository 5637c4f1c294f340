"""What a run leaves out, and why, in words a person can act on.

Every unusable item (an image that does not decode, a caption file that is not UTF-8, a tar
shard that is truncated, a cache entry that fails its checksum) becomes one :class:`Skipped`:
the item's name (a path, ``shard.tar/member``, ``file.parquet/row-N``) and a one-line reason.
The run's report ``RUN/bad-data.tsv`` lists them, once per name (issue #16).

A damaged cached text embedding is not left out: its caption is encoded on the fly and the
image trained on. It becomes one :class:`Reencoded`, named after its caption
(:func:`text_embedding_name`), listed in the same report but never counted as an unusable image
(issue #29).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from PIL import Image, UnidentifiedImageError

from impasto.faults import writing

SCANNED = -1
"""The ``index`` of an item left out while the sources were read (it has no record)."""


@dataclass(frozen=True)
class Skipped:
    """An item that could not be used: its record index (:data:`SCANNED` when it was left
    out before it became a record), its name, and why."""

    index: int
    name: str
    reason: str


@dataclass(frozen=True)
class Reencoded:
    """A cached encoding that could not be used (it fails its checksum, or its shard does not
    read), so training encoded it afresh: the example was trained on, hence it is no unusable
    image (not in ``num_bad``, nor ``data.max_bad_fraction``). ``index``: the record that met it
    first; ``name``: :func:`text_embedding_name`; ``reason``: what was wrong and what was done."""

    index: int
    name: str
    reason: str


Item = TypeVar("Item", Skipped, Reencoded)

TEXT_EMBEDDING = "cached text embedding of caption "
"""How the report's name of a :class:`Reencoded` text embedding starts."""

# JSON escapes tabs and line feeds; these still break a line for ``str.splitlines``.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def text_embedding_name(caption: str) -> str:
    """The report's name of ``caption``'s cached text embedding: ``cached text embedding of
    caption "..."``, the caption quoted as JSON (one line, no tab), so each caption is one
    name."""
    return TEXT_EMBEDDING + json.dumps(caption, ensure_ascii=False).translate(_LINE_BREAKS)


class UnreadableSource(ValueError):
    """A whole container (a Parquet file, a dataset's files) could not be read. Raised by a
    source reader; a run with other readable sources skips it and reports it."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"data: {name}: {reason}")
        self.name, self.reason = name, reason


# ``<_io.BytesIO object at 0x7f...>``: what PIL's messages show for an image read from bytes.
_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def error_reason(error: BaseException) -> str:
    """One readable line for what went wrong: the first line of the exception's message with
    object reprs left out (PIL's ``cannot identify image file <_io.BytesIO object at 0x...>``),
    its type when it has no message. The item itself is named by the :class:`Skipped` that
    carries the reason."""
    if not error.args:
        return type(error).__name__
    if isinstance(error, UnidentifiedImageError):
        return "not an image PIL can read (unknown format, or an empty or damaged header)"
    if isinstance(error, Image.DecompressionBombError):
        return f"too many pixels ({' '.join(str(error).split())})"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 (byte 0x{error.object[error.start]:02x} at offset {error.start})"
    if isinstance(error, OSError) and error.strerror:
        text = error.strerror if error.filename is None else f"{error.strerror}: {error.filename}"
    else:
        first_line = (str(error).strip().splitlines() or [""])[0]
        text = _OBJECT_REPR.sub("", " ".join(first_line.split())).strip(" :")
    return text or type(error).__name__


def distinct(skipped: Sequence[Item]) -> list[Item]:
    """The first :class:`Skipped` (or :class:`Reencoded`) of each name, in order: an item met
    twice (two sources list it, a later epoch meets it again) is one bad item."""
    seen: dict[str, Item] = {}
    for item in skipped:
        seen.setdefault(item.name, item)
    return list(seen.values())


BAD_DATA_FILE = "bad-data.tsv"


@dataclass(frozen=True)
class BadDataCounts:
    """The rows of a run's bad-data report: items left out, text embeddings re-encoded."""

    num_left_out: int = 0
    num_reencoded: int = 0


def count_bad_data(path: Path) -> BadDataCounts:
    """Count the rows of the report at ``path`` by kind (none when there is no report)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return BadDataCounts()
    names = {line.split("\t")[0] for line in lines if line.strip()}
    reencoded = sum(name.startswith(TEXT_EMBEDDING) for name in names)
    return BadDataCounts(len(names) - reencoded, reencoded)


class BadDataLog:
    """The items a run left out, and the cached text embeddings it re-encoded, one
    ``name<TAB>reason`` line each (``RUN/bad-data.tsv``), appended as they are met, each name
    once, kept across resumes."""

    def __init__(self, path: Path | None) -> None:
        """``path`` None: a log kept in memory only (``impasto data preview`` writes no file)."""
        self.path = path
        self.names: set[str] = set()
        if path is not None and path.exists():
            lines = path.read_text(encoding="utf-8").splitlines()
            self.names = {line.split("\t")[0] for line in lines}

    def record(self, skipped: Sequence[Skipped | Reencoded], write: bool = True) -> None:
        """Add the items not listed yet (``write``: to the file too; rank 0 of a run writes).
        The counts are the trainer's (``TrainState.count_bad``): the report may run ahead of
        a resumed checkpoint."""
        new = distinct([item for item in skipped if item.name not in self.names])
        if new and write and self.path is not None:
            with writing(self.path), self.path.open("a", encoding="utf-8") as handle:
                for item in new:
                    reason = " ".join(item.reason.split())  # one line, no tab
                    handle.write(f"{item.name}\t{reason}\n")
        self.names.update(item.name for item in new)
