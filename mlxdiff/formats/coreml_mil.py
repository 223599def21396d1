"""A Core ML package's bytes, read without coremltools: the protobuf of its MIL program, the MIL data types and
the weight blob file (formats/coreml.py reads the weights through these; coreml_weights.py decodes them).

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
FUNCTION = dict(inputs=1, opset=2, blocks=3)
BLOCK = dict(outputs=2, operations=3)
OPERATION = dict(type=1, inputs=2, outputs=3, blocks=4, attributes=5)
NAMED_TYPE = dict(name=1, type=2)
VALUE = dict(doc=1, type=2, immediate=3, blob=5)
VALUE_KINDS = {1: "tensor", 2: "list", 3: "tuple", 4: "dictionary", 5: "state"}   # ValueType's oneof


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
        key = buf[i]          # keys and sizes are mostly one byte: read inline (bench/RESULTS.md)
        if key < 0x80:
            i += 1
        else:
            key, i = _varint(buf, i, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Bad("a field numbered 0")
        if wire == 0:
            value, i = _varint(buf, i, end)
        elif wire == 2:
            if i < end and buf[i] < 0x80:
                size, i = buf[i], i + 1
            else:
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


# The Model protobuf's messages as far as an ML program's package reaches (Model.proto's ModelDescription, MIL.proto;
# made from coremltools 9's descriptors): {message: {field number: TEXT, VARINTS / FIXED32S / FIXED64S (a repeated
# number, packed or not) or the submessage}}. protobuf parses every known submessage of a Model and refuses the whole
# of it where one's wire format is broken or a text (proto3 `string`) field is not UTF-8, so coremltools refuses the
# package; check_text walks them all once to answer the same.
TEXT, VARINTS, FIXED32S, FIXED64S = "text", "varints", "fixed32s", "fixed64s"
WIRE_SCHEMA = {
    'ModelDescription': {1: 'FeatureDescription', 10: 'FeatureDescription', 11: TEXT, 12: TEXT,
                         13: 'FeatureDescription', 20: 'FunctionDescription', 21: TEXT, 50: 'FeatureDescription',
                         100: 'Metadata'},
    'FunctionDescription': {1: TEXT, 2: 'FeatureDescription', 3: 'FeatureDescription', 4: TEXT, 5: TEXT,
                            6: 'FeatureDescription'},
    'FeatureDescription': {1: TEXT, 2: TEXT, 3: 'FeatureType'},
    'FeatureType': {1: 'Int64FeatureType', 2: 'DoubleFeatureType', 3: 'StringFeatureType', 4: 'ImageFeatureType',
                    5: 'ArrayFeatureType', 6: 'DictionaryFeatureType', 7: 'SequenceFeatureType', 8: 'StateFeatureType'},
    'Int64FeatureType': {},
    'DoubleFeatureType': {},
    'StringFeatureType': {},
    'ImageFeatureType': {21: 'ImageFeatureType.EnumeratedImageSizes', 31: 'ImageFeatureType.ImageSizeRange'},
    'ImageFeatureType.EnumeratedImageSizes': {1: 'ImageFeatureType.ImageSize'},
    'ImageFeatureType.ImageSize': {},
    'ImageFeatureType.ImageSizeRange': {1: 'SizeRange', 2: 'SizeRange'},
    'SizeRange': {},
    'ArrayFeatureType': {1: VARINTS, 21: 'ArrayFeatureType.EnumeratedShapes', 31: 'ArrayFeatureType.ShapeRange'},
    'ArrayFeatureType.EnumeratedShapes': {1: 'ArrayFeatureType.Shape'},
    'ArrayFeatureType.Shape': {1: VARINTS},
    'ArrayFeatureType.ShapeRange': {1: 'SizeRange'},
    'DictionaryFeatureType': {1: 'Int64FeatureType', 2: 'StringFeatureType'},
    'SequenceFeatureType': {1: 'Int64FeatureType', 3: 'StringFeatureType', 101: 'SizeRange'},
    'StateFeatureType': {1: 'ArrayFeatureType'},
    'Metadata': {1: TEXT, 2: TEXT, 3: TEXT, 4: TEXT, 100: 'Metadata.UserDefinedEntry'},
    'Metadata.UserDefinedEntry': {1: TEXT, 2: TEXT},
    'Program': {2: 'Program.FunctionsEntry', 3: TEXT, 4: 'Program.AttributesEntry'},
    'Program.FunctionsEntry': {1: TEXT, 2: 'Function'},
    'Function': {1: 'NamedValueType', 2: TEXT, 3: 'Function.BlockSpecializationsEntry', 4: 'Function.AttributesEntry'},
    'NamedValueType': {1: TEXT, 2: 'ValueType'},
    'ValueType': {1: 'TensorType', 2: 'ListType', 3: 'TupleType', 4: 'DictionaryType', 5: 'StateType'},
    'TensorType': {3: 'Dimension', 4: 'TensorType.AttributesEntry'},
    'Dimension': {1: 'Dimension.ConstantDimension', 2: 'Dimension.UnknownDimension'},
    'Dimension.ConstantDimension': {},
    'Dimension.UnknownDimension': {},
    'TensorType.AttributesEntry': {1: TEXT, 2: 'Value'},
    'Value': {1: TEXT, 2: 'ValueType', 3: 'Value.ImmediateValue', 5: 'Value.BlobFileValue'},
    'Value.ImmediateValue': {1: 'TensorValue', 2: 'TupleValue', 3: 'ListValue', 4: 'DictionaryValue'},
    'TensorValue': {1: 'TensorValue.RepeatedFloats', 2: 'TensorValue.RepeatedInts', 3: 'TensorValue.RepeatedBools',
                    4: 'TensorValue.RepeatedStrings', 5: 'TensorValue.RepeatedLongInts',
                    6: 'TensorValue.RepeatedDoubles', 7: 'TensorValue.RepeatedBytes'},
    'TensorValue.RepeatedFloats': {1: FIXED32S},
    'TensorValue.RepeatedInts': {1: VARINTS},
    'TensorValue.RepeatedBools': {1: VARINTS},
    'TensorValue.RepeatedStrings': {1: TEXT},
    'TensorValue.RepeatedLongInts': {1: VARINTS},
    'TensorValue.RepeatedDoubles': {1: FIXED64S},
    'TensorValue.RepeatedBytes': {},
    'TupleValue': {1: 'Value'},
    'ListValue': {1: 'Value'},
    'DictionaryValue': {1: 'DictionaryValue.KeyValuePair'},
    'DictionaryValue.KeyValuePair': {1: 'Value', 2: 'Value'},
    'Value.BlobFileValue': {1: TEXT},
    'ListType': {1: 'ValueType', 2: 'Dimension'},
    'TupleType': {1: 'ValueType'},
    'DictionaryType': {1: 'ValueType', 2: 'ValueType'},
    'StateType': {1: 'ValueType'},
    'Function.BlockSpecializationsEntry': {1: TEXT, 2: 'Block'},
    'Block': {1: 'NamedValueType', 2: TEXT, 3: 'Operation', 4: 'Block.AttributesEntry'},
    'Operation': {1: TEXT, 2: 'Operation.InputsEntry', 3: 'NamedValueType', 4: 'Block', 5: 'Operation.AttributesEntry'},
    'Operation.InputsEntry': {1: TEXT, 2: 'Argument'},
    'Argument': {1: 'Argument.Binding'},
    'Argument.Binding': {1: TEXT, 2: 'Value'},
    'Operation.AttributesEntry': {1: TEXT, 2: 'Value'},
    'Block.AttributesEntry': {1: TEXT, 2: 'Value'},
    'Function.AttributesEntry': {1: TEXT, 2: 'Value'},
    'Program.AttributesEntry': {1: TEXT, 2: 'Value'},
    'Model': {2: 'ModelDescription', MODEL_PROGRAM: 'Program'},
}
MAX_DEPTH = 100          # protobuf's own recursion limit


def _packed(buf, span, kind) -> None:
    start, end = span
    if kind == VARINTS:
        i = start
        while i < end:
            _, i = _varint(buf, i, end)
    elif (end - start) % (4 if kind == FIXED32S else 8):
        raise _Bad("a packed array of fixed-size numbers has a partial element")


def check_text(buf, span=None, message="Model", depth=0) -> None:
    """_Bad where a known submessage (WIRE_SCHEMA) of the Model is not well-formed protobuf, a text field is not
    UTF-8, or messages nest past MAX_DEPTH. A field of another wire type than its schema's is skipped, as protobuf
    keeps it as an unknown field."""
    if depth > MAX_DEPTH:
        raise _Bad(f"messages nested more than {MAX_DEPTH} deep")
    table = WIRE_SCHEMA[message]
    for number, values in _fields(buf, span).items():
        kind = table.get(number)
        for value in values if kind is not None else ():
            if not isinstance(value, tuple):
                continue
            if kind == TEXT:
                _text(buf, value)
            elif kind in (VARINTS, FIXED32S, FIXED64S):
                _packed(buf, value, kind)
            else:
                check_text(buf, value, kind, depth + 1)


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
        data_offset, size, bits = self.check(offset, dtype_code, count)
        np_dtype = DTYPES[dtype_code][0]
        raw = self.data[data_offset:data_offset + size]
        if bits < 8:
            return unpack_bits(raw, bits, count, dtype_code in SIGNED_SUB_BYTE)
        return np.frombuffer(raw, dtype=np.dtype(np_dtype).newbyteorder("<"), count=count).astype(np_dtype,
                                                                                                  copy=False)

    def check(self, offset: int, dtype_code: int, count: int) -> tuple:
        """The blob at `offset` holds `count` values of `dtype_code` (its metadata says so, its data lies in the
        file): (data offset, bytes, bits per value). Nothing is read beyond the metadata."""
        if dtype_code not in DTYPES:
            raise self.bad(f"blob at offset {offset} is of data type {DTYPE_NAMES.get(dtype_code, dtype_code)}, "
                           "which a weight file does not hold")
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
        return data_offset, size, bits


# -- the program ---------------------------------------------------------------------------------------------------

class _Value:
    """A typed value of the program: dtype code, shape, and either a blob offset or immediate TensorValue fields;
    `held`: whether it has either (a blob or an immediate value of any type), `documented`: whether it carries a
    docString, `kind`: its ValueType's field number (VALUE_KINDS; None where it has none)."""

    def __init__(self, buf, span):
        f = _fields(buf, span)
        self.dtype, self.shape, self.blob, self.immediate = None, None, None, None
        self.held = VALUE["blob"] in f or VALUE["immediate"] in f
        self.documented = any(b > a for a, b in f.get(VALUE["doc"], ()))
        vtype = _fields(buf, _one(f, VALUE["type"], (0, 0)))
        self.kind = next((k for k in vtype if k in VALUE_KINDS), None)    # the ValueType's oneof field
        if 1 in vtype:                                     # ValueType.tensorType
            tt = _fields(buf, vtype[1][-1])
            self.dtype = _one(tt, 1, 0)
            dims = []
            for d in tt.get(3, ()):
                dim = _fields(buf, d)
                if 1 not in dim:
                    raise _Bad("a weight has a dynamic dimension")
                dims.append(_one(_fields(buf, dim[1][-1]), 1, 0))
            rank = _one(tt, 2, 0)                          # TensorType.rank: coremltools refuses a mismatch
            if rank != len(dims):
                raise _Bad(f"a value's type gives rank {rank if isinstance(rank, int) else '(not a number)'} for "
                           f"{len(dims)} dimensions")
            self.shape = tuple(dims)
        if VALUE["blob"] in f:
            bf = _fields(buf, f[VALUE["blob"]][-1])
            self.blob = (_text(buf, _one(bf, 1, (0, 0))), _one(bf, 2, 0))
        elif VALUE["immediate"] in f:
            imm = _fields(buf, f[VALUE["immediate"]][-1])
            if 1 in imm:                                   # ImmediateValue.tensor
                self.immediate = _fields(buf, imm[1][-1])
        self.buf = buf


def named_type(buf, span):
    """A NamedValueType (a function's input, an op's output): (name, (dtype code, shape with None for a dynamic
    dimension)); a non-tensor type is (name, (None, None))."""
    nt = _fields(buf, span)
    name = _text(buf, _one(nt, NAMED_TYPE["name"], (0, 0)))
    vtype = _fields(buf, _one(nt, NAMED_TYPE["type"], (0, 0)))
    if 1 not in vtype:
        return name, (None, None)
    tt = _fields(buf, vtype[1][-1])
    dims = []
    for d in tt.get(3, ()):
        dim = _fields(buf, d)
        dims.append(_one(_fields(buf, dim[1][-1]), 1, 0) if 1 in dim else None)
    return name, (_one(tt, 1, 0), tuple(dims))


class _Op:
    def __init__(self, buf, span):
        f = _fields(buf, span)
        self.type = _text(buf, _one(f, OPERATION["type"], (0, 0)))
        self.inputs = _map(buf, f.get(OPERATION["inputs"]), lambda s: self._bindings(buf, s))
        self.attributes = _map(buf, f.get(OPERATION["attributes"]), lambda s: _Value(buf, s))
        self.outputs, self.output_types = [], []
        for o in f.get(OPERATION["outputs"], ()):
            name, kind = named_type(buf, o)
            self.outputs.append(name)
            self.output_types.append(kind)
        self.blocks = f.get(OPERATION["blocks"], [])

    @staticmethod
    def _bindings(buf, span):
        out = []
        for b in _fields(buf, span).get(1, ()):
            bf = _fields(buf, b)
            out.append(_text(buf, bf[1][-1]) if 1 in bf else _Value(buf, _one(bf, 2, (0, 0))))
        return out


def _operations(buf, block_span, nested=False):
    for span in _fields(buf, block_span).get(BLOCK["operations"], ()):
        op = _Op(buf, span)
        op.nested = nested
        yield op
        for inner in op.blocks:                            # control flow: weights may sit in nested blocks
            yield from _operations(buf, inner, True)


# Apple's ml-stable-diffusion --chunk-unet (coremltools' bisect_model): one UNet split in two packages at an op
# near half its weights, the first's outputs the second's inputs of the same names. Named UnetChunk1/2 (the
# Resources / Apple's repositories), <converter name>_unet_chunk1/2 or <name>_chunk1/2 (bisect_model's).
CHUNK = re.compile(r"(?i)(.*?)_?chunk([12])\.mlpackage")


def chunk_pairs(folder: Path) -> dict:
    """{stem: [first, second]} of the chunk packages in `folder` ("Unet", "ControlledUnet", ...; a lone chunk's
    list holds None where its other half is missing)."""
    pairs = {}
    for p in sorted(folder.iterdir()):
        m = CHUNK.fullmatch(p.name)
        if m:
            pairs.setdefault(m.group(1), [None, None])[int(m.group(2)) - 1] = p
    return pairs


def chunked_unet(path: Path, stem: str | None = None):
    """The first package of Apple's chunked Core ML UNet that `path` names (a folder holding both chunks, or one of
    the two packages), which formats/coreml reads together with its second half beside it; None when `path` is not
    a chunk nor a folder of them. A missing half, or a folder of several chunked models, is one line. `stem`: the
    chunk pair's stem to pick in a folder ("Unet" in Apple's folder, beside "ControlledUnet")."""
    path = Path(path)
    try:
        m = CHUNK.fullmatch(path.name)
        if m:
            folder, stem = path.parent, m.group(1)
        elif path.is_dir() and path.suffix != ".mlpackage":
            folder = path
        else:
            return None
        pairs = chunk_pairs(folder)
    except OSError:                                       # unreadable: the caller's own check says so
        return None
    if stem is not None:
        pairs = {k: v for k, v in pairs.items() if k.lower() == stem.lower()}
    if not pairs:
        return None
    if len(pairs) > 1:
        raise MlxdiffError(f"{folder}: holds the chunks of {len(pairs)} chunked Core ML models ("
                           + ", ".join(f"{k or '?'}Chunk1/2" for k in pairs) + "); give the UNet's first chunk "
                           "(its UnetChunk1.mlpackage) itself")
    (stem, (first, second)), = pairs.items()
    if first is None or second is None:
        have, lack = (first, 2) if second is None else (second, 1)
        raise MlxdiffError(f"{have}: one half of Apple's chunked Core ML UNet, and its chunk {lack} is not beside it "
                           f"in {folder}; ml-stable-diffusion's --chunk-unet writes two packages, give the folder "
                           "holding both")
    return first


def chunk_partner(first: Path) -> Path:
    """The second half of the chunked UNet whose first package is `first` (chunked_unet's answer)."""
    m = CHUNK.fullmatch(first.name)
    return chunk_pairs(first.parent)[m.group(1)][1]


def package_roots(path: Path) -> list:
    """Where a package's files may resolve to: inside the package itself, and, for a package in a Hugging Face hub
    cache (…/models--org--name/snapshots/REV/…), that repository's blobs folder, which the hub's snapshot links
    point into."""
    roots = [path.resolve()]
    for parent in path.absolute().parents:
        if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
            roots.append((parent.parent / "blobs").resolve())
            break
    return roots


def inside_package(package: Path, item: Path, what: str) -> Path:
    """`item` (a file of the package) resolved, refused in one line where it resolves outside the package (a
    symbolic link or a `..` out of it): a package is read as one self-contained thing."""
    try:
        resolved = item.resolve()
    except (OSError, RuntimeError) as e:                    # a link loop
        raise MlxdiffError(f"{item}: {what} of the Core ML package {package} cannot be resolved ({e}); copy the "
                           "package whole, without links") from None
    if not any(resolved.is_relative_to(root) for root in package_roots(package)):
        raise MlxdiffError(f"{item}: {what} of the Core ML package {package} resolves outside it (to {resolved}); a "
                           "package's files must lie inside it: copy the package whole, without links out of it")
    return item


ITEM_FIELDS = ("path", "name", "author", "description")   # what coremltools' ModelPackage requires of an entry


def _model_file(path: Path) -> Path:
    """The model.mlmodel of an .mlpackage folder: its Manifest.json's root item. Every manifest entry and the model
    file must lie inside the package (inside_package), and the manifest must be one Core ML itself opens
    (coremltools' ModelPackage: a JSON object whose itemInfoEntries each give a path, name, author and description
    of an item that exists, and whose rootModelIdentifier names one of them); a package whose manifest it refuses is
    refused here too, in one line, rather than read by guessing its model file."""
    if path.suffix == ".mlmodelc" or (path / "model.mil").exists():
        raise MlxdiffError(f"{path}: a compiled Core ML model (.mlmodelc) is not read; use the .mlpackage it was "
                           "compiled from (Apple's repositories ship both)")
    if not path.is_dir():
        raise MlxdiffError(f"{path}: not a Core ML package (expected an .mlpackage folder with "
                           "Data/com.apple.CoreML/model.mlmodel)")
    manifest = path / "Manifest.json"
    if not manifest.is_file() and not (path / "Data" / "com.apple.CoreML" / "model.mlmodel").is_file():
        raise MlxdiffError(f"{path}: not a Core ML package (no Data/com.apple.CoreML/model.mlmodel); pass the "
                           ".mlpackage folder coremltools saved")
    fix = "re-save the package with coremltools or re-download it"
    if not manifest.is_file():
        raise MlxdiffError(f"{manifest}: missing (or not a file); a Core ML package names its model file there; {fix}")
    inside_package(path, manifest, "Manifest.json")
    try:
        info = json.loads(manifest.read_bytes())
    except (ValueError, OSError) as e:
        raise MlxdiffError(f"{manifest}: not readable JSON ({type(e).__name__}); {fix}") from None
    entries = info.get("itemInfoEntries") if isinstance(info, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise MlxdiffError(f"{manifest}: no itemInfoEntries object naming the package's items; {fix}")
    for entry in entries.values():          # an entry leading out of the package first (the sharper refusal)
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            inside_package(path, path / "Data" / entry["path"], f"Manifest.json's entry {entry['path']!r}")
    for key, entry in entries.items():
        if not isinstance(entry, dict) or not all(isinstance(entry.get(f), str) for f in ITEM_FIELDS):
            raise MlxdiffError(f"{manifest}: entry {key!r} lacks one of {', '.join(ITEM_FIELDS)} (Core ML refuses "
                               f"such a manifest); {fix}")
        if not entry["path"] or not (path / "Data" / entry["path"]).exists():
            raise MlxdiffError(f"{manifest}: entry {key!r} names {entry['path']!r}, which the package does not "
                               f"hold; {fix}")
    root = info.get("rootModelIdentifier")
    if not isinstance(root, str) or root not in entries:
        raise MlxdiffError(f"{manifest}: rootModelIdentifier {root!r} is none of its entries; {fix}")
    candidate = inside_package(path, path / "Data" / entries[root]["path"], "the model file")   # kept unresolved:
    if not candidate.is_file():                                                                 # weights/ beside it
        raise MlxdiffError(f"{manifest}: the root entry {entries[root]['path']!r} is not a file; {fix}")
    return candidate


def _guard(path, fn):
    try:
        return fn()
    except _Bad as e:
        raise MlxdiffError(f"{path}: {e}; the Core ML package is damaged or not one coremltools made, "
                           "re-export or re-download it") from None
    except (IndexError, KeyError, TypeError, ValueError, OverflowError, struct.error, MemoryError) as e:  # unforeseen
        raise MlxdiffError(f"{path}: unreadable Core ML program ({type(e).__name__}: {e}); re-export or "
                           "re-download it") from None
