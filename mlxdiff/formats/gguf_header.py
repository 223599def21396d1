"""GGUF headers: `check_gguf` parses and validates one without trusting any count, length or offset in it, and
`metadata_value` reads a metadata key typed and bounded (what a model reads from it: models/text_llm.py).

Safety first: the whole header is parsed here (struct over a read-only mmap, every length and count checked against
the bytes that remain) before anything else looks at the file. gguf-py's GGUFReader can loop for minutes eating
memory on a forged array length, and lets a tensor offset wrap into the header; `mx.load` segfaults on forged counts
and decodes Q4_K wrongly (measured; see the project's reader-robustness notes). mx.load is never called on a GGUF.
"""

import contextvars
import math
import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES

from ..errors import MlxdiffError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_TENSORS = 1 << 17               # FLUX.2-dev has 299 tensors, large LLMs a few thousand
MAX_KVS = 1 << 17
MAX_KEY_BYTES = 65535               # the GGUF spec's limit on key and tensor-name length
MAX_METADATA_ELEMENTS = 1 << 23     # array elements over all keys (a 262k-token tokenizer has ~800k)
MAX_ARRAY_DEPTH = 4                 # arrays of arrays of ...
MAX_DIMS = 4                        # GGML_MAX_DIMS
MAX_DIM = (1 << 31) - 1             # MLX shapes are int32
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> (name, struct format, size); 8 = string and 9 = array are handled apart
SCALAR_TYPES = {0: ("uint8", "B", 1), 1: ("int8", "b", 1), 2: ("uint16", "H", 2), 3: ("int16", "h", 2),
                4: ("uint32", "I", 4), 5: ("int32", "i", 4), 6: ("float32", "f", 4), 7: ("bool", "?", 1),
                10: ("uint64", "Q", 8), 11: ("int64", "q", 8), 12: ("float64", "d", 8)}
STRING, ARRAY = 8, 9
NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
               11: "<i8", 12: "<f8"}


def _ggml_types():
    """{type id: (name, block weights, block bytes)} for every type gguf-py knows the size of."""
    return {int(t): (t.name, block, nbytes) for t, (block, nbytes) in GGML_QUANT_SIZES.items()}


GGML_TYPES = _ggml_types()
BLOCKS = {name: (block, nbytes) for name, block, nbytes in GGML_TYPES.values()}   # by type name


def _bad(path, what):
    return MlxdiffError(f"{path}: not a valid GGUF file ({what}); re-download or re-convert it")


@dataclass


class GGUFTensorInfo:
    name: str
    type_name: str          # GGML type name, e.g. "Q4_K"
    shape: tuple            # PyTorch order (GGUF stores dims reversed: ne[0] is the row length)
    offset: int             # absolute byte offset in the file
    nbytes: int


@dataclass


class GGUFHeader:
    path: Path
    version: int
    alignment: int
    data_start: int
    file_size: int
    metadata: dict = field(default_factory=dict)    # key -> int | float | bool | str | list | np.ndarray
    tensors: list = field(default_factory=list)     # [GGUFTensorInfo] in file order


class _Cursor:
    """Bounded little-endian reads over a buffer: every read is checked against the end first."""

    def __init__(self, buf, size, path):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def need(self, n, what):
        if n < 0 or self.pos + n > self.size:
            raise _bad(self.path, f"{what} needs {n} bytes at offset {self.pos}, the file has {self.size} "
                                  "(truncated?)")

    def unpack(self, fmt, size, what):
        self.need(size, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def raw(self, n, what):
        self.need(n, what)
        data = self.buf[self.pos:self.pos + n]
        self.pos += n
        return data

    def string(self, what, limit=None):
        n = self.unpack("Q", 8, f"{what} length")
        if limit is not None and n > limit:
            raise _bad(self.path, f"{what} length {n} exceeds {limit}")
        return self.raw(n, what)


def _name(cur, what):
    raw = cur.string(what, MAX_KEY_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(cur.path, f"{what} at offset {cur.pos - len(raw)} is not UTF-8") from None


class _Metadata:
    def __init__(self, cur):
        self.cur, self.elements = cur, 0

    def value(self, vtype, key, depth=0):
        cur = self.cur
        if vtype in SCALAR_TYPES:
            _, fmt, size = SCALAR_TYPES[vtype]
            return cur.unpack(fmt, size, f"value of key {key!r}")
        if vtype == STRING:
            return cur.string(f"string value of key {key!r}").decode("utf-8", errors="replace")
        if vtype != ARRAY:
            raise _bad(cur.path, f"key {key!r} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise _bad(cur.path, f"key {key!r}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        itype = cur.unpack("I", 4, f"array item type of key {key!r}")
        n = cur.unpack("Q", 8, f"array length of key {key!r}")
        # the smallest encoding of one item: its fixed size, 8 for a string's length, 12 for an array's header
        min_item = SCALAR_TYPES[itype][2] if itype in SCALAR_TYPES else {STRING: 8, ARRAY: 12}.get(itype)
        if min_item is None:
            raise _bad(cur.path, f"key {key!r} is an array of unknown type {itype}")
        if n * min_item > cur.size - cur.pos:
            raise _bad(cur.path, f"array of key {key!r} declares {n} items, more than the "
                                 f"{cur.size - cur.pos} bytes left in the file")
        self.elements += n
        if self.elements > MAX_METADATA_ELEMENTS:
            raise _bad(cur.path, f"more than {MAX_METADATA_ELEMENTS} metadata array elements (at key {key!r})")
        if itype in SCALAR_TYPES:
            data = cur.raw(n * min_item, f"array of key {key!r}")
            return np.frombuffer(data, dtype=NUMPY_TYPES[itype]).copy()
        return [self.value(itype, key, depth + 1) for _ in range(n)]


# -- typed metadata reads: what a model reads from the metadata, checked as its type and range ----------------------


def _shown_value(value, kind=False) -> str:
    """A metadata value as an error message shows it: its kind (`kind`: for an integer too) and the value, cut."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, (np.ndarray, list)):
        return f"an array of {len(value)} items"
    if isinstance(value, float):
        text = f"{value:.6g}"
        return f"a float ({text}{'.0' if text.lstrip('-').isdigit() else ''})"
    return f"an integer ({value})" if kind else str(value)


FIX = "; re-download or re-convert the file"   # what to do about metadata that does not describe the model


def metadata_value(metadata: dict, key: str, kind: str, lo=None, hi=None, gt=None, per_layer=None):
    """GGUF metadata `key` read as `kind`, None when the file has no such key; otherwise one MlxdiffError line that
    names the key (not the file: the caller adds it). Kinds, as llama.cpp's loader types them (it refuses a key of
    another type): "int" an integer type (never a bool or a float, whatever its value), "float" a float32 / float64
    (never an integer: llama.cpp writes rope bases and epsilons as float32), "str" a string. Numbers must be finite
    and within lo..hi (above `gt`). `per_layer`: an integer key that llama.cpp also takes as one value per layer
    (head counts): an array of `per_layer` integers is read when they are all equal (mlxdiff's encoders have one
    value for every layer)."""
    if key not in metadata:
        return None
    value = metadata[key]
    expected = {"int": "an integer", "float": "a float32", "str": "a string"}[kind]
    if per_layer is not None and isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        if len(value) != per_layer or not len(value):
            raise MlxdiffError(f"GGUF metadata {key} is an array of {len(value)} items; expected one integer or "
                               f"one per layer ({per_layer}){FIX}")
        if (value != value[0]).any():
            raise MlxdiffError(f"GGUF metadata {key} differs between layers ({', '.join(map(str, value[:4]))}, "
                               "...); mlxdiff's text encoders have one value for every layer")
        value = int(value[0])
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, float), "str": isinstance(value, str)}[kind]
    if not ok:
        raise MlxdiffError(f"GGUF metadata {key} is {_shown_value(value, kind=True)}; expected {expected}"
                           + (" (or one per layer)" if per_layer is not None else "") + FIX)
    if kind == "str":
        return value
    fmt = lambda x: f"{x:g}" if isinstance(x, float) else str(x)
    bounds = " ".join(part for part in (f"above {fmt(gt)}" if gt is not None else "",
                                        f"from {fmt(lo)}" if lo is not None else "",
                                        f"up to {fmt(hi)}" if hi is not None else "") if part)
    if (not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi)
            or (gt is not None and value <= gt)):
        raise MlxdiffError(f"GGUF metadata {key} is {_shown_value(value)}; expected {expected} {bounds}{FIX}")
    return value


_HEADERS = contextvars.ContextVar("gguf_headers", default=None)


@contextmanager


def reuse_headers(cache: dict):
    """Within it, check_gguf keeps each header it parses in `cache`, keyed by the file's path, size, modification
    time and inode, and gives it back for the same file: a streamed block re-reads its file at every use
    (loading/streaming.py). Everywhere else every call parses the file again."""
    token = _HEADERS.set(cache)
    try:
        yield
    finally:
        _HEADERS.reset(token)


def check_gguf(path) -> GGUFHeader:
    """Parse and validate a GGUF header without trusting any count, length or offset in it. Raises MlxdiffError.

    Checked: magic, version 2 or 3, tensor and KV counts against the file size, every key/string/array length
    against the bytes left, value types, unique UTF-8 keys and tensor names, general.alignment (uint32, a power of
    two), n_dims 1..4, dims 1..2^31-1, known tensor types, row length a multiple of the type's block, data offsets
    aligned, inside the file and not overlapping.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            cache = _HEADERS.get()
            if cache is not None:
                st = os.fstat(f.fileno())
                key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
                if key in cache:
                    return cache[key]
            size = f.seek(0, 2)
            if size < 24:
                raise _bad(path, f"file is {size} bytes, too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                header = _parse(buf, size, path)
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read ({e.strerror or e})") from None
    if cache is not None:
        cache[key] = header
    return header


def _parse(buf, size, path):
    cur = _Cursor(buf, size, path)
    magic = cur.raw(4, "magic")
    if magic != MAGIC:
        raise _bad(path, f"magic is {bytes(magic)!r}, expected b'GGUF'")
    version = cur.unpack("I", 4, "version")
    if version not in VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise MlxdiffError(f"{path}: big-endian GGUF files are not supported; use a little-endian conversion")
        raise _bad(path, f"version {version}; only GGUF versions 2 and 3 are supported")
    n_tensors = cur.unpack("Q", 8, "tensor count")
    n_kv = cur.unpack("Q", 8, "key/value count")
    # a tensor entry takes at least 32 bytes (8 name length + 4 n_dims + 8 dim + 4 type + 8 offset), a KV 13
    if n_tensors > min(MAX_TENSORS, (size - 24) // 32):
        raise _bad(path, f"tensor count {n_tensors} is impossible for a file of {size} bytes")
    if n_kv > min(MAX_KVS, (size - 24 - 32 * n_tensors) // 13):
        raise _bad(path, f"key/value count {n_kv} is impossible for a file of {size} bytes")

    meta = _Metadata(cur)
    metadata = {}
    for _ in range(n_kv):
        key = _name(cur, "metadata key")
        if key in metadata:
            raise _bad(path, f"duplicate metadata key {key!r}")
        vtype = cur.unpack("I", 4, f"value type of key {key!r}")
        metadata[key] = meta.value(vtype, key)
        if key == "general.alignment" and vtype != 4:
            raise _bad(path, "general.alignment must be a uint32")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise _bad(path, f"general.alignment {alignment} is not a positive power of two")

    entries, names = [], set()
    for _ in range(n_tensors):
        name = _name(cur, "tensor name")
        if name in names:
            raise _bad(path, f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = cur.unpack("I", 4, f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _bad(path, f"tensor {name!r} has n_dims {n_dims}, expected 1 to {MAX_DIMS}")
        dims = [cur.unpack("Q", 8, f"dims of tensor {name!r}") for _ in range(n_dims)]
        if not all(1 <= d <= MAX_DIM for d in dims):
            raise _bad(path, f"tensor {name!r} has dims {dims}, each must be 1 to {MAX_DIM}")
        ttype = cur.unpack("I", 4, f"type of tensor {name!r}")
        if ttype not in GGML_TYPES:
            raise _bad(path, f"tensor {name!r} has unknown type id {ttype}")
        offset = cur.unpack("Q", 8, f"data offset of tensor {name!r}")
        entries.append((name, dims, ttype, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, ttype, offset in entries:
        type_name, block, block_bytes = GGML_TYPES[ttype]
        if dims[0] % block:
            raise _bad(path, f"tensor {name!r} ({type_name}) has rows of {dims[0]} weights, not a multiple of the "
                             f"block size {block}")
        nbytes = math.prod(dims) // block * block_bytes
        if offset % alignment:
            raise _bad(path, f"tensor {name!r} data offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > size:
            raise _bad(path, f"tensor {name!r} data [{start}, {start + nbytes}) runs past the end of the file at "
                             f"{size} (truncated?)")
        tensors.append(GGUFTensorInfo(name, type_name, tuple(reversed(dims)), start, nbytes))
    previous = None
    for t in sorted(tensors, key=lambda t: t.offset):
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            raise _bad(path, f"tensors {previous.name!r} and {t.name!r} overlap")
        previous = t
    return GGUFHeader(path, version, alignment, data_start, size, metadata, tensors)
