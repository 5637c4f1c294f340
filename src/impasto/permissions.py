"""Files impasto writes get the permissions the user's umask asks for.

safetensors creates its files with mode 0600 (and ``tempfile`` does the same), so without this
an exported model or a checkpoint on a shared cluster could be read by its owner alone, while
every other tool on the machine honours the umask (0644 under the usual 022).
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process's umask (read by setting and restoring it: Python has no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> Path:
    """Give ``path`` (a file, or every file and folder under a folder) the mode a plain
    ``open`` / ``mkdir`` would have given it: 0666 / 0777 without the umask's bits."""
    mask = current_umask()
    path = Path(path)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in paths:
        if item.is_symlink():
            continue
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
    return path
