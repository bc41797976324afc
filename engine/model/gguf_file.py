"""A fast reader of GGUF files: the metadata as Python values, the tensors as memory-mapped arrays.

`gguf.GGUFReader` builds a numpy view for every part of every metadata field: for a
vocabulary of 49,152 tokens and as many merges that is ~250,000 memmap views and 2.7 s on a
2-core machine, paid by every process that opens the model (the API server, the EngineCore,
each tensor-parallel rank, each test). This reader walks the same layout with `struct` over
one `mmap` and decodes a string array in one loop: tens of milliseconds.

The layout (little-endian; GGUF versions 2 and 3): magic `GGUF`, version u32, tensor count
u64, metadata count u64; per metadata entry a string key, a u32 value type and the value
(strings are u64 length + UTF-8 bytes; arrays a u32 element type, a u64 count, the
elements); per tensor a string name, u32 dimension count, u64 dimensions (fastest first),
u32 ggml type, u64 offset from the data section, which starts at the next multiple of
`general.alignment` (default 32) after the tensor table.

A tensor's `data` has the shape `gguf.GGUFReader` gives it, so `gguf.quants.dequantize`
takes it unchanged: an element array in row-major shape for F16/F32/F64/I8..I64, the raw
bytes shaped `[..., bytes per row]` for quantized and BF16 types.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# ggml types whose data is an element array (the rest are bytes): F32, F16, I8, I16, I32, I64, F64
_ELEMENT_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                  28: np.float64}  # fmt: skip


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # a read-only view of the file


class GGUFFile:
    """`metadata` (key -> int, float, bool, str, or list of those) and `tensors`, in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"model: {str(self.path)!r} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"model: {str(self.path)!r}: GGUF version {version} is not supported (2 or 3)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), int(ggml_type), int(offset)))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, t, start + off) for name, dims, t, off in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._map[start:start + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype][0])[0]
        if vtype != _ARRAY:
            raise ValueError(f"model: {str(self.path)!r}: unknown GGUF value type {vtype}")
        etype, count = self._unpack("<IQ")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            values = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        if etype == _STRING:
            return self._strings(count)
        return [self._value(etype) for _ in range(count)]  # arrays of arrays

    def _strings(self, count: int) -> list[str]:
        buf, pos, out = self._map, self._pos, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def _tensor(self, name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(ggml_type)
        rows_first = tuple(reversed(dims))
        n_elems = int(np.prod(dims)) if dims else 1
        if ggml_type in _ELEMENT_TYPES:
            dtype = np.dtype(_ELEMENT_TYPES[ggml_type])
            data = np.frombuffer(self._map, dtype, n_elems, offset).reshape(rows_first)
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            data = np.frombuffer(self._map, np.uint8, n_elems * type_size // block, offset)
            data = data.reshape(quant_shape_to_byte_shape(rows_first, qtype))
        return GGUFTensor(name, qtype, dims, data)
