"""The record of a model a family exports as a folder of its own (the DiT's; SDXL exports
diffusers folders and single files instead): ``impasto-model.json`` beside its weights says
which family wrote it, how it was trained to sample (the run's objective) and at what size,
plus what the family itself needs to rebuild the networks. ``impasto sample`` and
``model.path`` read it; nothing here knows a family.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RECORD_FILE = "impasto-model.json"

FolderWriter = Callable[[Any, Path, dict[str, Any], torch.dtype], Path]
"""``(backbone, out, record, dtype) -> out``: a family writes its model to the folder ``out``
with ``record`` (family, objective, resolution) and its own keys in :data:`RECORD_FILE`."""


def is_model_folder(path: str | Path) -> bool:
    return (Path(path) / RECORD_FILE).is_file()


def write_record(out: Path, record: dict[str, Any]) -> None:
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def read_record(path: str | Path, family: str | None = None) -> dict[str, Any]:
    """The record of the exported folder ``path`` (of ``family``, if given); a one-line
    ValueError when it is missing, unreadable or another family's."""
    file = Path(path) / RECORD_FILE
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no {RECORD_FILE}; not a model exported by impasto") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read {RECORD_FILE} ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("family"), str):
        raise ValueError(f"{path}: {RECORD_FILE} names no model family")
    if family is not None and record["family"] != family:
        raise ValueError(
            f"{path}: {RECORD_FILE} holds a {record['family']} model, not a {family} one; "
            f"set model.family: {record['family']}"
        )
    return record
