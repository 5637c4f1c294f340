"""Prompt files: the data of methods that generate from prompts (``data.prompts``, draftp).

A ``.txt`` file holds one prompt per line (blank lines are skipped); a ``.jsonl`` file one JSON
object per line with the prompt under ``prompt``, ``caption`` or ``text`` (the first present).
Each prompt becomes a record whose name is ``FILE:LINE`` and whose caption is the prompt, so the
prompt stream orders, splits across ranks and resumes it like images.
"""

from __future__ import annotations

import json
from pathlib import Path

from impasto.data.folder import ImageRecord

PROMPT_KEYS = ("prompt", "caption", "text")


def _jsonl_prompt(line: str, where: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"data.prompts: {where} is not JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"data.prompts: {where} is not a JSON object")
    for key in PROMPT_KEYS:
        if isinstance(row.get(key), str):
            return row[key]
    raise ValueError(
        f"data.prompts: {where} has no string field {' / '.join(PROMPT_KEYS)}; put each "
        "prompt under one of them"
    )


def read_prompts(path: str | Path) -> list[ImageRecord]:
    """The prompts of a ``.txt`` or ``.jsonl`` file as records (name ``FILE:LINE``)."""
    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(
            f"data.prompts: {path} is neither .txt (a prompt per line) nor .jsonl; rename or "
            "convert it"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(
            f"data.prompts {path}: does not exist; put the file back there or point data.prompts "
            "at it"
        ) from None
    except IsADirectoryError:
        raise ValueError(
            f"data.prompts {path}: is a folder, not a prompt file; point data.prompts at a .txt "
            "or .jsonl file"
        ) from None
    except PermissionError:
        raise ValueError(
            f"data.prompts {path}: cannot read it (permission denied); check its permissions"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"data.prompts: cannot read {path} as UTF-8 text ({error})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        prompt = _jsonl_prompt(line, where) if path.suffix == ".jsonl" else line.strip()
        records.append(ImageRecord(where, prompt))
    if not records:
        raise ValueError(f"data.prompts: {path} holds no prompt; add one per line")
    return records
