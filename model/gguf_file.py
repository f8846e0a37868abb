"""A GGUF file's metadata and tensors, its header read in one pass into Python values.

gguf's GGUFReader keeps a NumPy view of every part of every value: 6 s on 2 cores for the
embedded SmolLM2's vocabulary (49,152 tokens and 48,900 merges), paid at every load. Here the
format's constants and block sizes are still gguf's, and tensors are the same views of the
mapped file (quantized ones as bytes, a row of blocks a row, for `gguf.dequantize`).
"""
import math
import mmap
import struct
from typing import NamedTuple

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_ELEMENTS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
_VERSIONS = (2, GGUF_VERSION)


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the innermost dimension first
    data: np.ndarray  # row-major (shape reversed); a quantized type's rows as bytes


class GGUFFile(NamedTuple):
    fields: dict  # {key: value}: str, int, float, bool, or a list of them
    tensors: list[GGUFTensor]  # in the file's order
    byte_order: str  # "<" or ">", as struct and NumPy spell it


def read_gguf(path: str) -> GGUFFile:
    """Raises ValueError for a file that is not GGUF or is cut short."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise ValueError(f"{path} is not a GGUF file ({size} bytes)")
        header = _Header(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    try:
        return header.read(path)
    except struct.error:
        raise ValueError(f"{path}: the GGUF header ends past the file's end") from None


class _Header:
    """Reads the header from the file's start, value by value."""

    def __init__(self, mapped: mmap.mmap):
        self._map, self._offset, self._order = mapped, 0, "<"

    def read(self, path: str) -> GGUFFile:
        magic, version = self._unpack("II")
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in _VERSIONS:
            raise ValueError(f"{path} is GGUF version {version}; {_VERSIONS} can be read")
        tensor_count, field_count = self._unpack("QQ")
        fields = {}
        for _ in range(field_count):
            key = self._string()
            fields[key] = self._value(self._unpack("I")[0])
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        whole = np.frombuffer(self._map, np.uint8)
        return GGUFFile(fields, [self._tensor(whole, start, *info, path) for info in infos],
                        self._order)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(self._order + fmt, self._map, self._offset)
        self._offset += struct.calcsize(self._order + fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        end = self._offset + n
        if end > len(self._map):
            raise struct.error("a string past the end")
        text = str(self._map[self._offset:end], "utf-8")
        self._offset = end
        return text

    def _value(self, kind: int):
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, n = self._unpack("IQ")
        if item in _SCALARS:  # all at once
            return list(self._unpack(f"{n}{_SCALARS[item]}"))
        return [self._value(item) for _ in range(n)]

    def _tensor_info(self) -> tuple:
        name = self._string()
        (dims,) = self._unpack("I")
        shape = self._unpack(f"{dims}Q")
        kind, offset = self._unpack("IQ")
        return name, GGMLQuantizationType(kind), shape, offset

    def _tensor(self, whole: np.ndarray, start: int, name: str, kind: GGMLQuantizationType,
                shape: tuple[int, ...], offset: int, path: str) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        first, n_bytes = start + offset, math.prod(shape) * block_bytes // block
        if first + n_bytes > whole.size:
            raise ValueError(f"{path}: tensor {name!r} ends past the file's end")
        data, rows = whole[first:first + n_bytes], tuple(reversed(shape))
        if kind in _ELEMENTS:
            data = data.view(np.dtype(_ELEMENTS[kind]).newbyteorder(self._order)).reshape(rows)
        else:
            data = data.reshape(quant_shape_to_byte_shape(rows, kind))
        return GGUFTensor(name, kind, shape, data)
