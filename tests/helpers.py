"""Small helpers several test modules share: bitwise comparison of checkpoint contents,
in-memory tar files and bit rot in a cache shard."""

from __future__ import annotations

import io
import json
import os
import struct
import tarfile
from pathlib import Path
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


def rot_entry(shard: Path, name: str) -> None:
    """Flip bytes inside entry ``name``'s tensor data, keeping the shard's size and times (bit
    rot: the fill trusts the shard, the reader's checksum catches the entry)."""
    data = bytearray(shard.read_bytes())
    header_size = struct.unpack("<Q", data[:8])[0]
    begin, _ = json.loads(data[8 : 8 + header_size])[name]["data_offsets"]
    start = 8 + header_size + begin
    data[start : start + 16] = bytes(byte ^ 0xFF for byte in data[start : start + 16])
    stat = shard.stat()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
