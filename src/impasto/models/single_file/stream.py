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


class SafetensorsFileError(ValueError):
    """A file that is not a usable safetensors file. ``str()`` is one line that starts with the
    kind of problem (``not a safetensors file``, ``truncated``, ``corrupt``), then the detail in
    parentheses; the subclass says which, so that callers can word the way out (issue #29)."""

    kind = "not a usable safetensors file"

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f"{self.kind} ({detail})")


class NotSafetensorsError(SafetensorsFileError):
    """No safetensors header: an empty file, text, JSON, an HTML page, a pickle, a zip."""

    kind = "not a safetensors file"


class TruncatedSafetensorsError(SafetensorsFileError):
    """A valid header whose header or tensor data runs past the end of the file."""

    kind = "truncated"


class CorruptSafetensorsError(SafetensorsFileError):
    """A header that parses but is inconsistent: not JSON, an unknown dtype, a shape that does
    not fit its byte range, overlapping tensors."""

    kind = "corrupt"


def _as_text(start: bytes) -> str | None:
    """``start`` as text if it is printable UTF-8 (a character cut at its end allowed)."""
    try:
        text = start.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(start) - 3:  # not just a multi-byte character cut by the read
            return None
        text = start[: error.start].decode("utf-8")
    if text and all(char.isprintable() or char.isspace() for char in text):
        return text
    return None


def _looks_like(start: bytes, size: int) -> str:
    """What a file that is not safetensors seems to be, from its first bytes (for the error)."""
    if size == 0:
        return "the file is empty"
    if start.startswith(b"PK\x03\x04"):
        return "a zip archive, as PyTorch .pt / .ckpt files are"
    if start[:1] == b"\x80":
        return "a Python pickle, as old PyTorch .pt / .ckpt files are"
    text = _as_text(start)
    if text is not None:
        words = " ".join(text.split())
        return f"{size:,} bytes of text starting {words[:40] + '...' * (len(words) > 40)!r}"
    if size < 8:
        return f"{size} bytes, shorter than the 8-byte header length"
    (header_size,) = struct.unpack("<Q", start[:8])
    return f"its first 8 bytes give a header length of {header_size:,} bytes"


class TensorFile:
    """A safetensors file opened for reading one tensor at a time without a memory map.

    The header is parsed and checked on opening (every tensor's byte range inside the file and
    of the size its shape and dtype say). A file that cannot be opened raises ``OSError``
    (``FileNotFoundError``, ``IsADirectoryError``, ``PermissionError``); one that opens but is
    not a usable safetensors file a :class:`SafetensorsFileError` (a ``ValueError``):
    :class:`NotSafetensorsError`, :class:`TruncatedSafetensorsError` or
    :class:`CorruptSafetensorsError`. Use as a context manager; :meth:`read` returns a new CPU
    tensor, :meth:`read_into` fills a contiguous tensor of the same shape in place.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handle: BinaryIO = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        try:
            self._parse_header()
        except BaseException:
            self._handle.close()
            raise

    def _read_header(self, size: int) -> dict[str, object]:
        """The header as a JSON object (and ``_start``, where the data begins); raises what kind
        of file this is when it is not one."""
        start = self._handle.read(64)
        if len(start) < 8:
            raise NotSafetensorsError(_looks_like(start, size))
        (header_size,) = struct.unpack("<Q", start[:8])
        # A header is a JSON object: "{" right after the length, else the file is something else.
        if header_size > MAX_HEADER_BYTES or start[8:].lstrip()[:1] != b"{":
            raise NotSafetensorsError(_looks_like(start, size))
        if header_size > size - 8:
            raise TruncatedSafetensorsError(
                f"a {header_size:,}-byte header, but only {size - 8:,} bytes follow its length"
            )
        self._handle.seek(8)
        try:
            header = json.loads(self._handle.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptSafetensorsError(f"the header is not valid JSON: {error}") from None
        if not isinstance(header, dict):
            raise CorruptSafetensorsError("the header is not a JSON object")
        self._start = 8 + header_size
        return header

    def _parse_header(self) -> None:
        size = os.fstat(self._handle.fileno()).st_size
        header = self._read_header(size)
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(value, str) for value in metadata.values()
        ):
            raise CorruptSafetensorsError("__metadata__ is not a map of strings")
        self.metadata: dict[str, str] = metadata
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        for name, entry in header.items():
            self._parse_entry(name, entry)
        self._check_layout(size)

    def _parse_entry(self, name: str, entry: object) -> None:
        try:
            dtype_name = entry["dtype"]  # type: ignore[index]
            shape = tuple(int(n) for n in entry["shape"])  # type: ignore[index]
            begin, end = (int(n) for n in entry["data_offsets"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            raise CorruptSafetensorsError(f"a bad header entry for tensor {name!r}") from None
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES_BY_NAME:
            raise CorruptSafetensorsError(f"tensor {name!r} has an unknown dtype {dtype_name!r}")
        dtype = DTYPES_BY_NAME[dtype_name]
        if min(shape, default=0) < 0 or not 0 <= begin <= end:
            raise CorruptSafetensorsError(f"tensor {name!r} has a negative size or byte offset")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CorruptSafetensorsError(
                f"tensor {name!r}: byte offsets that do not fit its shape"
            )
        self.shapes[name], self.dtypes[name] = shape, dtype
        self._offsets[name] = (begin, end)

    def _check_layout(self, size: int) -> None:
        """No two tensors share bytes, and the last one ends inside the file."""
        previous, previous_end = "", 0
        for name, (begin, end) in sorted(self._offsets.items(), key=lambda item: item[1]):
            if begin < previous_end:
                raise CorruptSafetensorsError(f"tensors {previous!r} and {name!r} overlap")
            previous, previous_end = name, max(previous_end, end)
        if self._start + previous_end > size:
            raise TruncatedSafetensorsError(
                f"its tensors end at byte {self._start + previous_end:,}, the file holds {size:,}"
            )

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
                raise TruncatedSafetensorsError(f"{name}: the file ended early")
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
