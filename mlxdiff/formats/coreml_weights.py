"""A Core ML program's weights: `read(path)` gives {weight name: np.ndarray (dense) | LutWeight}, palettized
ones kept as indices and tables, decoded exactly as coremltools.optimize.coreml.decompress_weights does.

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

A LutWeight keeps the table and unpacks its indices when asked, `.dense()` is its exact decode and
`.palettized(layout)` is formats/palettized's form when it fits (tables per group of output rows, no vector
palettes, no scale on another axis).
"""

import math
from pathlib import Path

import numpy as np

from ..errors import MlxdiffError
from .coreml_mil import (BLOCK, DTYPE_NAMES, DTYPES, FUNCTION, MODEL_PROGRAM, MODEL_VERSION, PROGRAM, SIGNED_SUB_BYTE,
                         VALUE_KINDS, _Bad, _Blobs, _fields, _guard, _map, _model_file, _one, _operations, _text,
                         _Value, _varint, check_text, inside_package, named_type, unpack_bits)
from .palettized import palettized


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


# MIL opsets and the oldest Model.specificationVersion whose ops they are (coremltools' _OPSET): Core ML reads a
# program's ops by the spec version, so an older one makes them other ops; NEWEST_VERSION: iOS 26, coremltools 9's.
OPSET_VERSIONS = {"CoreML5": 6, "CoreML6": 7, "CoreML7": 8, "CoreML8": 9, "CoreML9": 10}
OLDEST_PROGRAM_VERSION, NEWEST_VERSION = 6, 10
# data types a const may hold that coremltools reads (not bf16 or the fp8 types)
CONST_DTYPES = frozenset(DTYPE_NAMES) - {13, 40, 41}


def _check_version(model_file, version, opset) -> None:
    oldest = OPSET_VERSIONS.get(opset, OLDEST_PROGRAM_VERSION)
    if not isinstance(version, int) or not oldest <= version <= NEWEST_VERSION:
        raise MlxdiffError(f"{model_file}: specificationVersion {version} does not fit its ML program (opset "
                           f"{opset!r} needs {oldest} to {NEWEST_VERSION}: Core ML reads the ops by this version); "
                           "the package is damaged or forged, re-export it with coremltools")


def _check_dataflow(inputs, ops, outputs) -> None:
    """Every name an op of the main block reads is the function's input or an earlier op's output, and so is every
    output of the block (an ML program Core ML loads); control-flow blocks' own ops are not followed."""
    defined = set(inputs)
    for op in ops:
        if op.nested:
            continue
        for bindings in op.inputs.values():
            for b in bindings:
                if isinstance(b, str) and b not in defined:
                    raise _Bad(f"op {op.outputs[0] if op.outputs else op.type!r} reads {b!r}, which no op before it "
                               "gives")
        defined.update(op.outputs)
    missing = [n for n in outputs if n not in defined]
    if missing:
        raise _Bad(f"the program's output {missing[0]!r} is given by no op")


def _check_values(op, name) -> None:
    """Every value of a const or constexpr op (its val, its name, an input given as a value) is one coremltools'
    program loader reads (milproto's _load_value): a tensor or dictionary value, without a docString (which it
    refuses: the docString would be lost). No package it reads has another."""
    values = [*op.attributes.values(),
              *(b for bindings in op.inputs.values() for b in bindings if not isinstance(b, str))]
    for v in values:
        if v.documented:
            raise _Bad(f"op {name!r} ({op.type}) has a value with a docString, which coremltools does not read")
        if v.kind not in (1, 4):
            raise _Bad(f"op {name!r} ({op.type}) has a value of {VALUE_KINDS.get(v.kind, 'no')} type, which "
                       "coremltools does not read")


class _Program:
    READ = ("const", "constexpr_lut_to_dense", "constexpr_blockwise_shift_scale")

    def __init__(self, path: Path):
        self.path = path
        self.model_file = _model_file(path)     # inside the package (coreml_mil.inside_package), as weight.bin
        try:
            buf = memoryview(self.model_file.read_bytes())
        except OSError as e:
            raise MlxdiffError(f"{self.model_file}: cannot read it ({e.strerror or e})") from None
        self.buf = buf
        _guard(self.model_file, self._parse)

    def _parse(self):
        buf = self.buf
        check_text(buf)
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
        _check_version(self.model_file, _one(model, MODEL_VERSION, 0), opset)
        self.ops = list(_operations(buf, blocks[opset]))
        self.producer = {name: op for op in self.ops for name in op.outputs}
        # the program's inputs and outputs {name: (dtype, shape)}: how two chunks of one UNet join (coreml.py)
        self.inputs = dict(named_type(buf, s) for s in function.get(FUNCTION["inputs"], ()))
        types = {n: t for op in self.ops for n, t in zip(op.outputs, op.output_types)}
        self.outputs = {n: types.get(n, (None, None))
                        for n in (_text(buf, s) for s in _fields(buf, blocks[opset]).get(BLOCK["outputs"], ()))}
        _check_dataflow(self.inputs, self.ops, self.outputs)
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
            blob = self.model_file.parent / "weights" / "weight.bin"
            self._blobs = _Blobs(inside_package(self.path, blob, "weights/weight.bin"))
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

    def _checked_const(self, op, name):
        """A const op's value, checked as Core ML checks every constant of a program, weight or not: its attributes
        (name and val, no inputs), a val that holds a value, its data type one coremltools reads, and either a value
        in weight.bin whose blob metadata agrees with its type (nothing of the data read) or an immediate value of
        as many elements as its type's shape (decoded: immediates are small, shapes, pads, biases)."""
        if op.inputs or not set(op.attributes) <= {"name", "val"}:
            raise _Bad(f"constant {name!r} has inputs or attributes {sorted({*op.inputs, *op.attributes})} (a const "
                       "op has a name and a val)")
        val = op.attributes.get("val")
        if val is None or not val.held:
            raise _Bad(f"constant {name!r} has no value (neither in weight.bin nor immediate)")
        if val.dtype is not None and val.dtype not in CONST_DTYPES:
            raise _Bad(f"constant {name!r} is of data type {DTYPE_NAMES.get(val.dtype, val.dtype)}, which "
                       "coremltools does not read")
        if val.blob is not None:
            blob_name, offset = val.blob
            if Path(blob_name).name != "weight.bin" or ".." in blob_name:
                raise _Bad(f"a weight in blob file {blob_name!r}; only weights/weight.bin is read")
            self.blobs().check(offset, val.dtype, math.prod(val.shape or ()))
        elif val.immediate is not None and val.dtype in DTYPES:    # (not strings, bools, int64: never weights)
            try:
                self.value(val)
            except _Bad as e:
                raise _Bad(f"constant {name!r}: {e}") from None
        return val

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
            _check_values(op, name)
            val = self._checked_const(op, name) if op.type == "const" else None    # every const, a weight or not
            users = self.consumers.get(name, [])
            if users and all(u.type.startswith("constexpr_") for u, _ in users):
                continue                                   # an intermediate of a chain: its end is the weight
            if op.type == "const" and (val is None or val.dtype not in (10, 11) or not val.shape):
                continue                                   # scalars, strings, int shapes: not weights
            out[name] = self.weight(name)
        return out



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
