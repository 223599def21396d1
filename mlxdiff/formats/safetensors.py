"""Lazy, gated safetensors reads.

`mx.load` is lazy (nothing is read until an array is evaluated, and then straight into an MLX buffer, with no
second copy), but it accepts files that safetensors' own parser rejects: shifted or overlapping data offsets,
impossible shapes. So every file passes `check_safetensors` first:
a bounded read of the header, then a check that the tensors tile the data region exactly.
"""

import json
import math
import os
import struct
from pathlib import Path

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself uses
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
            "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "C64": 8}
UNSUPPORTED = {"F64": "float64", "F8_E5M2": "float8 e5m2"}


def nbytes(dtype, shape) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def _bad(path, what):
    return MlxdiffError(f"{path}: not a valid safetensors file ({what}); re-download or re-convert it")


def check_safetensors(path) -> dict:
    """Validate the header and layout of a safetensors file; return {name: (dtype, shape)}. Raises MlxdiffError."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"file is {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or n > size - 8:
                raise _bad(path, f"header length {n} does not fit the file of {size} bytes (truncated?)")
            raw = f.read(n)
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read ({e.strerror or e})") from None

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            raise _bad(path, "duplicate key in header")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _bad(path, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(path, "__metadata__ must map strings to strings")

    data_len = size - 8 - n
    spans, info = [], {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r} has a malformed entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype in UNSUPPORTED:
            raise MlxdiffError(f"{path}: tensor {name!r} is {UNSUPPORTED[dtype]}, which MLX cannot load; "
                               "convert the file to float32, float16 or bfloat16")
        if dtype not in ITEMSIZE:
            raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise _bad(path, f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise _bad(path, f"tensor {name!r} has invalid data offsets {offsets!r}")
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise _bad(path, f"tensor {name!r}: shape {shape} {dtype} needs {nbytes} bytes, offsets give "
                             f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
        info[name] = (dtype, tuple(shape))
    # The tensors must tile the data region: no gaps, no overlaps, nothing missing at the end.
    pos = 0
    for start, end, name in sorted(spans):
        if start != pos:
            raise _bad(path, f"tensor {name!r} starts at {start}, expected {pos} (overlapping or shifted data)")
        pos = end
    if pos != data_len:
        what = "truncated" if pos > data_len else "trailing bytes after the last tensor"
        raise _bad(path, f"data region is {data_len} bytes, tensors need {pos} ({what})")
    return info


def load_safetensors(path) -> dict:
    """Check, then lazily map one file: {name: mx.array}. Nothing is read until an array is evaluated."""
    info = check_safetensors(path)
    if not info:
        return {}
    try:
        arrays = mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise MlxdiffError(f"{path}: MLX could not load it ({e})") from None
    for name, (dtype, _) in info.items():
        if dtype in ("F8_E4M3",):  # stored as uint8 by mx.load; decode lazily
            arrays[name] = mx.from_fp8(arrays[name], dtype=mx.bfloat16)
    return arrays


def safetensors_files(folder) -> list:
    """The weight files of a component folder: from a `*.safetensors.index.json` if there is one, else all
    `*.safetensors`. Raises MlxdiffError when a shard named in the index is missing."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise MlxdiffError(f"{indexes[0]}: not a valid safetensors index (no weight_map)") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
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
                raise MlxdiffError(f"{f}: tensor {k!r} also appears in another shard of {folder}")
            weights[k] = v
    return weights


def file_bytes(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)
