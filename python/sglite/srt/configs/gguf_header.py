"""A GGUF file's header: its metadata key/values and tensor table, read in one pass over an mmap.

The ``gguf`` package's ``GGUFReader`` builds a numpy memmap view for every element of every metadata
array, which takes ~5 s for SmolLM2's 49k-token vocabulary and merge table on a 2-core box; this reader
walks the same bytes with ``struct`` (~0.1 s) and gives tensor data as zero-copy views of the mmap.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# Metadata value types: the fixed-size scalars (struct formats), then string (8) and array (9).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, version or value type)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table."""

    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    ggml_type: int  # a gguf.GGMLQuantizationType value
    data_offset: int  # absolute offset of the tensor's bytes in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape in numpy / torch order (outermost first)."""
        return tuple(reversed(self.dims))

    def row_layout(self) -> tuple[int, int]:
        """(rows, bytes per row) of the stored tensor: rows are its innermost dimension, in quantized blocks."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        rows = 1
        for d in self.dims[1:]:
            rows *= d
        return rows, self.dims[0] // block * type_size


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (key -> int / float / bool / str / list) and tensor table of one GGUF file."""

    path: str
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    _buffer: Any  # the file's mmap: tensor_bytes views point into it

    def tensor_bytes(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored bytes as a read-only uint8 array of shape (rows, bytes per row), not copied."""
        rows, row_bytes = tensor.row_layout()
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=rows * row_bytes, offset=tensor.data_offset)
        return data.reshape(rows, row_bytes)


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        if start + n > len(self.buf):
            raise GGUFFormatError(f"{self.path}: a {n}-byte string at byte {start} runs past the end of the file")
        self.pos = start + n
        try:
            return self.buf[start : self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{self.path}: the string at byte {start} is not UTF-8 (corrupt header)") from None

    def check_count(self, count: int, min_bytes_each: int, what: str) -> None:
        """A count whose items cannot fit in the rest of the file is corrupt (refused before any loop runs)."""
        if count * min_bytes_each > len(self.buf) - self.pos:
            raise GGUFFormatError(
                f"{self.path}: the header claims {count} {what}, more than the {len(self.buf) - self.pos} bytes left "
                "can hold (corrupt or truncated file)"
            )

    def value(self, kind: int) -> Any:
        fmt = _SCALAR_FORMATS.get(kind)
        if fmt is not None:
            return self.unpack(fmt)[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<IQ")
            item_fmt = _SCALAR_FORMATS.get(item_kind)
            self.check_count(count, struct.calcsize(item_fmt) if item_fmt else 8, "array items")
            if item_fmt is not None:  # one unpack for the whole array
                return list(self.unpack(f"<{count}{item_fmt[1]}"))
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            return [self.value(item_kind) for _ in range(count)]
        raise GGUFFormatError(f"{self.path}: unknown GGUF metadata value type {kind} at byte {self.pos}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse ``path``'s metadata and tensor table (tensor data is left in place, mapped)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFFormatError(f"{path}: not a GGUF file (no GGUF magic)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, path)
    except struct.error as e:  # a count or length pointing past the end of the file
        raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from None


def _parse(buf: Any, path: str) -> GGUFHeader:
    cur = _Cursor(buf, path)
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("<IQQ")
    if version not in _SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (only {_SUPPORTED_VERSIONS})")
    cur.check_count(n_kv, 8 + 4, "metadata keys")  # each: a key length and a value type at least
    cur.check_count(n_tensors, 8 + 4 + 4 + 8, "tensors")  # each: name length, dims count, type, offset
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        (kind,) = cur.unpack("<I")
        metadata[key] = cur.value(kind)
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        dims = cur.unpack(f"<{n_dims}Q")
        ggml_type, offset = cur.unpack("<IQ")
        table.append((name, tuple(int(d) for d in dims), int(ggml_type), int(offset)))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = tuple(GGUFTensorInfo(n, d, t, data_start + o) for n, d, t, o in table)
    _check_tensor_data_fits(tensors, len(buf), path)
    return GGUFHeader(path, metadata, tensors, buf)


def _check_tensor_data_fits(tensors: tuple[GGUFTensorInfo, ...], file_size: int, path: str) -> None:
    """Every tensor's bytes lie inside the file: a truncated download is named here, not at the first read."""
    for t in tensors:
        try:
            rows, row_bytes = t.row_layout()
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{path}: tensor {t.name!r} has unknown GGML type {t.ggml_type}") from None
        end = t.data_offset + rows * row_bytes
        if end > file_size:
            raise GGUFFormatError(
                f"{path}: tensor {t.name!r} needs bytes up to {end} but the file has {file_size} (truncated download?)"
            )


__all__ = ["GGUFFormatError", "GGUFHeader", "GGUFTensorInfo", "read_gguf_header"]
