"""Read and write safetensors files one tensor at a time, with plain file reads and writes.

Writing: ``safetensors.torch.save_file`` needs every tensor in one dict, in its final dtype: an
fp16 export of an fp32 model then holds both copies (about 21 GB for SDXL's 14 GB of fp32
weights). The format lets the header be written first, since it holds only names, dtypes,
shapes and byte offsets (https://github.com/huggingface/safetensors#format): the writer computes
it from the tensors' shapes, then casts and writes each tensor in turn, so an export holds one
cast tensor at a time. The tensors may be views of a model's parameters; they are only read.

Reading: ``safe_open`` memory-maps the file, and every page a read touches stays in the
process's resident memory until the file is closed: streaming a 10 GB checkpoint through it
adds 10 GB to the peak RSS, on top of the tensors made from it. :class:`TensorFile` reads each
tensor's bytes with ``readinto``, into a new tensor or straight into a model's parameter.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

# torch dtype -> the safetensors header's name for it (the format's own list).
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
HEADER_ALIGNMENT = 8  # the data starts 8-byte aligned, as safetensors pads its own header
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def written_dtype(tensor: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is written in: ``dtype`` for floating tensors, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _file_order(tensors: Mapping[str, Tensor], dtype: torch.dtype | None) -> list[str]:
    """Largest element size first, then by name, as safetensors' own writer orders them: every
    tensor then starts at a multiple of its element size."""
    return sorted(tensors, key=lambda name: (-written_dtype(tensors[name], dtype).itemsize, name))


def _header(
    tensors: Mapping[str, Tensor],
    order: list[str],
    dtype: torch.dtype | None,
    metadata: Mapping[str, str],
) -> bytes:
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        out_dtype = written_dtype(tensor, dtype)
        if out_dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"safetensors cannot store {name} as {out_dtype}")
        size = tensor.numel() * out_dtype.itemsize
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[out_dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    padding = -(8 + len(header)) % HEADER_ALIGNMENT
    return header + b" " * padding


def _bytes_of(tensor: Tensor) -> memoryview:
    """The little-endian bytes of a contiguous CPU tensor (writable), without a copy."""
    flat = tensor.detach().reshape(-1)  # a 0-d tensor cannot be viewed as bytes
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to ``path`` as safetensors, floating ones cast to ``dtype`` (None: as
    they are), holding one cast tensor at a time. ``metadata`` maps str to str. The file is
    written beside ``path`` and renamed into place, so a reader never sees half of it.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this machine is not")
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"safetensors metadata must map str to str, got {key!r}: {value!r}")
    path = Path(path)
    order = _file_order(tensors, dtype)
    header = _header(tensors, order, dtype, metadata or {})
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as handle:
            handle.write(struct.pack("<Q", len(header)))
            handle.write(header)
            for name in order:
                tensor = tensors[name]
                out = tensor.detach().to("cpu", written_dtype(tensor, dtype)).contiguous()
                handle.write(_bytes_of(out))
                del out  # the cast copy goes before the next tensor is cast
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class TensorFile:
    """A safetensors file opened for reading one tensor at a time without a memory map.

    The header is parsed and checked on opening (every tensor's byte range inside the file and
    of the size its shape and dtype say): a truncated or foreign file is a ``ValueError``.
    Use as a context manager; :meth:`read` returns a new CPU tensor, :meth:`read_into` fills a
    contiguous tensor of the same shape in place.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handle: BinaryIO = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        try:
            self._parse_header()
        except BaseException:
            self._handle.close()
            raise

    def _parse_header(self) -> None:
        size = os.fstat(self._handle.fileno()).st_size
        prefix = self._handle.read(8)
        if len(prefix) < 8:
            raise ValueError("shorter than a safetensors header")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError("the header length is past the end of the file")
        try:
            header = json.loads(self._handle.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"the header is not JSON ({error})") from None
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._start = 8 + header_size
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        for name, entry in header.items():
            try:
                dtype = DTYPES_BY_NAME[entry["dtype"]]
                shape = tuple(int(n) for n in entry["shape"])
                begin, end = (int(n) for n in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"a bad header entry for {name!r}") from None
            if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{name!r} has byte offsets that do not fit its shape")
            if self._start + end > size:
                raise ValueError(f"{name!r} ends past the end of the file (truncated?)")
            self.shapes[name], self.dtypes[name] = shape, dtype
            self._offsets[name] = (begin, end)

    def keys(self) -> list[str]:
        return list(self.shapes)

    def read_into(self, name: str, target: Tensor) -> None:
        """Copy tensor ``name`` into ``target`` (same shape; any dtype, cast on copy)."""
        if tuple(target.shape) != self.shapes[name]:
            raise ValueError(f"{name}: shape {self.shapes[name]}, expected {tuple(target.shape)}")
        direct = target.dtype == self.dtypes[name] and target.is_contiguous() and not target.is_meta
        buffer = target if direct and target.device.type == "cpu" else self.read(name)
        if buffer is target:
            begin, end = self._offsets[name]
            self._handle.seek(self._start + begin)
            if self._handle.readinto(_bytes_of(target)) != end - begin:
                raise ValueError(f"{name}: the file ended early (truncated?)")
        else:
            with torch.no_grad():
                target.copy_(buffer)

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` as a new CPU tensor."""
        tensor = torch.empty(self.shapes[name], dtype=self.dtypes[name])
        self.read_into(name, tensor)
        return tensor

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
