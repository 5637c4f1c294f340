"""Small helpers several test modules share: bitwise comparison of checkpoint contents and
in-memory tar files."""

from __future__ import annotations

import io
import tarfile
from typing import Any

import torch


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursive bitwise equality (tensors with ``torch.equal`` and equal dtypes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """A tar archive (USTAR) of ``(name, data)`` members, in memory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
