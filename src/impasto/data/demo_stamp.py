"""Demo data that a run writes (``data.generate_demo``) carries a stamp of what it was written for.

A run writes the demo dataset and its held-out sets only where a folder is missing, and reuses
the folder afterwards. Without a record of how it was written, a config that asks for other
demo data (more images, another resolution or frame count, or a generator that draws
differently since) would train on the old folder without a word. So each folder is written
under a hidden temporary name, stamped (``.impasto-demo.json``: its settings) and renamed: a
folder that exists is complete (an interrupted start leaves only the hidden temporary folder
behind, never half a dataset), and a run whose settings differ from the stamp stops with one
line that names them. A folder without a stamp (written before stamps, or by ``impasto data
demo``) is used as it is.

``train.seed`` is not stamped: another seed draws another sample of the same data, and a run of
seed 1 may reuse the folder seed 0 wrote.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAMP = ".impasto-demo.json"
"""The stamp's name in a demo folder (hidden: folder scans skip it)."""


def _as_json(settings: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(settings))  # tuples as lists, as a stamp reads back


def write_stamped(path: Path, settings: dict[str, Any], write: Callable[[Path], object]) -> None:
    """``write(folder)`` the demo data into a temporary folder beside ``path``, stamp it with
    ``settings`` and rename it to ``path`` (which must not exist)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tmp-") as temporary:
        written = Path(temporary) / "set"
        write(written)
        text = json.dumps(_as_json(settings), indent=1) + "\n"
        (written / STAMP).write_text(text, encoding="utf-8")
        written.rename(path)


def check_stamp(path: Path, settings: dict[str, Any], key: str) -> None:
    """Raise a one-line ValueError if the demo folder ``path`` (the config's ``key``) was
    written for other ``settings``; a folder without a stamp passes."""
    stamp = path / STAMP
    if not stamp.is_file():
        return
    fix = f"delete {path} to write the demo data again, or point {key} at another folder"
    try:
        written = json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ValueError(f"{key}: the demo stamp {stamp} cannot be read; {fix}") from None
    if not isinstance(written, dict):
        raise ValueError(f"{key}: the demo stamp {stamp} is not a settings object; {fix}")
    differences = [
        f"{name} {json.dumps(written.get(name))} there, {json.dumps(value)} in this config"
        for name, value in _as_json(settings).items()
        if written.get(name) != value
    ]
    if differences:
        raise ValueError(
            f"{key}: {path} holds demo data written for other settings "
            f"({'; '.join(differences)}); {fix}"
        )
