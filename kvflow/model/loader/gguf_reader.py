"""A fast GGUF reader: the file's metadata as Python values and its tensors as numpy views of a
memory map, the same views gguf.GGUFReader gives (typed for F32/F16/F64/I*, raw bytes shaped by
gguf.quants.quant_shape_to_byte_shape for quantised types), so gguf.quants.dequantize takes them.

Why not GGUFReader itself: it builds a numpy view per array element, which for SmolLM2's 49k-token
vocabulary and 48k merges took ~2 s of the default model's ~3.3 s load. Here those arrays are
decoded in one pass over the bytes. The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

# GGUF value types -> struct format of one scalar (8 = string, 9 = array: handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]          # as GGUF lists the dims: innermost first
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class GGUFFile:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._mm = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._mm)
        self._pos = 0
        magic, version = self._buf[:4].tobytes(), self._unpack("<4xI")[0]
        if magic != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (magic {magic!r})")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._unpack("<QQ")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(qtype), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        s = self._buf[self._pos + 8:self._pos + 8 + n].tobytes().decode("utf-8", "replace")
        self._pos += 8 + n
        return s

    def _value(self, vtype: int):
        if vtype == 8:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        if vtype != 9:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        itype, count = self._unpack("<IQ")
        if itype == 8:      # the vocabulary and merges: one pass, no per-item numpy views
            buf, pos, out = self._buf, self._pos, []
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, pos)
                out.append(buf[pos + 8:pos + 8 + n].tobytes().decode("utf-8", "replace"))
                pos += 8 + n
            self._pos = pos
            return out
        if itype in _NUMPY:
            dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
            arr = np.frombuffer(self._buf, dt, count, self._pos)
            self._pos += count * dt.itemsize
            return arr.tolist()
        return [self._value(itype) for _ in range(count)]     # arrays of arrays

    def _tensor(self, start: int, name: str, dims: tuple, qtype, offset: int) -> GGUFTensor:
        np_dims = tuple(reversed(dims))
        n_elems = int(np.prod(dims))
        if qtype in _TYPED:
            dt, count = np.dtype(_TYPED[qtype]), n_elems
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            dt, count = np.dtype(np.uint8), n_elems // block * type_size
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        data = np.frombuffer(self._mm, dt, count, start + offset).reshape(np_dims)
        return GGUFTensor(name, tuple(int(d) for d in dims), qtype, data)
