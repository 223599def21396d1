"""Lazy, gated safetensors reads.

`mx.load` is lazy (nothing is read until an array is evaluated, and then straight into an MLX buffer, with no
second copy), but it accepts files that safetensors' own parser rejects: shifted or overlapping data offsets,
impossible shapes, dimensions that wrap at 2^31. So every file passes `check_safetensors` first: a bounded read
and parse of the header, every field's type checked before it is used, then a check that the tensors tile the
data region exactly. What mx.load returns is then compared with the checked header (names, shapes, dtypes), and
the 8-bit float types it returns as raw bytes are decoded. Every refusal is one MlxdiffError line naming the file.
"""

import json
import math
import os
import stat
import struct
from pathlib import Path

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself uses
MAX_TENSORS = 1 << 17       # real files hold a few thousand; 1M zero-size tensors cost mx.load 15 s and 1.6 GB
MAX_RANK = 8                # 3-D convolution weights have 5 dimensions
MAX_DIM = (1 << 31) - 1     # MLX shapes are int32: a larger dimension wraps ([0, 2**32 + 5] loads as (0, 5))
MAX_DIGITS = 20             # every number in a valid header is a u64, which has at most 20 digits
MAX_INDEX_BYTES = 64 << 20  # a shard index names a few thousand tensors (~100 KB)
# dtype -> (bytes per element, the dtype mx.load returns it as)
DTYPES = {"BOOL": (1, mx.bool_), "U8": (1, mx.uint8), "I8": (1, mx.int8), "F8_E4M3": (1, mx.uint8),
          "F8_E8M0": (1, mx.uint8), "U16": (2, mx.uint16), "I16": (2, mx.int16), "F16": (2, mx.float16),
          "BF16": (2, mx.bfloat16), "U32": (4, mx.uint32), "I32": (4, mx.int32), "F32": (4, mx.float32),
          "U64": (8, mx.uint64), "I64": (8, mx.int64), "C64": (8, mx.complex64)}
ITEMSIZE = {dtype: size for dtype, (size, _) in DTYPES.items()}
# the other dtypes safetensors knows: mx.load refuses each
UNSUPPORTED = {"F64": "float64", "F8_E5M2": "float8 e5m2", "F8_E4M3FNUZ": "float8 e4m3fnuz",
               "F8_E5M2FNUZ": "float8 e5m2fnuz", "F4": "float4 e2m1", "F6_E2M3": "float6 e2m3",
               "F6_E3M2": "float6 e3m2"}
ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
# Floating tensors of at most this many elements are checked finite whole when a model is built (loading/build.py):
# norm weights, biases, scales, BatchNorm statistics and LoRA factors are all far below it, while every large matrix of
# a real model is above it (FLUX.2 dev: the 130 of 299 tensors below 1M elements hold 0.005% of its 32G weights), so
# the check reads a few MB of a model, never its big weights whole.
CHECK_WHOLE_ELEMENTS = 1 << 20
CHECK_BATCH_ELEMENTS = 1 << 26   # flags evaluated together: one round trip per 64M elements checked, not per tensor


def nbytes(dtype, shape) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def _bad(path, what):
    return MlxdiffError(f"{path}: not a valid safetensors file ({what}); re-download or re-convert it")


def _short(value, limit=120):
    """repr(value), cut: a message stays one line (repr escapes newlines) and short whatever the file holds."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."


def _parse_json(text, bad, strict_numbers):
    """json.loads with bounded work and no exception but `bad(...)` (an MlxdiffError).

    Nesting is bounded by json's own recursion guard (RecursionError after ~1000 levels, bounded work: a byte
    pre-scan would have to tell strings apart, and a regex doing so takes GBs on a hostile 100 MB header).
    Integers longer than MAX_DIGITS digits are refused before conversion (int() raises ValueError past 4,300);
    with `strict_numbers`, any float, negative number (-0 included) or NaN/Infinity too: a safetensors header holds
    only u64 numbers. Duplicate
    keys are refused (json keeps the last one, and nothing says nlohmann-json in mx.load keeps the same)."""
    def integer(s):
        if len(s.lstrip("-")) > MAX_DIGITS:
            raise bad(f"a {len(s)}-digit integer")
        if strict_numbers and s.startswith("-"):    # -0 too: json reads it as 0, safetensors' parser refuses it
            raise bad(f"the number {_short(s, 40)} is negative (a safetensors header holds unsigned integers only)")
        return int(s)

    def not_integer(s):
        raise bad(f"the number {_short(s, 40)} is not an integer")

    def no_duplicates(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise bad(f"duplicate key {_short(k)}")
            seen.add(k)
        return dict(pairs)

    hooks = {"parse_float": not_integer, "parse_constant": not_integer} if strict_numbers else {}
    try:
        return json.loads(text, parse_int=integer, object_pairs_hook=no_duplicates, **hooks)
    except RecursionError:
        raise bad("JSON nested too deeply") from None
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise bad(f"not valid JSON: {str(e)[:200]}") from None


def _read_header(path):
    """(header dict, data region length): the bounded read and parse of the JSON header."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):   # a FIFO would block the read below
            raise MlxdiffError(f"{path}: not a regular file")
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"file is {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
                raise _bad(path, f"header length {n} does not fit the file of {size} bytes (truncated?)")
            raw = f.read(n)
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) != n:
        raise MlxdiffError(f"{path}: the file changed size while being read; try again once it is complete")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(path, f"header is not UTF-8 at byte {8 + e.start}") from None
    header = _parse_json(text, lambda what: _bad(path, f"header: {what}"), strict_numbers=True)
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    return header, size - 8 - n


def _tensor(path, name, entry):
    """(dtype, shape, (start, end)) of one header entry, every field's type checked before it is used."""
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        what = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise _bad(path, f"tensor {_short(name)} has a malformed entry ({_short(what)}, expected "
                         f"{sorted(ENTRY_KEYS)})")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise _bad(path, f"tensor {_short(name)} has a dtype that is not a string ({_short(dtype)})")
    if dtype in UNSUPPORTED:
        raise MlxdiffError(f"{path}: tensor {_short(name)} is {UNSUPPORTED[dtype]}, which MLX cannot load; "
                           "convert the file to float32, float16 or bfloat16")
    if dtype not in DTYPES:
        raise _bad(path, f"tensor {_short(name)} has unknown dtype {_short(dtype)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK
            and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
        raise _bad(path, f"tensor {_short(name)} has an invalid shape {_short(shape)} (at most {MAX_RANK} "
                         f"dimensions, each 0 to {MAX_DIM})")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {_short(name)} has invalid data offsets {_short(offsets)}")
    size = nbytes(dtype, shape)
    if offsets[1] - offsets[0] != size:
        raise _bad(path, f"tensor {_short(name)}: shape {shape} {dtype} needs {size} bytes, offsets give "
                         f"{offsets[1] - offsets[0]}")
    return dtype, tuple(shape), tuple(offsets)


def check_safetensors(path, with_metadata=False):
    """Validate the header and layout of a safetensors file; return {name: (dtype, shape)} (and, `with_metadata`,
    the header's `__metadata__` {str: str}, {} when absent). Raises MlxdiffError."""
    path = Path(path)
    header, data_len = _read_header(path)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(path, "__metadata__ must map strings to strings")
    info = _check_tensors(path, header, data_len)
    return (info, meta or {}) if with_metadata else info


def tensor_ranges(path) -> dict:
    """{name: (byte offset in the file, bytes)} of every tensor, from the checked header (where a streamed block's
    tensors lie, to read them ahead: loading/streaming.py)."""
    path = Path(path)
    header, data_len = _read_header(path)
    header.pop("__metadata__", None)
    _check_tensors(path, header, data_len)
    start = path.stat().st_size - data_len
    return {name: (start + entry["data_offsets"][0], entry["data_offsets"][1] - entry["data_offsets"][0])
            for name, entry in header.items()}


def parse_json(text, bad):
    """json.loads with bounded work, duplicate keys refused, every failure `bad(what)` (for JSON a file carries:
    a header's metadata value, a tensor of JSON bytes)."""
    return _parse_json(text, bad, strict_numbers=False)


def _check_tensors(path, header, data_len) -> dict:
    if len(header) > MAX_TENSORS:
        raise _bad(path, f"{len(header)} tensors, more than the {MAX_TENSORS} mlxdiff reads from one file")
    spans, info = [], {}
    for name, entry in header.items():
        dtype, shape, (start, end) = _tensor(path, name, entry)
        spans.append((start, end, name))
        info[name] = (dtype, shape)
    # The tensors must tile the data region: no gaps, no overlaps, nothing missing at the end.
    pos = 0
    for start, end, name in sorted(spans):
        if start != pos:
            raise _bad(path, f"tensor {_short(name)} starts at {start}, expected {pos} (overlapping or shifted data)")
        pos = end
    if pos != data_len:
        what = "truncated" if pos > data_len else "trailing bytes after the last tensor"
        raise _bad(path, f"data region is {data_len} bytes, tensors need {pos} ({what})")
    return info


def finite_flags(named, limit=CHECK_WHOLE_ELEMENTS):
    """(name, flag, elements) for each (name, array) of `named` whose array is floating, not empty and of at most
    `limit` elements (None: any size): flag is a lazy mx.all(mx.isfinite(array)). Other values are skipped."""
    for name, a in named:
        if (isinstance(a, mx.array) and a.size and mx.issubdtype(a.dtype, mx.floating)
                and (limit is None or a.size <= limit)):
            yield name, mx.all(mx.isfinite(a)), a.size


def first_false(flags):
    """The name of the first (name, flag, elements) whose flag is false, or None: the flags are evaluated a batch
    (CHECK_BATCH_ELEMENTS) at a time, one round trip per batch."""
    batch, size = [], 0
    for name, flag, n in flags:
        batch.append((name, flag))
        size += n
        if size >= CHECK_BATCH_ELEMENTS:
            bad = _first_false(batch)
            if bad is not None:
                return bad
            batch, size = [], 0
    return _first_false(batch)


def _first_false(batch):
    if not batch:
        return None
    values = mx.stack([flag for _, flag in batch]).tolist()
    return next((name for (name, _), ok in zip(batch, values) if not ok), None)


def _from_e8m0(codes):
    """F8_E8M0 (the scale type of MX formats: 2^(e - 127), e = 255 is NaN) as bfloat16, built from its bits:
    bfloat16 has float32's 8 exponent bits, so every value is exact (2^-127, e = 0, is a bfloat16 subnormal)."""
    bits = codes.astype(mx.uint16) << 7
    bits = mx.where(codes == 0, mx.array(0x0040, mx.uint16), bits)
    bits = mx.where(codes == 255, mx.array(0x7FC0, mx.uint16), bits)
    return mx.view(bits, mx.bfloat16)


# The 8-bit float types mx.load returns as raw bytes, decoded lazily to bfloat16, which holds each exactly.
# F8_E8M0 is decoded rather than refused: it is exact and cheap, and refusing it would refuse a whole file over
# one scale tensor (it is what MX-quantized checkpoints store their block scales as).
DECODE = {"F8_E4M3": lambda a: mx.from_fp8(a, dtype=mx.bfloat16), "F8_E8M0": _from_e8m0}


def load_safetensors(path, decode_fp8=True, info=None) -> dict:
    """Check, then lazily map one file: {name: mx.array}. Nothing is read until an array is evaluated.
    With `decode_fp8` False, F8_E4M3 tensors stay the file's bytes (uint8; formats/fp8.py keeps them at 8 bits).
    `info`: what check_safetensors returned for it, when the caller has just checked it."""
    info = check_safetensors(path) if info is None else info
    if not info:
        return {}
    try:
        arrays = mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise MlxdiffError(f"{path}: MLX could not load it ({' '.join(str(e).split())[:300]}); re-download or "
                           "re-convert it") from None
    # mx.load parses the header again (with nlohmann-json): it must have read what was checked
    if arrays.keys() != info.keys():
        odd = sorted(arrays.keys() ^ info.keys())[0]
        raise MlxdiffError(f"{path}: MLX read the header differently (tensor {_short(odd)}); re-convert the file")
    for name, (dtype, shape) in info.items():
        a = arrays[name]
        if a.shape != shape or a.dtype != DTYPES[dtype][1]:
            raise MlxdiffError(f"{path}: MLX read tensor {_short(name)} as {a.dtype} {a.shape}, the header says "
                               f"{dtype} {shape}; re-convert the file")
        if dtype in DECODE and (decode_fp8 or dtype != "F8_E4M3"):
            arrays[name] = DECODE[dtype](a)
    return arrays


def _shard(index, folder, root, key, value):
    """The path of one weight_map entry, refused unless it is a relative `.safetensors` path inside the folder
    that stays inside it once symlinks are resolved, or that a symlink takes into a Hugging Face cache's blobs
    (every file of a cache snapshot is a link to ../../blobs/<hash>). Nothing is opened."""
    def refuse(why):
        return MlxdiffError(f"{index}: weight_map entry {_short(key)}: {_short(value)} {why}; fix or re-download "
                            "the index")

    if not isinstance(value, str):
        raise refuse("is not a file name")
    if not value.endswith(".safetensors") or "\0" in value or Path(value).is_absolute():
        raise refuse("is not a relative .safetensors path")
    rel = os.path.normpath(value)   # what is checked below is what is opened: "a/../b" is "b"
    if rel.split(os.sep)[0] == "..":
        raise refuse(f"points outside {folder}")
    try:
        target = (folder / rel).resolve()
    except (OSError, RuntimeError, ValueError):   # a symlink loop is a RuntimeError before Python 3.13
        raise refuse("cannot be resolved") from None
    in_hf_blobs = target.parent.name == "blobs" and target.parent.parent.name.startswith("models--")
    if not (target.is_relative_to(root) or in_hf_blobs):
        raise refuse(f"points outside {folder} (through a symlink)")
    return target, folder / rel


def _index_shards(index, folder) -> list:
    """The shard files a `*.safetensors.index.json` names, every entry checked before any shard is opened."""
    def bad(what):
        return MlxdiffError(f"{index}: not a valid safetensors index ({what}); re-download the model")

    try:
        st = index.stat()
        if not stat.S_ISREG(st.st_mode):
            raise MlxdiffError(f"{index}: not a regular file")
        if st.st_size > MAX_INDEX_BYTES:
            raise bad(f"over {MAX_INDEX_BYTES >> 20} MiB")
        text = index.read_bytes().decode("utf-8")
    except OSError as e:
        raise MlxdiffError(f"{index}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise bad("not UTF-8") from None
    content = _parse_json(text, bad, strict_numbers=False)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise bad("no weight_map of tensor names to shard files")
    root = folder.resolve()
    shards = {}   # resolved target -> its path in the folder (the first spelling)
    for key, value in weight_map.items():
        target, shard = _shard(index, folder, root, key, value)
        shards.setdefault(target, shard)
    return sorted(shards.values())


def safetensors_files(folder) -> list:
    """The weight files of a component folder: from a `*.safetensors.index.json` if there is one, else all
    `*.safetensors`. Raises MlxdiffError for a malformed index, one that names a path outside the folder, or a
    missing shard."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        files = _index_shards(indexes[0], folder)
        for f in files:
            if not f.exists():
                raise MlxdiffError(f"{f}: shard named in {indexes[0].name} is missing; re-download the model")
        return files
    files = sorted(p for p in folder.glob("*.safetensors"))
    if not files:
        raise MlxdiffError(f"{folder}: no .safetensors weights found")
    return files


def load_folder(folder) -> dict:
    """All tensors of a (possibly sharded) component folder, lazily."""
    weights = {}
    for f in safetensors_files(folder):
        for k, v in load_safetensors(f).items():
            if k in weights:
                raise MlxdiffError(f"{f}: tensor {_short(k)} also appears in another shard of {folder}")
            weights[k] = v
    return weights


def file_bytes(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)
