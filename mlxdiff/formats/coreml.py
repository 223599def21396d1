"""Core ML packages (.mlpackage, made by coremltools) read without coremltools: their weights, palettized ones kept as
indices and tables, decoded exactly as coremltools.optimize.coreml.decompress_weights does.

The layout (coremltools 9, mlmodel/format/MIL.proto, mlmodel/src/MILBlob/Blob/StorageFormat.hpp):
- `X.mlpackage/Manifest.json` names the root item, normally `Data/com.apple.CoreML/model.mlmodel`: a protobuf
  CoreML.Specification.Model whose field 502 is the MIL program. It is read here with a small protobuf wire-format
  reader and the field numbers below (a protobuf's field numbers are its compatibility contract), so no generated
  modules and no coremltools at run time.
- Weights are values of `const` ops or inputs of `constexpr_*` ops, either immediate (in the protobuf) or a
  BlobFileValue (file `@model_path/weights/weight.bin`, offset): the blob file is a 64-byte header (u32 count,
  u32 version = 2) then 64-aligned pairs of a 64-byte blob_metadata (u32 sentinel 0xDEADBEEF, u32 dtype, u64 size,
  u64 data offset, u64 padding bits) and the data. A value's offset points at its metadata.
- Sub-byte values (uint1/2/3/4/6, int4) are one little-endian bit string: element i at bits n*i .. n*i+n-1, the
  low bits of a byte first (MILBlob/SubByteTypes.cpp), padded to whole bytes.

The palettized forms coremltools makes (optimize/coreml/_quantization_passes.py, ops/defs/iOS16 + iOS18):
- iOS 16 `constexpr_lut_to_dense(indices: uint8 packed bits, lut: [2**n], shape: uint32)`: one table per tensor.
- iOS 18 `constexpr_lut_to_dense(indices: uintN [weight shape], lut: [g0, .., gk, 2**n, V], vector_axis)`: a table
  per block of the weight (block size along axis i = shape[i] / g_i: per tensor, or per group of channels on
  axis 0 or 1), V > 1 for vector palettes (`cluster_dim`).
- The lut may itself be `constexpr_blockwise_shift_scale(data, scale, offset)` (per-channel scale before iOS 26,
  int8 tables of joint compression); from iOS 26 the scale may follow the lut instead
  (`constexpr_blockwise_shift_scale(lut_to_dense(..), scale)`). Either way the value is the one decompress_weights
  computes: its numpy steps are repeated here in the same dtypes, so the weights agree bit for bit.
Other constexpr ops (sparse, affine int8 of iOS 16, casts) are refused in one line.

`read(path)` gives {weight name: np.ndarray (dense) | LutWeight}; a LutWeight keeps the table and unpacks its indices
when asked, `.dense()` is its exact decode and `.palettized(layout)` is formats/palettized's form when it fits (tables
per group of output rows, no vector palettes, no scale on another axis). `read_diffusers(...)` maps the names of a
model traced from diffusers' modules (torch.jit.trace + ct.convert) back onto the state dict's, and those of Apple's
ml-stable-diffusion conversion (apple/ml-stable-diffusion, torch2coreml.py): the same module paths, traced without a
wrapper, every Linear a 1x1 convolution ([out, in, 1, 1], read as [out, in]), its LayerNorms fused by the converter
into layer_norm ops (found by dataflow, LAYER_NORM_BEFORE). How far that goes: one .mlpackage UNet (the form
`--chunk-unet` splits in two is not joined; compiled .mlmodelc folders, whose program is MIL text, are not read).
"""

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from ..errors import MlxdiffError

# -- protobuf wire format ------------------------------------------------------------------------------------------

MODEL_PROGRAM = 502      # Model.mlProgram
MODEL_VERSION = 1        # Model.specificationVersion
# MIL.proto field numbers, per message
PROGRAM = dict(functions=2)
FUNCTION = dict(opset=2, blocks=3)
BLOCK = dict(operations=3)
OPERATION = dict(type=1, inputs=2, outputs=3, blocks=4, attributes=5)
NAMED_TYPE = dict(name=1, type=2)
VALUE = dict(type=2, immediate=3, blob=5)


class _Bad(Exception):
    """A malformed protobuf or blob; read() turns it into one MlxdiffError line naming the file."""


def _varint(buf, i, end):
    shift = value = 0
    while True:
        if i >= end or shift > 63:
            raise _Bad("truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf, span=None):
    """{field number: [values]} of one message in buf[start:end]: ints for varints and fixed fields, (start, end)
    spans for length-delimited ones (submessages, strings, bytes, packed arrays)."""
    start, end = span or (0, len(buf))
    out = {}
    i = start
    while i < end:
        key, i = _varint(buf, i, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i, end)
        elif wire == 2:
            size, i = _varint(buf, i, end)
            if size > end - i:
                raise _Bad("a field runs past its message")
            value, i = (i, i + size), i + size
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if i + n > end:
                raise _Bad("truncated fixed-size field")
            value, i = bytes(buf[i:i + n]), i + n
        else:
            raise _Bad(f"unsupported wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def _one(fields, number, default=None):
    values = fields.get(number)
    return values[-1] if values else default


def _text(buf, span):
    try:
        return bytes(buf[span[0]:span[1]]).decode("utf-8")
    except (UnicodeDecodeError, TypeError):
        raise _Bad("a name is not UTF-8 text") from None


def _map(buf, spans, value_fn):
    """A protobuf map<string, V>: its entries (key = 1, value = 2)."""
    out = {}
    for span in spans or ():
        entry = _fields(buf, span)
        key = _text(buf, _one(entry, 1, (0, 0)))
        out[key] = value_fn(_one(entry, 2, (0, 0)))
    return out


# -- MIL data types ------------------------------------------------------------------------------------------------

# MIL.proto DataType -> (numpy dtype, bits, MILBlob BlobDataType); sub-byte types unpack to uint8 (int4: int8)
DTYPES = {
    10: (np.float16, 16, 1), 11: (np.float32, 32, 2), 31: (np.uint8, 8, 3), 21: (np.int8, 8, 4),
    22: (np.int16, 16, 6), 32: (np.uint16, 16, 7), 25: (np.int8, 4, 8), 37: (np.uint8, 1, 9), 36: (np.uint8, 2, 10),
    35: (np.uint8, 4, 11), 39: (np.uint8, 3, 12), 38: (np.uint8, 6, 13), 23: (np.int32, 32, 14),
    33: (np.uint32, 32, 15),
}
SIGNED_SUB_BYTE = {25}
DTYPE_NAMES = {1: "bool", 2: "string", 10: "fp16", 11: "fp32", 12: "fp64", 13: "bf16", 21: "int8", 22: "int16",
               23: "int32", 24: "int64", 25: "int4", 31: "uint8", 32: "uint16", 33: "uint32", 34: "uint64",
               35: "uint4", 36: "uint2", 37: "uint1", 38: "uint6", 39: "uint3", 40: "fp8e4m3", 41: "fp8e5m2"}
BLOB_SENTINEL = 0xDEADBEEF
BLOB_ALIGN = 64


def unpack_bits(packed: np.ndarray, nbits: int, count: int, signed: bool = False) -> np.ndarray:
    """The first `count` n-bit elements of a little-endian bit string (uint8 bytes) as uint8 (int8 if signed)."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    if nbits == 8:
        out = packed[:count].copy()
    elif 8 % nbits == 0:                                   # 1, 2, 4 bits: whole elements per byte
        per = 8 // nbits
        shifts = np.arange(0, 8, nbits, dtype=np.uint8)
        out = ((packed[:, None] >> shifts) & ((1 << nbits) - 1)).reshape(-1)[:count]
    else:                                                  # 3, 6 bits: an element may straddle two bytes
        start = np.arange(count, dtype=np.int64) * nbits
        byte, shift = start >> 3, (start & 7).astype(np.uint16)
        two = np.concatenate([packed, np.zeros(1, np.uint8)]).astype(np.uint16)
        out = (((two[byte] | (two[byte + 1] << 8)) >> shift) & ((1 << nbits) - 1)).astype(np.uint8)
    if signed:                                             # two's complement n-bit values
        out = out.astype(np.int16)
        out = np.where(out >= 1 << (nbits - 1), out - (1 << nbits), out).astype(np.int8)
    return out


class _Blobs:
    """weight.bin: checked once, each value read by the offset of its metadata."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
        except OSError as e:
            raise MlxdiffError(f"{path}: cannot read the weight file ({e.strerror or e}); re-download the model") from None
        if self.data.size < BLOB_ALIGN:
            raise self.bad("it is shorter than its 64-byte header")
        count, version = struct.unpack_from("<II", self.data, 0)
        if version != 2:
            raise self.bad(f"storage version {version}; only MIL blob storage version 2 is read")
        self.count = count

    def bad(self, what):
        return MlxdiffError(f"{self.path}: {what}; the weight file is truncated or damaged, re-download or "
                            "re-export the Core ML package")

    def read(self, offset: int, dtype_code: int, count: int) -> np.ndarray:
        np_dtype, bits, blob_type = DTYPES[dtype_code]
        if offset % BLOB_ALIGN or offset + BLOB_ALIGN > self.data.size:
            raise self.bad(f"blob offset {offset} is outside the weight file ({self.data.size} bytes) or misaligned")
        sentinel, kind, size, data_offset, padding = struct.unpack_from("<IIQQQ", self.data, offset)
        if sentinel != BLOB_SENTINEL:
            raise self.bad(f"no blob metadata at offset {offset} (sentinel {sentinel:#x})")
        if kind != blob_type:
            raise self.bad(f"blob at offset {offset} holds data type {kind}, the program says {blob_type}")
        need = math.ceil(count * bits / 8)
        if size != need:
            raise self.bad(f"blob at offset {offset} has {size} bytes, its {count} {DTYPE_NAMES[dtype_code]} values "
                           f"need {need}")
        if data_offset < offset + BLOB_ALIGN or data_offset + size > self.data.size:
            raise self.bad(f"blob data at {data_offset}..{data_offset + size} runs past the weight file "
                           f"({self.data.size} bytes)")
        raw = self.data[data_offset:data_offset + size]
        if bits < 8:
            return unpack_bits(raw, bits, count, dtype_code in SIGNED_SUB_BYTE)
        return np.frombuffer(raw, dtype=np.dtype(np_dtype).newbyteorder("<"), count=count).astype(np_dtype,
                                                                                                  copy=False)


# -- the program ---------------------------------------------------------------------------------------------------

class _Value:
    """A typed value of the program: dtype code, shape, and either a blob offset or immediate TensorValue fields."""

    def __init__(self, buf, span):
        f = _fields(buf, span)
        self.dtype, self.shape, self.blob, self.immediate = None, None, None, None
        vtype = _fields(buf, _one(f, VALUE["type"], (0, 0)))
        if 1 in vtype:                                     # ValueType.tensorType
            tt = _fields(buf, vtype[1][-1])
            self.dtype = _one(tt, 1, 0)
            dims = []
            for d in tt.get(3, ()):
                dim = _fields(buf, d)
                if 1 not in dim:
                    raise _Bad("a weight has a dynamic dimension")
                dims.append(_one(_fields(buf, dim[1][-1]), 1, 0))
            self.shape = tuple(dims)
        if VALUE["blob"] in f:
            bf = _fields(buf, f[VALUE["blob"]][-1])
            self.blob = (_text(buf, _one(bf, 1, (0, 0))), _one(bf, 2, 0))
        elif VALUE["immediate"] in f:
            imm = _fields(buf, f[VALUE["immediate"]][-1])
            if 1 in imm:                                   # ImmediateValue.tensor
                self.immediate = _fields(buf, imm[1][-1])
        self.buf = buf


class _Op:
    def __init__(self, buf, span):
        f = _fields(buf, span)
        self.type = _text(buf, _one(f, OPERATION["type"], (0, 0)))
        self.inputs = _map(buf, f.get(OPERATION["inputs"]), lambda s: self._bindings(buf, s))
        self.attributes = _map(buf, f.get(OPERATION["attributes"]), lambda s: _Value(buf, s))
        self.outputs = []
        for o in f.get(OPERATION["outputs"], ()):
            nt = _fields(buf, o)
            self.outputs.append(_text(buf, _one(nt, NAMED_TYPE["name"], (0, 0))))
        self.blocks = f.get(OPERATION["blocks"], [])

    @staticmethod
    def _bindings(buf, span):
        out = []
        for b in _fields(buf, span).get(1, ()):
            bf = _fields(buf, b)
            out.append(_text(buf, bf[1][-1]) if 1 in bf else _Value(buf, _one(bf, 2, (0, 0))))
        return out


def _operations(buf, block_span):
    for span in _fields(buf, block_span).get(BLOCK["operations"], ()):
        op = _Op(buf, span)
        yield op
        for inner in op.blocks:                            # control flow: weights may sit in nested blocks
            yield from _operations(buf, inner)


def _model_file(path: Path) -> Path:
    """The model.mlmodel of an .mlpackage folder (its Manifest.json's root item, else the usual place)."""
    if path.suffix == ".mlmodelc" or (path / "model.mil").exists():
        raise MlxdiffError(f"{path}: a compiled Core ML model (.mlmodelc) is not read; use the .mlpackage it was "
                           "compiled from (Apple's repositories ship both)")
    if not path.is_dir():
        raise MlxdiffError(f"{path}: not a Core ML package (expected an .mlpackage folder with "
                           "Data/com.apple.CoreML/model.mlmodel)")
    default = path / "Data" / "com.apple.CoreML" / "model.mlmodel"
    manifest = path / "Manifest.json"
    if manifest.is_file():
        try:
            info = json.loads(manifest.read_text())
            entry = info["itemInfoEntries"][info["rootModelIdentifier"]]
            candidate = (path / "Data" / entry["path"]).resolve()
            if candidate.is_relative_to(path.resolve()) and candidate.is_file():
                return candidate
        except (ValueError, KeyError, TypeError, OSError):
            pass                                           # a bad manifest: try the usual place
    if not default.is_file():
        raise MlxdiffError(f"{path}: not a Core ML package (no Data/com.apple.CoreML/model.mlmodel); pass the "
                           ".mlpackage folder coremltools saved")
    return default


# -- weights -------------------------------------------------------------------------------------------------------

class LutWeight:
    """A palettized weight of a Core ML program: `lut` [g0, .., gk, 2**nbits, V] (already through any shift_scale
    on the table, in coremltools' dtypes), `vector_axis`, optional `scale`/`offset` applied after the lookup (iOS 26
    order), the weight's `shape`; indices unpacked on demand (uint8 of the indices' shape)."""

    def __init__(self, name, shape, nbits, load_indices, lut, vector_axis=None, scale=None, offset=None):
        self.name, self.shape, self.nbits = name, tuple(shape), nbits
        self._load = load_indices
        self.lut, self.vector_axis, self.scale, self.offset = lut, vector_axis, scale, offset
        self.indices_shape = list(self.shape)
        if lut.shape[-1] > 1:
            self.indices_shape[vector_axis] //= lut.shape[-1]

    def indices(self) -> np.ndarray:
        return self._load()

    def dense(self) -> np.ndarray:
        """The weight, as coremltools' decompression computes it (optimize/_utils.lut_to_dense and
        constexpr_blockwise_shift_scale.decompress, step for step)."""
        out = _lut_to_dense(self.indices(), self.lut, self.vector_axis)
        if self.scale is not None:
            out = _shift_scale(out, self.scale, self.offset)
        return out

    @property
    def has_row_tables(self) -> bool:
        """Whether the tables are per group of rows (axis 0) and scalar and nothing scales the result:
        formats/palettized's form (nothing read)."""
        return self.lut.shape[-1] == 1 and self.scale is None and all(g == 1 for g in self.lut.shape[1:-2])

    def row_tables(self):
        """(indices [shape], lut [groups, 2**nbits]) in formats/palettized's form (has_row_tables); else None."""
        if not self.has_row_tables:
            return None
        return self.indices(), self.lut.reshape(self.lut.shape[0], -1)

    def palettized(self, conv_nhwc: bool = False):
        """formats/palettized.PalettizedWeight of this weight (a conv's indices moved to mlxdiff's [out, kh, kw, in]
        first when conv_nhwc), or None when its tables do not fit that form (dense() then)."""
        fit = self.row_tables()
        if fit is None:
            return None
        from .palettized import palettized
        indices, lut = fit
        if conv_nhwc and indices.ndim == 4:
            indices = indices.transpose(0, 2, 3, 1)
        return palettized(np.ascontiguousarray(indices), lut)

    def as_linear(self) -> "LutWeight":
        """This [out, in, 1, 1] weight (a Linear converted as a 1x1 convolution, Apple's ml-stable-diffusion) as the
        [out, in] weight it is: the same indices and tables, the two unit axes dropped (their tables' block axes
        are 1 as well, as the axes themselves are)."""
        if len(self.shape) != 4 or self.shape[2:] != (1, 1) or self.lut.shape[2:4] != (1, 1) or \
                (self.lut.shape[-1] > 1 and self.vector_axis % 4 >= 2) or \
                (self.scale is not None and self.scale.ndim == 4 and self.scale.shape[2:] != (1, 1)) or \
                (self.offset is not None and self.offset.ndim == 4 and self.offset.shape[2:] != (1, 1)):
            raise MlxdiffError(f"{self.name}: a {list(self.shape)} weight is not a 1x1 convolution's")
        load, indices_shape = self._load, tuple(self.indices_shape[:2])
        return LutWeight(self.name, self.shape[:2], self.nbits, lambda: load().reshape(indices_shape),
                         self.lut.reshape(self.lut.shape[:2] + self.lut.shape[4:]),
                         None if self.vector_axis is None else self.vector_axis % 4,
                         _unit_axes_dropped(self.scale), _unit_axes_dropped(self.offset))

    def __repr__(self):
        return (f"LutWeight({self.name!r}, shape={self.shape}, {self.nbits}-bit, tables={self.lut.shape[:-2]}, "
                f"vector={self.lut.shape[-1]}" + (", scaled" if self.scale is not None else "") + ")")


def _unit_axes_dropped(a):
    """A [a, b, 1, 1] block array (a 1x1 convolution's scale or offset) as [a, b]; None and others as they are."""
    return a.reshape(a.shape[:2]) if a is not None and a.ndim == 4 else a


def _repeat_to(data: np.ndarray, shape) -> np.ndarray:
    for axis, (have, want) in enumerate(zip(data.shape, shape)):
        if want != have:
            data = np.repeat(data, want // have, axis)
    return data


def _shift_scale(data, scale, offset):
    """constexpr_blockwise_shift_scale.decompress: scale * (data - offset), blocks repeated, in scale's dtype."""
    data = data.astype(scale.dtype)
    scale = _repeat_to(scale, data.shape)
    if offset is not None:
        data = data - _repeat_to(offset, data.shape)
    return scale * data


def _lut_to_dense(indices, lut, vector_axis):
    """optimize/_utils.lut_to_dense: each element's table is the one of its block (block sizes = indices' shape /
    the lut's leading dims); a vector palette fills VECTOR_SIZE consecutive elements along vector_axis."""
    vector = lut.shape[-1]
    if vector > 1:
        axis = vector_axis + indices.ndim if vector_axis < 0 else vector_axis
        indices = np.swapaxes(indices, -1, axis)
        lut = np.swapaxes(lut, -3, axis)
    tables = _repeat_to(lut, indices.shape + lut.shape[-2:])
    out = np.take_along_axis(tables, indices.astype(np.intp)[..., None, None], axis=-2)[..., 0, :]
    out = out.reshape(indices.shape[:-1] + (indices.shape[-1] * vector,))
    return np.swapaxes(out, -1, axis) if vector > 1 else out


class _Program:
    READ = ("const", "constexpr_lut_to_dense", "constexpr_blockwise_shift_scale")

    def __init__(self, path: Path):
        self.path = path
        self.model_file = _model_file(path)
        try:
            buf = memoryview(self.model_file.read_bytes())
        except OSError as e:
            raise MlxdiffError(f"{self.model_file}: cannot read it ({e.strerror or e})") from None
        self.buf = buf
        _guard(self.model_file, self._parse)

    def _parse(self):
        buf = self.buf
        model = _fields(buf)
        if MODEL_PROGRAM not in model:
            raise MlxdiffError(f"{self.model_file}: not an ML program (a neural-network-format Core ML model or "
                               "another kind); only mlprogram packages (convert_to=\"mlprogram\") are read")
        program = _fields(buf, model[MODEL_PROGRAM][-1])
        functions = _map(buf, program.get(PROGRAM["functions"]), lambda s: s)
        if not functions:
            raise _Bad("the program has no functions")
        function = _fields(buf, functions.get("main", next(iter(functions.values()))))
        opset = _text(buf, _one(function, FUNCTION["opset"], (0, 0)))
        blocks = _map(buf, function.get(FUNCTION["blocks"]), lambda s: s)
        if opset not in blocks:
            raise _Bad(f"the main function has no block for its opset {opset!r}")
        self.opset = opset
        self.ops = list(_operations(buf, blocks[opset]))
        self.producer = {name: op for op in self.ops for name in op.outputs}
        self.consumers = {}
        for op in self.ops:
            for key, bindings in op.inputs.items():
                for b in bindings:
                    if isinstance(b, str):
                        self.consumers.setdefault(b, []).append((op, key))
        self._blobs = None

    # values

    def blobs(self) -> _Blobs:
        if self._blobs is None:
            self._blobs = _Blobs(self.model_file.parent / "weights" / "weight.bin")
        return self._blobs

    def value(self, v: _Value) -> np.ndarray:
        """A tensor value as numpy (sub-byte types unpacked to uint8 / int8)."""
        if v.dtype not in DTYPES:
            raise _Bad(f"a weight of data type {DTYPE_NAMES.get(v.dtype, v.dtype)}, which is not read")
        np_dtype, bits, _ = DTYPES[v.dtype]
        shape = v.shape if v.shape is not None else ()
        count = math.prod(shape)
        if v.blob is not None:
            name, offset = v.blob
            if Path(name).name != "weight.bin" or ".." in name:
                raise _Bad(f"a weight in blob file {name!r}; only weights/weight.bin is read")
            return self.blobs().read(offset, v.dtype, count).reshape(shape)
        if v.immediate is None:
            raise _Bad("a weight has neither a blob nor an immediate value")
        return self._immediate(v, np_dtype, bits, count).reshape(shape)

    def _immediate(self, v, np_dtype, bits, count):
        """An immediate TensorValue: fp16, 8-bit and sub-byte types, uint32 in `bytes` (packed as in blobs), fp32 in
        `floats`, other ints in `ints` (coremltools' backend/mil/helper._tensor_field_by_type)."""
        t, buf = v.immediate, self.buf
        if 7 in t:                                         # bytes
            s = _one(_fields(buf, t[7][-1]), 1, (0, 0))
            raw = np.frombuffer(bytes(buf[s[0]:s[1]]), np.uint8)
            if bits < 8:
                need = math.ceil(count * bits / 8)
                if raw.size != need:
                    raise _Bad(f"an immediate {DTYPE_NAMES[v.dtype]} value has {raw.size} bytes, expected {need}")
                return unpack_bits(raw, bits, count, v.dtype in SIGNED_SUB_BYTE)
            if raw.size != count * bits // 8:
                raise _Bad(f"an immediate {DTYPE_NAMES[v.dtype]} value has {raw.size} bytes for {count} values")
            return raw.view(np.dtype(np_dtype).newbyteorder("<")).astype(np_dtype)
        if 1 in t:                                         # floats, packed
            s = _one(_fields(buf, t[1][-1]), 1, (0, 0))
            raw = bytes(buf[s[0]:s[1]])
            out = np.frombuffer(raw, "<f4")
        elif 2 in t or 5 in t:                             # ints / longInts: packed varints
            s = _one(_fields(buf, t[2 if 2 in t else 5][-1]), 1, (0, 0))
            vals, i = [], s[0]
            while i < s[1]:
                x, i = _varint(buf, i, s[1])
                vals.append(x - (1 << 64) if x >= 1 << 63 else x)
            out = np.array(vals, np.int64)
        else:
            raise _Bad(f"an immediate {DTYPE_NAMES.get(v.dtype, v.dtype)} value in an unexpected field")
        if out.size != count:
            raise _Bad(f"an immediate value has {out.size} elements, its type says {count}")
        return out.astype(np_dtype)

    def arg(self, op, key, optional=False):
        """An op's input `key` (iOS 18 form) or attribute `key` (iOS 16 form): a _Value or a name."""
        if key in op.inputs and op.inputs[key]:
            return op.inputs[key][0]
        if key in op.attributes:
            return op.attributes[key]
        if optional:
            return None
        raise _Bad(f"op {op.outputs[0] if op.outputs else op.type} ({op.type}) has no {key!r}")

    def tensor(self, binding, depth=0):
        """The numpy value of a binding: an immediate/blob value, or a const / shift_scale op's output."""
        if not isinstance(binding, str):
            return self.value(binding)
        op = self.producer.get(binding)
        if op is None:
            raise _Bad(f"{binding!r} is not a constant of the program")
        if op.type == "const":
            return self.value(op.attributes["val"]) if "val" in op.attributes else self.tensor(self.arg(op, "val"))
        if op.type == "constexpr_blockwise_shift_scale" and depth < 4:
            offset = self.arg(op, "offset", optional=True)
            return _shift_scale(self.tensor(self.arg(op, "data"), depth + 1), self.tensor(self.arg(op, "scale"), depth + 1),
                                None if offset is None else self.tensor(offset, depth + 1))
        if op.type == "constexpr_lut_to_dense" and depth < 4:
            return self.weight(binding).dense()
        raise MlxdiffError(f"{self.model_file}: weight {binding!r} comes from a {op.type} op, which mlxdiff does not "
                           "read (it reads const, constexpr_lut_to_dense and constexpr_blockwise_shift_scale); "
                           "re-export the package palettized or in float16 (coremltools decompress_weights)")

    def weight(self, name):
        """One weight: a LutWeight for a lut_to_dense (or a shift_scale of one), else a dense numpy array."""
        op = self.producer[name]
        if op.type == "constexpr_blockwise_shift_scale":
            data = self.arg(op, "data")
            if isinstance(data, str) and self.producer.get(data) is not None and \
                    self.producer[data].type == "constexpr_lut_to_dense":
                inner = self.weight(data)
                if inner.scale is None:
                    offset = self.arg(op, "offset", optional=True)
                    inner.scale = self.tensor(self.arg(op, "scale"))
                    inner.offset = None if offset is None else self.tensor(offset)
                    inner.name = name
                    return inner
            return self.tensor(name)
        if op.type != "constexpr_lut_to_dense":
            return self.tensor(name)
        indices_v, lut = self.arg(op, "indices"), self.tensor(self.arg(op, "lut"))
        if isinstance(indices_v, str):
            raise _Bad(f"op {name!r}: its indices are not a constant value")
        shape_v = self.arg(op, "shape", optional=True)
        if shape_v is not None:                            # iOS 16: packed uint8 bytes, 1-D table, shape
            shape = tuple(int(s) for s in self.tensor(shape_v).reshape(-1))
            if lut.ndim != 1 or lut.size not in (2, 4, 16, 64, 256):
                raise _Bad(f"op {name!r}: an iOS 16 table of shape {lut.shape}")
            nbits = lut.size.bit_length() - 1
            count = math.prod(shape)
            if indices_v.dtype != 31 or indices_v.shape != (math.ceil(count * nbits / 8),):
                raise _Bad(f"op {name!r}: {nbits}-bit indices of {count} elements do not fit their packed bytes "
                           f"{indices_v.shape}")
            lut = lut.reshape((1,) * len(shape) + (lut.size, 1))
            return LutWeight(name, shape, nbits, self._later(
                lambda: unpack_bits(self.value(indices_v), nbits, count).reshape(shape)), lut)
        # iOS 18: indices uintN of the indices' shape, lut [blocks.., 2**n, V]
        if indices_v.dtype not in DTYPES or DTYPES[indices_v.dtype][0] is not np.uint8:
            raise _Bad(f"op {name!r}: indices of type {DTYPE_NAMES.get(indices_v.dtype, indices_v.dtype)}")
        shape, nbits = indices_v.shape, DTYPES[indices_v.dtype][1]
        if lut.ndim != len(shape) + 2 or lut.shape[-2] != 1 << nbits or \
                any(s % g for s, g in zip(shape, lut.shape[:-2])):
            raise _Bad(f"op {name!r}: a table of shape {lut.shape} for {nbits}-bit indices of shape {shape}")
        axis_v = self.arg(op, "vector_axis", optional=True)
        axis = None if axis_v is None else int(self.tensor(axis_v).reshape(-1)[0])
        if lut.shape[-1] > 1 and (axis is None or not -len(shape) <= axis < len(shape)):
            raise _Bad(f"op {name!r}: a vector table without a valid vector_axis")
        out_shape = list(shape)
        if lut.shape[-1] > 1:
            out_shape[axis] *= lut.shape[-1]
        return LutWeight(name, out_shape, nbits, self._later(lambda: self.value(indices_v)), lut, axis)

    def _later(self, load):
        """A loader of indices run when asked, its bad input still one MlxdiffError line."""
        return lambda: _guard(self.model_file, load)

    def weights(self) -> dict:
        """{name: LutWeight | np.ndarray} of every float constant the program's compute ops read (the ends of the
        constexpr chains; constexpr ops the reader does not know are refused when one is met)."""
        out = {}
        for op in self.ops:
            if op.type.startswith("constexpr_") and op.type not in self.READ:
                raise MlxdiffError(f"{self.model_file}: op {op.outputs[0] if op.outputs else '?'} is a {op.type}, "
                                   "which mlxdiff does not read (it reads const, constexpr_lut_to_dense and "
                                   "constexpr_blockwise_shift_scale); palettize the model with coremltools instead")
            if op.type not in self.READ or not op.outputs:
                continue
            name = op.outputs[0]
            users = self.consumers.get(name, [])
            if users and all(u.type.startswith("constexpr_") for u, _ in users):
                continue                                   # an intermediate of a chain: its end is the weight
            if op.type == "const":
                val = op.attributes.get("val")
                if val is None or val.dtype not in (10, 11) or not val.shape:
                    continue                               # scalars, strings, int shapes: not weights
            out[name] = self.weight(name)
        return out


def _guard(path, fn):
    try:
        return fn()
    except _Bad as e:
        raise MlxdiffError(f"{path}: {e}; the Core ML package is damaged or not one coremltools made, "
                           "re-export or re-download it") from None
    except (IndexError, KeyError, TypeError, ValueError, OverflowError, struct.error, MemoryError) as e:  # unforeseen
        raise MlxdiffError(f"{path}: unreadable Core ML program ({type(e).__name__}: {e}); re-export or "
                           "re-download it") from None


def read(path) -> dict:
    """{weight name: np.ndarray | LutWeight} of an .mlpackage (module docstring). Bad input: one MlxdiffError line."""
    path = Path(path)
    if not path.exists():
        raise MlxdiffError(f"{path}: no such Core ML package")
    program = _guard(path, lambda: _Program(path))
    return _guard(program.model_file, program.weights)


def decode_all(weights: dict) -> dict:
    """{name: dense numpy} of read()'s output (exact)."""
    return {k: v.dense() if isinstance(v, LutWeight) else v for k, v in weights.items()}


# -- names: a model traced from diffusers' modules ------------------------------------------------------------------

# What coremltools appends to a traced parameter's name (fp16 cast, palettization, per-channel scale, joint tables)
SUFFIXES = ("_palettized", "_pcs", "_quantized", "_lut_0", "_to_fp16", "_to_fp32")
# The torch frontend folds a GroupNorm's affine into a batch_norm named after its op ("add_1"), which loses the
# module's name; its output reaches the next named layer, whose sibling the norm is: {next layer: the norm}.
NORM_BEFORE = {"conv1": "norm1", "conv2": "norm2", "proj_in": "norm", "conv_out": "conv_norm_out",
               "to_q": "group_norm", "to_k": "group_norm", "to_v": "group_norm"}
# The same for the LayerNorms of a transformer block where the converter fused them into a layer_norm op with
# op-made names (Apple's ml-stable-diffusion computes them by hand, unet.py's LayerNormANE): {path from the block
# to the next layer: the block's norm}.
LAYER_NORM_BEFORE = {"attn1.to_q": "norm1", "attn1.to_k": "norm1", "attn1.to_v": "norm1", "attn2.to_q": "norm2",
                     "ff.net.0.proj": "norm3"}
NORM_OPS = {"batch_norm": NORM_BEFORE, "layer_norm": LAYER_NORM_BEFORE}
NORM_HOPS = 12


def _sanitized(name: str) -> str:
    """coremltools' NameSanitizer: any character outside [A-Za-z0-9_] becomes '_'."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _base(const: str) -> str:
    changed = True
    while changed:
        changed = False
        for s in SUFFIXES:
            if const.endswith(s) and len(const) > len(s):
                const, changed = const[:-len(s)], True
    return const


def read_diffusers(path, targets: dict, prefix: str = "") -> dict:
    """{state-dict name: np.ndarray | LutWeight} for `targets` ({name: torch shape}) from an .mlpackage converted
    from those modules by torch.jit.trace + ct.convert (`prefix`: the traced wrapper's attribute path, e.g. "unet_"
    for a wrapper holding the model as `self.unet`; None: found from the names, see _find_prefix). Names are the tracer's (dots -> '_', plus coremltools'
    suffixes), checked by shape; GroupNorm affines (renamed by the converter) are found by dataflow (NORM_BEFORE).
    A name the package lacks, or a shape that differs, is refused in one line."""
    path = Path(path)
    if not path.exists():
        raise MlxdiffError(f"{path}: no such Core ML package")
    program = _guard(path, lambda: _Program(path))
    weights = _guard(program.model_file, program.weights)
    by_base = {}
    for const in weights:
        by_base.setdefault(_base(const), []).append(const)
    if prefix is None:
        prefix = _find_prefix(by_base, targets)
    found, missing = {}, []
    for name in targets:
        s = _sanitized(prefix + name)
        hits = next((by_base[c] for c in (s, "op_" + s, "var_" + s, "_" + s) if c in by_base), None)
        if hits and len(hits) == 1:
            found[name] = hits[0]
        else:
            missing.append(name)
    if missing:
        found.update(_guard(program.model_file, lambda: _norms_by_dataflow(program, weights, targets, found, prefix)))
    missing = [n for n in targets if n not in found]
    if missing:
        raise MlxdiffError(f"{program.model_file}: {len(missing)} of {len(targets)} weights not found by name "
                           f"(e.g. {', '.join(missing[:3])}); the package was not converted from these diffusers "
                           "modules (torch.jit.trace of them, or Apple's ml-stable-diffusion of the same config)")
    out = {}
    for name, const in found.items():
        value = weights[const]
        shape = tuple(value.shape)
        if len(targets[name]) == 2 and shape == (*targets[name], 1, 1):   # a Linear converted as a 1x1 convolution
            value = value.as_linear() if isinstance(value, LutWeight) else value.reshape(shape[:2])
            shape = shape[:2]
        if shape != tuple(targets[name]):
            raise MlxdiffError(f"{program.model_file}: {const} has shape {list(shape)}, {name} expects "
                               f"{list(targets[name])}; the package was converted from another configuration")
        out[name] = value
    return out


def _norm_before(layer: str, table: dict):
    """The norm whose output `layer` reads first, by `table` ({path suffix: the norm beside its start}), or None."""
    for suffix, norm in table.items():
        if layer == suffix or layer.endswith("." + suffix):
            parent = layer[:-len(suffix)]
            return parent + norm
    return None


def _norms_by_dataflow(program, weights, targets, found, prefix):
    """GroupNorm / LayerNorm gamma and beta (batch_norm / layer_norm inputs with op-made names) -> their module:
    follow the norm op's output forward to the first layer with a named weight; NORM_OPS' table for that op names
    the norm beside it."""
    named = {}                                             # sanitized layer path -> state-dict layer path
    for name, const in found.items():
        if name.endswith(".weight"):
            named[_base(const)[:-len("_weight")]] = name[:-len(".weight")]
    out = {}
    for op in program.ops:
        if op.type not in NORM_OPS or not op.outputs:
            continue
        layer = _next_named_layer(program, op.outputs[0], named)
        norm = None if layer is None else _norm_before(layer, NORM_OPS[op.type])
        if norm is None:
            continue
        for key, param in (("gamma", "weight"), ("beta", "bias")):
            binding = op.inputs.get(key, [None])[0]
            target = f"{norm}.{param}"
            if isinstance(binding, str) and binding in weights and target in targets and target not in found:
                out[target] = binding
    return out


def _next_named_layer(program, var, named):
    frontier, seen = [var], set()
    for _ in range(NORM_HOPS):
        step = []
        for v in frontier:
            for op, _ in program.consumers.get(v, ()):
                w = op.inputs.get("weight", [None])[0]
                if isinstance(w, str) and _base(w).endswith("_weight") and _base(w)[:-len("_weight")] in named:
                    return named[_base(w)[:-len("_weight")]]
                for o in op.outputs:
                    if o not in seen:
                        seen.add(o)
                        step.append(o)
        frontier = step
    return None


def _find_prefix(by_base: dict, targets: dict) -> str:
    """The traced wrapper's attribute path ("" for the model traced itself, "unet_" for `self.unet`, ...): the one
    that most target names (the longest few, which no other layer's name ends with) appear under."""
    bases = list(by_base)
    votes = {}
    for name in sorted(targets, key=len, reverse=True)[:16]:
        s = _sanitized(name)
        for b in bases:
            if b == s or b.endswith("_" + s):
                p = b[:-len(s)]
                votes[p] = votes.get(p, 0) + 1
    return max(votes, key=votes.get) if votes else ""


def _kept(name, value, linear, convs):
    """`value` (a LutWeight) as formats/palettized's form where it stays palettized: a Linear's 2-D weight, or a
    convolution's kernel with its indices in mlxdiff's [out, kh, kw, in] order (loading/quantize.PalettizedConv2d;
    the model's sanitize leaves that layout as it is); None where it is decoded."""
    if name in linear and len(value.shape) == 2:
        return value.palettized()
    if name in convs and len(value.shape) == 4:
        return value.palettized(conv_nhwc=True)
    return None


def open_diffusers(path, targets: dict, linear=frozenset(), convs=frozenset(), prefix=None) -> dict:
    """{state-dict name: mx.array | formats/palettized.PalettizedWeight} of `targets` ({name: torch shape}) from an
    .mlpackage converted from those diffusers modules (read_diffusers): a palettized weight of a name in `linear` (a
    Linear layer's weight) or `convs` (a Conv2d's) stays palettized where its tables fit formats/palettized's form
    (LutWeight.palettized); every other weight (norms, biases, tables that do not fit) is decoded exactly, in the
    package's dtype (float16 as ct.convert stores it)."""
    import mlx.core as mx
    found = read_diffusers(path, targets, prefix)
    out = {}
    for name, value in found.items():
        if isinstance(value, LutWeight):
            kept = _kept(name, value, linear, convs)
            out[name] = kept if kept is not None else mx.array(value.dense())
        else:
            out[name] = mx.array(value)
    return out


def shapes(path) -> dict:
    """{const name: shape} of a package's weights (the program only; no weight is read)."""
    return {k: tuple(v.shape) for k, v in read(path).items()}


def nbytes(path) -> dict:
    """{const name: bytes as stored} of a package's weights (a palettized one: its packed indices and its tables)."""
    out = {}
    for name, v in read(path).items():
        if isinstance(v, LutWeight):
            out[name] = math.ceil(math.prod(v.indices_shape) * v.nbits / 8) + int(v.lut.nbytes)
        else:
            out[name] = int(v.nbytes)
    return out


def loaded_nbytes(path, targets: dict, linear=frozenset(), convs=frozenset(), prefix=None) -> int:
    """Bytes open_diffusers' weights take (nothing decoded): a palettized Linear or Conv2d weight whose tables fit
    formats/palettized's form its rows of packed indices and its tables, any other weight decoded in its dtype."""
    from .palettized import row_bytes
    total = 0
    for name, v in read_diffusers(path, targets, prefix).items():
        if not isinstance(v, LutWeight):
            total += int(v.nbytes)
        elif ((name in linear and len(v.shape) == 2) or (name in convs and len(v.shape) == 4)) and v.has_row_tables:
            total += v.shape[0] * row_bytes(math.prod(v.shape[1:]), v.nbits) + int(v.lut.nbytes)
        else:
            total += math.prod(v.shape) * v.lut.dtype.itemsize
    return total
