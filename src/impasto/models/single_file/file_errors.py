"""One-line errors for the files and folders a user names (issue #29).

Each error names the config setting or command-line option that named the path, the path as
given, what is wrong with it and the way out, in the CLI's one-line ``ValueError`` form
(``model.path /models/base.safetensors: does not exist; put the file back there or point
model.path at it``). The cases are told apart: the path does not exist; it is a folder where a
file is expected (or the reverse); it cannot be read (permission denied); it is not a
safetensors file (empty, text, JSON, an HTML page, a pickle); it is truncated; its header is
corrupt.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from impasto.models.single_file.stream import SafetensorsFileError, TensorFile

RECOPY = "re-download or re-copy it"


def _label(setting: str, path: Path, label: str | None) -> str:
    return label or f"{setting} {path}"


def missing_error(
    path: Path, setting: str, kind: str = "file", label: str | None = None
) -> ValueError:
    """``path`` (a ``kind``: file, folder, ...) does not exist."""
    if setting.startswith("--"):  # a command-line option: most likely a typo
        way_out = f"check the path given to {setting}"
    else:
        way_out = f"put the {kind} back there or point {setting} at it"
    return ValueError(f"{_label(setting, path, label)}: does not exist; {way_out}")


def os_error(
    path: Path, setting: str, error: OSError, expected: str = "a file", label: str | None = None
) -> ValueError:
    """The one-line error for ``error``, raised opening the file ``path``."""
    where = _label(setting, path, label)
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):
        return missing_error(path, setting, label=label)
    if isinstance(error, IsADirectoryError):
        return ValueError(f"{where}: is a folder, not a file; point {setting} at {expected}")
    if isinstance(error, PermissionError) or error.errno in (errno.EACCES, errno.EPERM):
        return ValueError(f"{where}: cannot read it (permission denied); check its permissions")
    reason = error.strerror or str(error) or type(error).__name__
    return ValueError(f"{where}: cannot read it ({reason}); check the file and its disk")


def safetensors_error(where: str, error: SafetensorsFileError) -> ValueError:
    """The one-line error for a file that opened but is not a usable safetensors file (``where``:
    the setting and the path); the error's own words say which kind, e.g. ``truncated (...)``."""
    return ValueError(f"{where}: {error}; {RECOPY}")


def _stat(path: Path, setting: str, kind: str, label: str | None) -> os.stat_result:
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise missing_error(path, setting, kind, label) from None
    except OSError as error:
        raise os_error(path, setting, error, label=label) from None


def check_file(path: str | Path, setting: str, expected: str, label: str | None = None) -> None:
    """Raise a one-line ``ValueError`` unless ``path`` is a file this process can read.

    ``expected`` says what the setting wants (``"an SDXL .safetensors file"``), for the case of a
    folder given where a file is expected."""
    path = Path(path)
    try:
        if stat.S_ISDIR(_stat(path, setting, "file", label).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        with open(path, "rb"):  # permission denied shows only on opening
            pass
    except OSError as error:
        raise os_error(path, setting, error, expected, label) from None


def check_folder(path: str | Path, setting: str, expected: str, label: str | None = None) -> None:
    """Raise a one-line ``ValueError`` unless ``path`` is a folder this process can list."""
    path = Path(path)
    if not stat.S_ISDIR(_stat(path, setting, "folder", label).st_mode):
        where = _label(setting, path, label)
        raise ValueError(f"{where}: is a file, not a folder; point {setting} at {expected}")
    try:
        with os.scandir(path) as entries:
            next(entries, None)
    except OSError as error:
        raise os_error(path, setting, error, label=label) from None


def open_tensor_file(path: str | Path, setting: str, label: str | None = None) -> TensorFile:
    """:class:`TensorFile` of ``path``, every way it can fail a one-line ``ValueError``."""
    path = Path(path)
    try:
        return TensorFile(path)
    except OSError as error:
        raise os_error(path, setting, error, "a .safetensors file", label) from None
    except SafetensorsFileError as error:
        raise safetensors_error(_label(setting, path, label), error) from None


def check_safetensors(path: str | Path, setting: str, label: str | None = None) -> None:
    """Raise a one-line ``ValueError`` unless ``path`` is a readable safetensors file whose
    header is whole and consistent (the header is read; no tensor is)."""
    open_tensor_file(path, setting, label).close()
