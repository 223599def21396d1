"""GGUF files read with their weights kept quantized, as MLX affine (scale * code + bias) triplets.

Safety first: `check_gguf` parses the whole header itself (struct over a read-only mmap, every length and count
checked against the bytes that remain) before anything else looks at the file. gguf-py's GGUFReader can loop for
minutes eating memory on a forged array length, and lets a tensor offset wrap into the header; `mx.load` segfaults
on forged counts and decodes Q4_K wrongly (measured; see the project's reader-robustness notes). mx.load is
never called on a GGUF. Tensor bytes are then read through a numpy memmap of exactly the validated ranges (what
GGUFReader does too, without its per-metadata-element cost: 13 s and 0.9 GB RSS for a 786k-entry tokenizer).

Each GGUF type maps onto MLX's affine quantization (`mx.dequantize`: w = scale * code + bias per group), converted
with MLX ops, a slab of blocks of one fixed size at a time, written in place (never a float copy of a whole tensor):

| GGUF  | MLX        | scale        | bias        | how                                                        |
|-------|------------|--------------|-------------|------------------------------------------------------------|
| Q4_0  | 4-bit g32  | d            | -8 d        | exact (the file's codes)                                   |
| Q4_1  | 4-bit g32  | d            | m           | exact                                                      |
| Q5_0  | 5-bit g32  | d            | -16 d       | exact                                                      |
| Q5_1  | 5-bit g32  | d            | m           | exact                                                      |
| Q8_0  | 8-bit g32  | d            | -128 d      | exact, code = q + 128                                      |
| Q4_K  | 4-bit g32  | d * sc_j     | -dmin * m_j | exact in float32 (11-bit x 6-bit products)                 |
| Q5_K  | 5-bit g32  | d * sc_j     | -dmin * m_j | exact in float32                                           |
| Q3_K  | 8-bit g128 | -d           | 128 d       | exact, code = 128 - (sc_j - 32)(q - 4), in [0, 252]        |
| Q6_K  | 8-bit g32  | d * sc_dom/4 | -128 scale  | near-exact (below)                                         |
| Q2_K  | 4-bit g64  | requantized  |             | mx.quantize of the float32 weights, chunk by chunk         |
| F32, F16, BF16 | kept as stored (bf16 stays bf16)                                                  |
Any other type is refused with one error naming the tensor and its type, before anything is converted.

Why each type gets its form (the error and bytes-per-weight figures behind the Q3_K, Q6_K and Q2_K choices, and
what 16-bit scales cost): bench/RESULTS.md, "GGUF: the form of each type". Scales and biases are float32 when the
compute dtype is float32 (the CPU default: every exact type is then exact bit for bit against gguf-py), else the
compute dtype's 16-bit type; a tensor whose 16-bit scales would overflow keeps float32 ones.

1-D quantized tensors (biases, norm scales; rare) are returned dequantized, in the scales' dtype.
"""

import contextvars
import math
import mmap
import os
import struct
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import numpy as np

from ..errors import MlxdiffError
from ..pacing import pace, settle
import mlx.nn as nn

from .quantized import DecodingEmbedding, DecodingLinear, QuantizedTensor, RawBlocks

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
CHUNK_WEIGHTS = 1 << 22             # weights converted per slab of blocks (on the CPU)
GPU_CHUNK_WEIGHTS = 1 << 25         # on a GPU, where each slab costs a round trip (FLUX.2-dev: 1000 slabs)


def chunk_weights() -> int:
    return CHUNK_WEIGHTS if mx.default_device() == mx.cpu else GPU_CHUNK_WEIGHTS

# GGUF metadata value types: id -> (name, struct format, size); 8 = string and 9 = array are handled apart
SCALAR_TYPES = {0: ("uint8", "B", 1), 1: ("int8", "b", 1), 2: ("uint16", "H", 2), 3: ("int16", "h", 2),
                4: ("uint32", "I", 4), 5: ("int32", "i", 4), 6: ("float32", "f", 4), 7: ("bool", "?", 1),
                10: ("uint64", "Q", 8), 11: ("int64", "q", 8), 12: ("float64", "d", 8)}
STRING, ARRAY = 8, 9
NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
               11: "<i8", 12: "<f8"}


def _ggml_types():
    """{type id: (name, block weights, block bytes)} for every type gguf-py knows the size of."""
    from gguf import GGML_QUANT_SIZES
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


# ---------------------------------------------------------------------------------------------------------------
# Block decoders: blocks [R, nb, block bytes] uint8 -> (codes uint8 [R, nb, block], scales, biases float32
# [R, nb, groups per block]). Layouts: gguf-py's quants.py.


def _f16(blocks, offset):
    """The float16 field at `offset` of every block, as float32 [R, nb]."""
    return mx.view(blocks[..., offset:offset + 2], mx.float16)[..., 0].astype(mx.float32)


def _nibbles(qs):
    """[..., n] bytes -> [..., 2n]: all low nibbles, then all high nibbles (the ggml order)."""
    return mx.concatenate([qs & 15, qs >> 4], axis=-1)


def _fields(x, width, count):
    """[..., n] bytes -> [..., count * n]: bit field k (of `width` bits) of every byte, field-major."""
    shifts = mx.arange(0, width * count, width, dtype=mx.uint8)[:, None]
    return ((x[..., None, :] >> shifts) & ((1 << width) - 1)).reshape(*x.shape[:-1], count * x.shape[-1])


def _bits_of_bytes(x):
    """[..., n] bytes -> [..., 8n]: bit j of byte k is element 8k + j (a little-endian bit mask)."""
    return ((x[..., :, None] >> mx.arange(8, dtype=mx.uint8)) & 1).reshape(*x.shape[:-1], 8 * x.shape[-1])


def _k_scales(s):
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit (scale, min) pairs."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = mx.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mins = mx.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(mx.float32), mins.astype(mx.float32)


def _q4_0(b):
    d = _f16(b, 0)[..., None]
    return _nibbles(b[..., 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[..., 4:20]), _f16(b, 0)[..., None], _f16(b, 2)[..., None]


def _q5_0(b):
    d = _f16(b, 0)[..., None]
    return _nibbles(b[..., 6:22]) | (_bits_of_bytes(b[..., 2:6]) << 4), d, -16 * d


def _q5_1(b):
    codes = _nibbles(b[..., 8:24]) | (_bits_of_bytes(b[..., 4:8]) << 4)
    return codes, _f16(b, 0)[..., None], _f16(b, 2)[..., None]


def _q8_0(b):
    d = _f16(b, 0)[..., None]
    return b[..., 2:34] ^ 0x80, d, -128 * d   # int8 q + 128 is its byte with the sign bit flipped


def _q4_k_like(b, high_bits):
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mins = _k_scales(b[..., 4:16])
    qs = b[..., -128:]
    codes = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 256)
    if high_bits is not None:
        codes = codes | (_fields(high_bits, 1, 8) << 4)
    return codes, d * sc, -(dmin * mins)


def _q4_k(b):
    return _q4_k_like(b, None)


def _q5_k(b):
    return _q4_k_like(b, b[..., 16:48])


def _q3_k(b):
    lead = b.shape[:-1]
    low2 = _fields(b[..., 32:96].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    q = low2.astype(mx.int16) + 4 * _fields(b[..., 0:32], 1, 8).astype(mx.int16) - 4           # -4..3
    s = b[..., 96:108]
    sc = (_fields(s[..., 0:8], 4, 2) | (_fields(s[..., 8:12], 2, 4) << 4)).astype(mx.int16) - 32  # -32..31
    # w = d * p with p = (sc - 32)(q - 4) in [-124, 128]; as scale -d, code 128 - p in [0, 252], bias 128 d
    # (a power-of-two multiple: exact in float16 too)
    codes = (128 - sc[..., None] * q.reshape(*lead, 16, 16)).astype(mx.uint8).reshape(*lead, 256)
    d = _f16(b, 108)[..., None]
    return codes, mx.repeat(-d, 2, axis=-1), mx.repeat(128 * d, 2, axis=-1)


def _q6_k(b):
    """Near-exact: per group of 32 (two sub-blocks of 16), scale = d * sc_dom / 4 with sc_dom the sub-scale of
    larger magnitude; that sub-block's codes are 4 (q - 32) + 128 exactly, the other's are rounded."""
    lead = b.shape[:-1]
    low4 = _nibbles(b[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 256)
    high2 = _fields(b[..., 128:192].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    q = ((low4 | (high2 << 4)).astype(mx.int32) - 32).reshape(*lead, 8, 2, 16)
    sc = mx.view(b[..., 192:208], mx.int8).astype(mx.int32).reshape(*lead, 8, 2)
    first_dominates = mx.abs(sc[..., 0]) >= mx.abs(sc[..., 1])
    dom = mx.where(first_dominates, sc[..., 0], sc[..., 1])
    ratio = (4 * sc[..., None] * q).astype(mx.float32) / mx.where(dom == 0, 1, dom)[..., None, None]
    codes = mx.clip(mx.round(ratio) + 128, 0, 255).astype(mx.uint8).reshape(*lead, 256)
    scale = _f16(b, 208)[..., None] * dom.astype(mx.float32) / 4
    return codes, scale, -128 * scale


def _q2_k_float(b):
    """Q2_K weights in float32 [R, nb, 256], computed as gguf-py does."""
    lead = b.shape[:-1]
    s = b[..., 0:16]
    q = _fields(b[..., 16:80].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 16, 16).astype(mx.float32)
    dl = _f16(b, 80)[..., None] * (s & 15).astype(mx.float32)
    ml = _f16(b, 82)[..., None] * (s >> 4).astype(mx.float32)
    return (dl[..., None] * q - ml[..., None]).reshape(*lead, 256)


def _q6_k_float(b):
    """Q6_K weights in float32 [R, nb, 256], exactly as gguf-py: d * sc * (q - 32) per sub-block of 16."""
    lead = b.shape[:-1]
    low4 = _nibbles(b[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 256)
    high2 = _fields(b[..., 128:192].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    q = ((low4 | (high2 << 4)).astype(mx.int32) - 32).reshape(*lead, 16, 16)
    sc = mx.view(b[..., 192:208], mx.int8).astype(mx.float32)
    d = _f16(b, 208)[..., None]
    return ((d * sc)[..., None] * q.astype(mx.float32)).reshape(*lead, 256)


def _affine_float(decode):
    """An affine decoder as a float one: codes * scale + bias per group."""
    def to_float(b):
        codes, scales, biases = decode(b)
        groups = scales.shape[-1]
        c = codes.astype(mx.float32).reshape(*codes.shape[:-1], groups, -1)
        return (c * scales[..., None] + biases[..., None]).reshape(codes.shape)
    return to_float


# GGUF type -> (decoder, bits, group size)
AFFINE = {"Q4_0": (_q4_0, 4, 32), "Q4_1": (_q4_1, 4, 32), "Q5_0": (_q5_0, 5, 32), "Q5_1": (_q5_1, 5, 32),
          "Q8_0": (_q8_0, 8, 32), "Q4_K": (_q4_k, 4, 32), "Q5_K": (_q5_k, 5, 32), "Q3_K": (_q3_k, 8, 128),
          "Q6_K": (_q6_k, 8, 32)}
# GGUF type -> (float32 decoder, bits, group size) of the requantization
REQUANTIZED = {"Q2_K": (_q2_k_float, 4, 64)}
# GGUF type -> float32 decoder of its blocks: the raw layout, decoded one layer at a time before its matmul
FLOAT = {**{name: _affine_float(decode) for name, (decode, _, _) in AFFINE.items()},
         "Q6_K": _q6_k_float, "Q2_K": _q2_k_float}
# The layout of quantized tensors ("auto" unless the spec says otherwise; MLXDIFF_GGUF_LAYOUT through the policy):
# - "raw": the file's blocks, decoded per layer before the matmul: exact, at the file's size, for every type;
# - "affine": MLX affine triplets, which Metal's and CUDA's quantized kernels read (Q6_K near-exact, Q2_K
#   requantized, Q3_K exact only at 8.5 bits per weight);
# - "auto": raw under float32 compute (float32 scales would cost 1.5 bits per weight); otherwise affine with 16-bit
#   scales, except RAW_BY_DEFAULT, whose affine forms are not exact at about their size.
RAW_BY_DEFAULT = ("Q2_K", "Q3_K", "Q6_K")
LAYOUTS = ("auto", "affine", "raw")
PLAIN_NUMPY = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}   # numpy has no bfloat16: its bits, then mx.view
PLAIN = tuple(PLAIN_NUMPY)
SUPPORTED = (*PLAIN, *AFFINE, *REQUANTIZED)


def pack_codes(codes, bits):
    """[..., K] integer codes (K % 32 == 0) -> [..., K * bits / 32] uint32: MLX's LSB-first bit stream per row."""
    *lead, k = codes.shape
    if 32 % bits == 0:
        per_word = 32 // bits
        c = codes.reshape(*lead, k // per_word, per_word).astype(mx.uint32)
        return (c << mx.arange(0, 32, bits, dtype=mx.uint32)).sum(axis=-1)   # disjoint bit fields: sum == or
    c = codes.reshape(*lead, k // 32, 32).astype(mx.uint32)
    words = []
    for w in range(bits):   # 32 codes fill `bits` words; code i covers stream bits [bits*i, bits*(i+1))
        word = None
        for i in range(32):
            shift = bits * i - 32 * w
            if -bits < shift < 32:
                part = c[..., i] << shift if shift >= 0 else c[..., i] >> -shift
                word = part if word is None else word | part
        words.append(word)
    return mx.stack(words, axis=-1).reshape(*lead, k * bits // 32)


def scale_dtype(compute_dtype) -> mx.Dtype:
    """float32 scales for float32 compute (exact); otherwise the compute dtype's own 16-bit type."""
    return compute_dtype if compute_dtype in (mx.float16, mx.bfloat16) else mx.float32


def _convert_slab(raw, type_name):
    """raw uint8 [blocks, block bytes] -> (packed uint32, scales float32, biases float32), each flat in block
    order: a row-major tensor's blocks run along its rows, so a slab of blocks is a flat piece of each output."""
    blocks = raw[:, None, :]
    if type_name in REQUANTIZED:
        decode, bits, group = REQUANTIZED[type_name]
        w, s, b = mx.quantize(decode(blocks).reshape(-1, group), group_size=group, bits=bits)
        return w.reshape(-1), s.reshape(-1), b.reshape(-1)
    decode, bits, _ = AFFINE[type_name]
    codes, scales, biases = decode(blocks)
    return pack_codes(codes.reshape(raw.shape[0], -1), bits).reshape(-1), scales.reshape(-1), biases.reshape(-1)


def _slabs(blocks, block):
    """(slab size, [(first block, blocks written)]) for a tensor of `blocks` blocks of `block` weights.

    Every slab of a load has the same size (chunk_weights() weights; a tensor smaller than that, the next power of
    two of its blocks, zero-padded), and the last one ends at the tensor's end, overlapping the one before: so
    each slab's transient buffers come back from MLX's cache, sized alike, instead of returning to the device's
    memory pool at odd sizes between the weights kept, which fragmented it (bench/RESULTS.md, "The footprint the
    user sees": 3.2 GiB of FLUX.2-dev's CUDA pool held and unused)."""
    per = max(1, chunk_weights() // block)
    if blocks <= per:
        return 1 << (blocks - 1).bit_length(), [(0, blocks)]
    return per, [(min(first, blocks - per), per) for first in range(0, blocks, per)]


def _slab_array(data, first, count, size):
    """Blocks [first, first + count) of `data` ([blocks, block bytes]) as an MLX array of `size` blocks."""
    piece = data[first:first + count]
    if count < size:
        piece = np.concatenate([piece, np.zeros((size - count, piece.shape[1]), piece.dtype)])
    return mx.array(piece)


def _raw(path, info, data):
    """The tensor's blocks as they are in the file, checked to decode to finite weights (a slab at a time)."""
    block, block_bytes = BLOCKS[info.type_name]
    k = info.shape[-1]
    blocks = mx.array(np.ascontiguousarray(data).reshape(-1, k // block * block_bytes))
    mx.eval(blocks)
    flat = blocks.reshape(-1, block_bytes)
    _, slabs = _slabs(flat.shape[0], block)
    finite = []
    for first, count in slabs:   # views of the blocks (a tensor smaller than a slab: the whole of it)
        slab = flat[first:first + count]
        finite.append(pace(mx.all(mx.isfinite(FLOAT[info.type_name](slab[:, None, :])))))
    settle()
    if not all(f.item() for f in finite):   # one check per tensor, not a round trip per slab
        raise MlxdiffError(f"{path}: tensor {info.name!r} ({info.type_name}) has non-finite scales; the file is "
                           "corrupt, re-download it")
    return RawBlocks(blocks, info.type_name, tuple(info.shape), decode_rows)


def _quantized(path, info, data, sdtype):
    """Convert one quantized tensor a slab of blocks at a time (_slabs), each written in place into the tensor's
    outputs, allocated once (no chunks to concatenate). Returns a QuantizedTensor (2-D for a 1-D tensor: one
    row)."""
    type_name = info.type_name
    block, block_bytes = BLOCKS[type_name]
    bits, group = (AFFINE.get(type_name) or REQUANTIZED[type_name])[1:]
    flat = data.reshape(-1, block_bytes)
    blocks = flat.shape[0]
    words = block * bits // 32
    n = blocks * block
    w_out = mx.zeros((blocks * words,), mx.uint32)
    s_out, b_out = mx.zeros((n // group,), sdtype), mx.zeros((n // group,), sdtype)
    size, slabs = _slabs(blocks, block)
    checks = deque()
    for first, count in slabs:
        # each slab written in place (its outputs' only reference is the one here, so MLX donates the buffer) and
        # scheduled, the next one read from the file while the device converts this one; its checks read once
        # the tensor is done: a round trip per tensor, not per slab
        w, s, b = _convert_slab(_slab_array(flat, first, count, size), type_name)
        n_groups = count * block // group
        finite = mx.all(mx.isfinite(s[:n_groups]) & mx.isfinite(b[:n_groups]))
        s16, b16 = s[:n_groups].astype(sdtype), b[:n_groups].astype(sdtype)
        fits = mx.all(mx.isfinite(s16) & mx.isfinite(b16))
        g = first * block // group
        if count < size:   # one zero-padded slab: the outputs are copies (a view would keep the padding)
            w_out, s_out, b_out = (mx.contiguous(a) for a in (w[:count * words], s16, b16))
        else:
            w_out[first * words:(first + count) * words] = w
            s_out[g:g + n_groups] = s16
            b_out[g:g + n_groups] = b16
        mx.async_eval(w_out, s_out, b_out, finite, fits)
        checks.append((finite, fits))
        if len(checks) > 1:
            mx.eval(checks[-2])   # at most two slabs in flight: their transient buffers, not the tensor's
    if not all(finite.item() for finite, _ in checks):
        raise MlxdiffError(f"{path}: tensor {info.name!r} ({type_name}) has non-finite scales; the file is "
                           "corrupt, re-download it")
    if not all(fits.item() for _, fits in checks):   # float16 overflow (|d| * 128 > 65504): float32 scales
        del w_out, s_out, b_out
        return _quantized(path, info, data, mx.float32)
    k = info.shape[-1]
    lead = info.shape[:-1] if len(info.shape) > 1 else (1,)
    arrays = (w_out.reshape(*lead, k * bits // 32), s_out.reshape(*lead, k // group), b_out.reshape(*lead, k // group))
    return QuantizedTensor(*arrays, bits, group, type_name)


def decode_rows(blocks, type_name) -> mx.array:
    """uint8 blocks [rows, bytes per row] of a GGUF type -> float32 weights [rows, row length], exactly as gguf-py."""
    block, block_bytes = BLOCKS[type_name]
    rows = blocks.shape[0]
    return FLOAT[type_name](blocks.reshape(rows, -1, block_bytes)).reshape(rows, -1)


class RawLinear(DecodingLinear):
    """A linear layer whose weight is kept as the file's GGUF blocks (`weight` uint8 [out, bytes per row]), decoded
    exactly (decode_rows) just before its matmul, a chunk of rows at a time on the CPU (formats/quantized.py)."""

    def __init__(self, in_dims, out_dims, type_name, bias=False, compute_dtype=None):
        super().__init__()
        block, block_bytes = BLOCKS[type_name]
        self.type_name, self.in_dims, self.compute_dtype = type_name, in_dims, compute_dtype
        self.weight = mx.zeros((out_dims, in_dims // block * block_bytes), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((out_dims,))
        self.freeze()

    def _extra_repr(self):
        return f"input_dims={self.in_dims}, output_dims={self.weight.shape[0]}, {self.type_name} blocks"

    def decode(self, weight_rows, rows):
        return decode_rows(weight_rows, self.type_name)

    def column_unit(self) -> tuple:
        """(values, bytes) of one block along a row: where a tensor-parallel split may cut its columns
        (models/sharding.py)."""
        return BLOCKS[self.type_name]


class RawEmbedding(DecodingEmbedding):
    """An embedding whose table is kept as the file's GGUF blocks (`weight` uint8 [vocab, bytes per row]): only the
    looked-up rows are decoded (exactly, decode_rows), so the table stays at the file's size."""

    def __init__(self, vocab, dims, type_name, compute_dtype=None):
        super().__init__()
        block, block_bytes = BLOCKS[type_name]
        self.type_name, self.dims, self.compute_dtype = type_name, dims, compute_dtype
        self.weight = mx.zeros((vocab, dims // block * block_bytes), dtype=mx.uint8)
        self.freeze()

    def _extra_repr(self):
        return f"{self.weight.shape[0]}, {self.dims}, {self.type_name} blocks"

    def decode(self, weight_rows, rows):
        return decode_rows(weight_rows, self.type_name)


def use_raw_layers(model, layers: dict, compute_dtype=None) -> None:
    """Replace the Linear layers named in `layers` ({path: {"raw": GGUF type}}) by RawLinear and the Embedding
    layers by RawEmbedding, before loading."""
    def swap(path, module):
        setting = layers.get(path)
        if not setting or "raw" not in setting or not isinstance(module, (nn.Linear, nn.Embedding)):
            return module
        if isinstance(module, nn.Embedding):
            vocab, dims = module.weight.shape
            return RawEmbedding(vocab, dims, setting["raw"], compute_dtype)
        out_dims, in_dims = module.weight.shape
        return RawLinear(in_dims, out_dims, setting["raw"], "bias" in module, compute_dtype)

    from mlx.utils import tree_map_with_path
    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))


def _forms(layout, compute_dtype):
    """(scale dtype, the GGUF types kept as raw blocks) for a layout (None: "auto"; the run policy passes
    MLXDIFF_GGUF_LAYOUT as the spec's layout)."""
    layout = layout or "auto"
    if layout not in LAYOUTS:
        raise MlxdiffError(f"GGUF layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    sdtype = scale_dtype(backend.compute_dtype(compute_dtype))
    if layout == "auto":   # float32 scales (float32 compute, the CPU default) would cost 1.5 bits per weight
        layout = "raw" if sdtype == mx.float32 else "auto"
    raw_types = () if layout == "affine" else (tuple(AFFINE) + tuple(REQUANTIZED) if layout == "raw"
                                               else RAW_BY_DEFAULT)
    return sdtype, raw_types


def loaded_nbytes(path, compute_dtype=None, layout=None, names=None) -> int:
    """Bytes the tensors of a GGUF file take once `load_gguf` has read them with `layout`, from the header alone:
    plain tensors and raw blocks as stored, affine triplets as packed codes plus 16- or 32-bit scales and biases,
    quantized vectors dequantized to the scale dtype."""
    sdtype, raw_types = _forms(layout, compute_dtype)
    total = 0
    for info in check_gguf(path).tensors:
        if names is not None and info.name not in names:
            continue
        n = math.prod(info.shape)
        if info.type_name in PLAIN or (info.type_name in raw_types and len(info.shape) >= 2):
            total += info.nbytes
        elif info.type_name in SUPPORTED:
            if len(info.shape) == 1:
                total += n * sdtype.size
            else:
                bits, group = (AFFINE.get(info.type_name) or REQUANTIZED[info.type_name])[1:]
                total += n * bits // 8 + 2 * (n // group) * sdtype.size
    return total


def load_gguf(path, compute_dtype=None, layout=None, names=None) -> dict:
    """Check `path` (check_gguf), then read every tensor: {GGUF name: mx.array | QuantizedTensor}.

    Shapes are in PyTorch order. F32/F16/BF16 stay as stored; quantized types become QuantizedTensor (see the
    module docstring for each type's form); any other type is an MlxdiffError naming the tensor. Scales and biases
    are float32 for float32 compute (the default on the CPU), else float16/bfloat16 like the compute dtype.
    Each tensor is converted and evaluated before the next: the peak is what is loaded so far plus the tensor being
    converted and two slabs' transient buffers (_slabs).
    """
    header = check_gguf(path)
    unsupported = [t for t in header.tensors if t.type_name not in SUPPORTED and (names is None or t.name in names)]
    if unsupported:
        t = unsupported[0]
        more = f" (and {len(unsupported) - 1} more tensors)" if len(unsupported) > 1 else ""
        raise MlxdiffError(f"{path}: tensor {t.name!r} has GGUF type {t.type_name}{more}, which mlxdiff does not "
                           f"support; supported types: {', '.join(SUPPORTED)}. Use a file quantized with one of them")
    sdtype, raw_types = _forms(layout, compute_dtype)
    mapped = None
    try:
        if header.tensors:
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        filemap = None if mapped is None else np.frombuffer(mapped, dtype=np.uint8)
    except (OSError, ValueError) as e:
        raise MlxdiffError(f"{path}: cannot map the file ({e})") from None
    if filemap is not None and filemap.size != header.file_size:
        raise MlxdiffError(f"{path}: the file changed size while being read; try again once it is complete")
    out = {}
    for info in header.tensors:
        if names is not None and info.name not in names:   # a streamed block's tensors only (loading/streaming.py)
            continue
        if out:      # the previous tensor is converted (copied into MLX): its file pages leave this process's RSS
            _drop_pages(mapped, previous.offset, previous.nbytes)
        previous = info
        data = filemap[info.offset:info.offset + info.nbytes]   # validated by check_gguf: inside the file
        if info.type_name in PLAIN:
            arr = mx.array(data.view(PLAIN_NUMPY[info.type_name]).reshape(info.shape))
            out[info.name] = mx.view(arr, mx.bfloat16) if info.type_name == "BF16" else arr
            mx.eval(out[info.name])
            continue
        if info.type_name in raw_types and len(info.shape) >= 2:
            out[info.name] = _raw(path, info, data)
            continue
        qt = _quantized(path, info, data, sdtype)
        if len(info.shape) == 1:   # no MLX layer takes a quantized vector: dequantize it (it is small)
            qt = qt.dequantize().astype(qt.scales.dtype).reshape(info.shape)
            mx.eval(qt)
        out[info.name] = qt
    if out:
        _drop_pages(mapped, previous.offset, previous.nbytes)
    return out


def standins(path, compute_dtype=None, layout=None, names=None) -> dict:
    """What load_gguf would return, from the header alone and nothing read: each tensor (of `names`) as lazy zeros of
    the form it loads in (plain, raw blocks, affine triplets with the scale dtype, a quantized vector dequantized),
    never evaluated. A model whose blocks are streamed (loading/streaming.py) is built around these, so its layers
    get their quantized or raw forms; the streamed blocks' real weights are read (load_gguf with `names`) per use."""
    header = check_gguf(path)
    sdtype, raw_types = _forms(layout, compute_dtype)
    out = {}
    for info in header.tensors:
        if names is not None and info.name not in names:
            continue
        shape = tuple(info.shape)
        if info.type_name in PLAIN:
            out[info.name] = mx.zeros(shape, {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[info.type_name])
            continue
        if info.type_name not in SUPPORTED:
            raise MlxdiffError(f"{path}: tensor {info.name!r} has GGUF type {info.type_name}, which mlxdiff does not "
                               f"support; supported types: {', '.join(SUPPORTED)}")
        block, block_bytes = BLOCKS[info.type_name]
        k = shape[-1]
        if info.type_name in raw_types and len(shape) >= 2:
            rows = math.prod(shape[:-1])
            out[info.name] = RawBlocks(mx.zeros((rows, k // block * block_bytes), mx.uint8), info.type_name, shape,
                                       decode_rows)
            continue
        if len(shape) == 1:
            out[info.name] = mx.zeros(shape, sdtype)
            continue
        bits, group = (AFFINE.get(info.type_name) or REQUANTIZED[info.type_name])[1:]
        lead = shape[:-1]
        out[info.name] = QuantizedTensor(mx.zeros((*lead, k * bits // 32), mx.uint32), mx.zeros((*lead, k // group),
                                         sdtype), mx.zeros((*lead, k // group), sdtype), bits, group, info.type_name)
    return out


def _drop_pages(mapped, offset, nbytes):
    """Tell the kernel this process is done with a byte range of the mapped file (MADV_DONTNEED): read through a
    mapping, a file's pages count in the process's RSS until it is unmapped, so a whole GGUF would otherwise sit
    there, as file-backed pages, beside the weights converted from it. The page cache keeps them; a page shared with
    the next tensor is read again from there."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = offset // page * page
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
    except (OSError, ValueError):   # an advice the platform does not take: the pages simply stay until unmapped
        pass
