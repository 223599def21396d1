"""Seeded, structure-aware fuzzing of mlxdiff's weight-file readers (issue 13: every bad input refused in one line).

    python bench/fuzz_readers.py --format safetensors --n 10000 --seed 1
    python bench/fuzz_readers.py --format gguf --n 10000 --seed 1
    python bench/fuzz_readers.py --format gguf-text --n 10000 --seed 1   (text-encoder metadata: fuzz_gguf_text.py)
    python bench/fuzz_readers.py --format lora --n 10000 --seed 1        (LoRA files: fuzz_lora.py)
    python bench/fuzz_readers.py --format palettized --n 10000 --seed 1  (palettized checkpoints: fuzz_palettized.py)
    python bench/fuzz_readers.py --format unet-lora --n 3000 --seed 1    (SD 1.x UNet LoRAs: fuzz_unet_lora.py)
    python bench/fuzz_readers.py --format coreml --n 1000 --seed 1       (Core ML packages: fuzz_coreml.py)

Mutant i of a seed is a function of (seed, i) alone, so `--only i --keep DIR` writes that one file back out. The
base files are small and valid: every safetensors dtype mlxdiff accepts (the F8 types and a zero-size tensor
included) with `__metadata__`; a GGUF with arrays (nested too) in its metadata and plain, 1-D quantized and
K-quant tensors. The mutation operators follow the study in shared/specs/readers-robustness.md: the header length,
bit flips, byte overwrites, truncation, structured header edits (dtypes, shapes, offsets, metadata, names, deep
nesting, huge literals, duplicate keys; GGUF counts, lengths, types, dims, offsets, alignment), data bytes, and
2-3 of these stacked.

Each mutant is read in a child forked from this process (which has imported the readers but run no MLX work),
under RLIMIT_AS (4 GiB) and an alarm: `open_weights`, then every array evaluated and every quantized tensor
dequantized. The child compares what it read with a trusted reference reading the same bytes: safetensors' own
Rust parser (`safetensors.deserialize`), its bytes decoded by numpy and the float8 types by torch (a 256-entry
table made once, in a subprocess); for GGUF, gguf-py's GGUFReader and `gguf.quants.dequantize`.

Outcome classes. Acceptable: `refused ...` (one MlxdiffError line that names the file) and `loaded = reference`.
Not: `WRONG ...` (a load that differs from the reference, or that the reference refuses), `exception` (any other
exception: the reader let a traceback through), `unclean error` (an MlxdiffError of several lines, or without the
path), `hang` (the alarm fired), `crash` (any other signal). The fork pattern is tests/adversarial.py's; its server
pre-imports the CLI, not the readers and their references (gguf-py alone costs 0.25 s a child), so this script
forks from itself.
"""

import argparse
import json
import math
import os
import random
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # gguf_helpers: the GGUF writer and header-field walker

import mlxdiff  # noqa: E402,F401  (OpenBLAS preload before mlx)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import safetensors  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf import quants as gq  # noqa: E402

from gguf_helpers import T, header_fields, random_blocks, write_gguf  # noqa: E402
import fuzz_gguf_text as gguf_text  # noqa: E402  (--format gguf-text: text-encoder metadata mutants)
import fuzz_lora as lora_fuzz  # noqa: E402  (--format lora: LoRA mutants against diffusers' loading)
import fuzz_palettized as palettized_fuzz  # noqa: E402  (--format palettized: palettized checkpoint mutants)
import fuzz_unet_lora as unet_lora_fuzz  # noqa: E402  (--format unet-lora: UNet LoRA mutants against diffusers')
from mlxdiff.errors import MlxdiffError  # noqa: E402
from mlxdiff.formats import open_weights  # noqa: E402
import mlxdiff.formats.gguf  # noqa: E402,F401  (open_weights imports it lazily: once here, not in each child)
from mlxdiff.formats.quantized import Float8Weight, QuantizedTensor, RawBlocks  # noqa: E402

MEMORY = 4 << 30
TIMEOUT_S = 10
ACCEPTABLE = ("refused", "loaded = reference")

# ---------------------------------------------------------------------------------------------------------------
# Base files

ST_TENSORS = [("f32", "F32", [4, 8]), ("f16", "F16", [8, 4]), ("bf16", "BF16", [3, 5]), ("i32", "I32", [5]),
              ("u8", "U8", [3, 7]), ("i64", "I64", [2, 2]), ("bool", "BOOL", [3]), ("e4m3", "F8_E4M3", [16]),
              ("e8m0", "F8_E8M0", [6]), ("c64", "C64", [2]), ("u16", "U16", [3]), ("i16", "I16", [2]),
              ("i8", "I8", [4]), ("u32", "U32", [2]), ("u64", "U64", [1]), ("empty", "F32", [0, 3])]
# the fuzzer's own tables (not the reader's: it is what is under test)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
            "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "C64": 8, "F64": 8, "F8_E5M2": 1}
NUMPY = {"BOOL": "?", "U8": "<u1", "I8": "<i1", "U16": "<u2", "I16": "<i2", "F16": "<f2", "BF16": "<u2",
         "U32": "<u4", "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8", "C64": "<c8"}
SAME_SIZE = [["BOOL", "U8", "I8", "F8_E4M3", "F8_E8M0", "F8_E5M2"], ["U16", "I16", "F16", "BF16"],
             ["U32", "I32", "F32"], ["U64", "I64", "C64", "F64"]]


def write_safetensors(path, tensors, metadata):
    """tensors: [(name, dtype, shape, bytes)], laid out in order; the header padded to 8 bytes as safetensors
    pads it. (safetensors.numpy cannot write BF16 or the F8 types: numpy has no such dtypes.)"""
    header, pos, data = {"__metadata__": metadata}, 0, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def safetensors_base(path):
    rng = np.random.default_rng(20261201)
    tensors = []
    for name, dtype, shape in ST_TENSORS:
        k = math.prod(shape)
        normal = rng.standard_normal(2 * k if dtype == "C64" else k).astype(np.float32)   # finite floats
        if dtype in ("F32", "C64"):
            raw = normal.tobytes()
        elif dtype == "F16":
            raw = normal.astype(np.float16).tobytes()
        elif dtype == "BF16":
            raw = (normal.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            codes = rng.integers(0, 256, k * ITEMSIZE[dtype], dtype=np.uint8)
            if dtype == "BOOL":
                codes &= 1
            if dtype == "F8_E8M0":   # both ends: 2^-127 and NaN
                codes[:2] = (0, 255)
            raw = codes.tobytes()
        tensors.append((name, dtype, shape, raw))
    return write_safetensors(path, tensors, {"format": "pt", "note": "mlxdiff reader fuzz base"})


def gguf_base(path):
    rng = np.random.default_rng(20261202)
    bf16 = np.ascontiguousarray(np.frombuffer(rng.standard_normal(8).astype(np.float32).tobytes(), np.uint16)[1::2])
    tensors = {"t.f32": (T.F32, rng.standard_normal((4, 8)).astype(np.float32)),
               "t.f16": (T.F16, rng.standard_normal(16).astype(np.float16)),
               "t.bf16": (T.BF16, bf16.view(np.uint8).reshape(2, 8)),
               "t.q8.weight": (T.Q8_0, random_blocks(T.Q8_0, 2, 64, rng)),
               "t.q4.bias": (T.Q4_0, random_blocks(T.Q4_0, 1, 64, rng)[0]),
               "t.q51.weight": (T.Q5_1, random_blocks(T.Q5_1, 2, 32, rng)),
               "t.q4k.weight": (T.Q4_K, random_blocks(T.Q4_K, 2, 256, rng)),
               "t.q6k.weight": (T.Q6_K, random_blocks(T.Q6_K, 2, 256, rng)),
               "t.q3k.weight": (T.Q3_K, random_blocks(T.Q3_K, 1, 256, rng)),
               "t.q2k.weight": (T.Q2_K, random_blocks(T.Q2_K, 1, 256, rng))}
    metadata = {"general.name": "tiny", "test.u32": 7, "test.ints": [1, 2, 3], "test.strs": ["a", "bc"],
                "test.bools": [True, False], "test.nested": [[1, 2], [3, 4, 5]]}
    return write_gguf(path, tensors, metadata, alignment=32)


# ---------------------------------------------------------------------------------------------------------------
# Safetensors mutations: each returns (bytes, a short description of what it did)

BIG = [0, 1, 2, 7, 8, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 32 + 5, 2 ** 40, 2 ** 62, 2 ** 63, 2 ** 64 - 1, 2 ** 64]
NUMBER_LITERALS = ["9" * 5000, "9" * 25, "18446744073709551616", "1e400", "-0", "1e2", "4.0", "-1", "0x10", "+4",
                   "04", "NaN", "Infinity", "true", "null", '"4"', "[]", "{}"]


# the kinds of mutation, each tagged "[kind]" in a mutant's description (run_mutants counts them); HEADER_EDITS are
# _edit_header's operators, in the order of its op numbers
HEADER_EDITS = ("dtype", "shape", "data_offsets", "field removed", "field added", "entry replaced", "metadata",
                "rename", "tensor added", "tensor removed or swapped", "literal", "deep nesting", "duplicate keys",
                "layout")
ST_KINDS = ("header length", "bit flips", "JSON bytes", "truncated", *(f"header {e}" for e in HEADER_EDITS),
            "old length kept", "data bytes", "stacked")
GGUF_KINDS = ("bit flips", "header bytes", "truncated", "field (listed value)", "field (random value)", "data bytes",
              "appended", "stacked")


def _split_st(data):
    (n,) = struct.unpack_from("<Q", data)
    return n, json.loads(data[8:8 + n]), data[8 + n:]


def _st_bytes(header_text: bytes, rest: bytes, length=None):
    return struct.pack("<Q", len(header_text) if length is None else length) + header_text + rest


def _nest(rng, value_text):
    depth = rng.choice([2, 4, 50, 999, 1000, 5000, 100000])
    if rng.random() < 0.5:
        return "[" * depth + value_text + "]" * depth, f"nested {depth} deep in lists"
    return '{"a":' * depth + value_text + "}" * depth, f"nested {depth} deep in objects"


def _edit_header(rng, header, data_len):
    """A structured edit of the parsed header: returns (header or raw JSON text, description tagged with its kind)."""
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    op = rng.randrange(len(HEADER_EDITS))
    edited, what = _edit_header_op(rng, header, data_len, names, name, op)
    return edited, f"[header {HEADER_EDITS[op]}] {what}"


def _edit_header_op(rng, header, data_len, names, name, op):
    entry = header[name]
    if op == 0:
        same = next(g for g in SAME_SIZE if entry["dtype"] in g)
        value = rng.choice([*same, *same, "F99", "", entry["dtype"].lower(), "F64", "F8_E5M2", "F4", "F6_E2M3",
                            "F8_E4M3FNUZ", *ITEMSIZE, 1, None, ["F32"], {"F32": 1}, True, 4.0])
        entry["dtype"] = value
        return header, f"{name}.dtype = {value!r}"
    if op == 1:
        shape = entry["shape"]
        prod = math.prod(shape)
        value = rng.choice([[], [-1], [-1, -4], [2 ** 31], [2 ** 31 - 1], [0, 2 ** 31], [0, 2 ** 32 + 5],
                            [0, 2 ** 31 - 1], [2 ** 63], [2 ** 64], [2 ** 64 - 1], [1.5], ["4"], [True], None, 4,
                            {"0": 4}, [[4]], shape[::-1], shape + [1], [1] + shape, [prod], [0] + shape,
                            [1] * 100, [0] * 9, [1] * 8 + [prod], shape[:-1] + [shape[-1] * 2 if shape else 2],
                            [rng.choice(BIG)], [rng.choice(BIG), 0], [2, prod // 2] if prod % 2 == 0 else [prod, 1]])
        entry["shape"] = value
        return header, f"{name}.shape = {value!r}"
    if op == 2:
        a, b = entry["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        value = rng.choice([[b, a], [a + 1, b + 1], [a - 1, b - 1], [a + 8, b + 8], [a, b + 1], [a, b - 1], [0, 0],
                            [a, data_len + 8], list(other), [-a - 1, b], [a + 0.5, b], [str(a), b], [a], [a, b, b],
                            [0, 2 ** 64 - 1], [True, b], None, {"a": a}, [a, 2 ** 64 + b], [a - 2 ** 64, b]])
        entry["data_offsets"] = value
        return header, f"{name}.data_offsets = {value!r}"
    if op == 3:
        key = rng.choice(["dtype", "shape", "data_offsets"])
        del entry[key]
        return header, f"{name} without {key}"
    if op == 4:
        entry[rng.choice(["extra", "offsets", "Dtype"])] = 1
        return header, f"{name} with an extra key"
    if op == 5:
        value = rng.choice([[], "x", 1, None, {}, [entry]])
        header[name] = value
        return header, f"{name} = {value!r}"[:80]
    if op == 6:
        value = rng.choice([[], 1, "x", None, {"k": 1}, {"k": None}, {"k": {"a": "b"}}, {"k": ["a"]},
                            {"k": "v" * 100000}, {"": ""}, "__delete__"])
        if value == "__delete__":
            header.pop("__metadata__", None)
        else:
            header["__metadata__"] = value
        return header, f"__metadata__ = {str(value)[:40]}"
    if op == 7:   # renames: an empty name, a NUL, a lone surrogate, non-ASCII, "__metadata__", another's name
        new = rng.choice(["", "a\0b", "\ud800", "\udfff x", "é", " " + name, name + " ", "__metadata__", "x" * 70000,
                          rng.choice(names)])
        renamed = {(new if k == name else k): v for k, v in header.items()}
        if new in header and new != name:   # a duplicate key: only expressible as text
            text = json.dumps(header)
            text = text.replace(json.dumps(name) + ":", json.dumps(new) + ":", 1)
            return text, f"{name} renamed to the duplicate {new!r}"
        return renamed, f"{name} renamed to {new[:20]!r}"
    if op == 8:   # an added tensor: zero-size, overlapping another, or past the end
        a, b = entry["data_offsets"]
        header["added"] = rng.choice([{"dtype": "U8", "shape": [0], "data_offsets": [a, a]},
                                      {"dtype": "U8", "shape": [b - a], "data_offsets": [a, b]},
                                      {"dtype": "U8", "shape": [4], "data_offsets": [data_len, data_len + 4]},
                                      {"dtype": "F32", "shape": [0, 2 ** 31 - 1], "data_offsets": [0, 0]}])
        return header, f"added {header['added']}"
    if op == 9:   # a tensor removed (its bytes stay: a gap or trailing bytes), or two same-size tensors swapped
        same = [k for k in names if k != name and header[k]["data_offsets"][1] - header[k]["data_offsets"][0]
                == entry["data_offsets"][1] - entry["data_offsets"][0]]
        if same and rng.random() < 0.5:
            other = rng.choice(same)
            entry["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], entry["data_offsets"]
            return header, f"offsets of {name} and {other} swapped"
        del header[name]
        return header, f"{name} removed"
    if op == 10:   # a literal in place of one number (or string) of the header text
        text = json.dumps(header)
        target = rng.choice([f'"data_offsets": [{entry["data_offsets"][0]}',
                             f'"shape": [{entry["shape"][0]}' if entry["shape"] else '"shape": [',
                             json.dumps(entry["dtype"])])
        lit = rng.choice(NUMBER_LITERALS)
        if target.startswith('"data_offsets"') or (target.startswith('"shape"') and entry["shape"]):
            new = target.rsplit("[", 1)[0] + "[" + lit
        elif target.startswith('"shape"'):
            new = target + lit
        else:
            new = lit
        i = text.find(json.dumps(name) + ":")
        j = text.find(target, i)
        return text[:j] + new + text[j + len(target):], f"{name}: literal {lit[:20]} in {target[:20]}"
    if op == 11:   # deep nesting, in a shape, in the metadata or around everything
        text = json.dumps(header)
        where = rng.randrange(3)
        if where == 0:
            nested, what = _nest(rng, "4")
            i = text.find(json.dumps(name) + ":")
            j = text.find('"shape": [', i) + len('"shape": [')
            return text[:j] + nested + "," + text[j:], f"{name}.shape {what}"
        if where == 1:
            nested, what = _nest(rng, '"v"')
            return text[:1] + '"__nest__": ' + nested + ", " + text[1:], f"a key {what}"
        nested, what = _nest(rng, text)
        return nested, f"the header {what}"
    if op == 12:   # duplicate keys: a field inside an entry, or a whole entry
        text = json.dumps(header)
        i = text.find(json.dumps(name) + ":")
        if rng.random() < 0.5:
            j = text.find("{", i) + 1
            field = rng.choice(['"dtype": "U8", ', '"shape": [1], ', '"data_offsets": [0, 0], '])
            return text[:j] + field + text[j:], f"{name}: duplicate field {field.split(':')[0]}"
        dup = json.dumps({name: {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})[1:-1]
        return text[:-1] + ", " + dup + "}", f"{name}: duplicate entry"
    # many tensors (cost), or the text laid out differently (whitespace, ASCII escapes, padding, junk, BOM)
    choice = rng.randrange(8)
    if choice == 0:
        for k in range(rng.choice([100, 3000])):
            header[f"zero.{k}"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
        return header, f"{len(header)} tensors"
    text = json.dumps(header, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5)
    text, what = [(text, "re-serialized"), (text + " " * 7, "space padding"), (text + "\0" * 7, "NUL padding"),
                  (text + "}", "trailing brace"), (text + "x", "trailing junk"), ("\ufeff" + text, "BOM"),
                  ("\t\n " + text, "leading whitespace")][choice - 1]
    return text, what


def mutate_safetensors(base: bytes, rng: random.Random):
    n, header, rest = _split_st(base)
    op = rng.random()
    data = bytearray(base)
    if op < 0.10:
        value = rng.choice([0, 1, 2, 7, n - 1, n + 1, n - 8, n + 8, 10 ** 8, 2 ** 32, 2 ** 62, 2 ** 64 - 1,
                            len(base) - 8, len(base), rng.randrange(2 ** 64)])
        struct.pack_into("<Q", data, 0, value)
        return bytes(data), f"[header length] header length {value}"
    if op < 0.23:
        flips = [rng.randrange(8 + n) for _ in range(rng.randint(1, 4))]
        for p in flips:
            data[p] ^= 1 << rng.randrange(8)
        return bytes(data), f"[bit flips] bit flips at {flips}"
    if op < 0.35:
        spots = [rng.randrange(8, 8 + n) for _ in range(rng.randint(1, 8))]
        for p in spots:
            data[p] = rng.choice(b'{}[]",:0123456789-.eE\\ \x00\xff' + bytes([rng.randrange(256)]))
        return bytes(data), f"[JSON bytes] JSON bytes overwritten at {spots}"
    if op < 0.45:
        cut = rng.randrange(len(base))
        return base[:cut], f"[truncated] truncated at {cut}"
    if op < 0.90:
        edited, what = _edit_header(rng, header, len(rest))
        text = (edited if isinstance(edited, str) else json.dumps(edited)).encode("utf-8", "surrogatepass")
        if rng.random() < 0.1:   # the old length kept: the JSON then ends early or runs into the data
            return _st_bytes(text, rest, n), f"[old length kept] {what}, length not updated"
        return _st_bytes(text, rest), what
    if op < 0.95:
        spots = [rng.randrange(8 + n, len(base)) for _ in range(rng.randint(1, 8))]
        for p in spots:
            data[p] = rng.randrange(256)
        return bytes(data), f"[data bytes] data bytes changed at {spots}"
    first, a = mutate_safetensors(base, rng)
    try:
        second, b = mutate_safetensors(first, rng)
    except Exception:   # the first mutant no longer parses the way the structured edits need
        return first, f"[stacked] {a}"
    return second, f"[stacked] {a}; then {b}"


# ---------------------------------------------------------------------------------------------------------------
# GGUF mutations (generalised from tests/test_gguf.py's first fuzz run)

def gguf_fields(base: bytes):
    """[(byte position, struct format, what)] of every header field worth corrupting."""
    f = header_fields(base)
    fields = [(8, "Q", "tensor count"), (16, "Q", "kv count")]
    for e in f["kvs"]:
        fields += [(e["key_len"], "Q", f"{e['key']} key length"), (e["type"], "I", f"{e['key']} value type")]
        if "length" in e:
            fields += [(e["item_type"], "I", f"{e['key']} item type"), (e["length"], "Q", f"{e['key']} length")]
        elif e["key"] == "general.name":
            fields.append((e["value"], "Q", "general.name string length"))
        elif e["key"] == "general.alignment":
            fields.append((e["value"], "I", "general.alignment"))
    for e in f["tensors"]:
        fields += [(e["name_len"], "Q", f"{e['name']} name length"), (e["n_dims"], "I", f"{e['name']} n_dims"),
                   (e["type"], "I", f"{e['name']} type"), (e["offset"], "Q", f"{e['name']} offset")]
        fields += [(p, "Q", f"{e['name']} dim {i}") for i, p in enumerate(e["dims"])]
    return f, fields


def mutate_gguf(base: bytes, rng: random.Random, layout):
    f, fields = layout
    end = f["header_end"]
    data = bytearray(base)
    offsets = [struct.unpack_from("<Q", base, e["offset"])[0] for e in f["tensors"]]
    data_start = -(-end // 32) * 32
    op = rng.random()
    if op < 0.2:
        flips = [rng.randrange(end) for _ in range(rng.randint(1, 4))]
        for p in flips:
            data[p] ^= 1 << rng.randrange(8)
        return bytes(data), f"[bit flips] bit flips at {flips}"
    if op < 0.35:
        spots = [rng.randrange(end) for _ in range(rng.randint(1, 8))]
        for p in spots:
            data[p] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        return bytes(data), f"[header bytes] header bytes overwritten at {spots}"
    if op < 0.45:
        cut = rng.randrange(len(base))
        return base[:cut], f"[truncated] truncated at {cut}"
    if op < 0.88:
        pos, fmt, what = rng.choice(fields)
        limit = 1 << (8 * struct.calcsize(fmt))
        old = struct.unpack_from("<" + fmt, base, pos)[0]
        absurd = [0, 1, 2, 3, 4, 5, 9, 13, 31, 32, 33, 64, 255, 256, 1 << 31, 1 << 32, 1 << 40, 1 << 60, 1 << 63,
                  limit - 1, len(base), len(base) + 1, end, old + 1, old - 1, old * 2, rng.randrange(42)]
        if what.endswith("offset"):
            absurd += [len(base) - data_start, old + 1, (1 << 64) - data_start, *offsets]
        value = (rng.choice(absurd) if op < 0.8 else rng.randrange(limit)) % limit
        struct.pack_into("<" + fmt, data, pos, value)
        return bytes(data), f"[field ({'listed' if op < 0.8 else 'random'} value)] {what} = {value}"
    if op < 0.93:
        spots = [rng.randrange(data_start, len(base)) for _ in range(rng.randint(1, 8))]
        for p in spots:
            data[p] = rng.randrange(256)
        return bytes(data), f"[data bytes] data bytes changed at {spots}"
    if op < 0.95:
        junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 31, 32, 100])))
        return base + junk, f"[appended] {len(junk)} bytes appended"
    first, a = mutate_gguf(base, rng, layout)
    second, b = mutate_gguf(first, rng, layout) if len(first) >= len(base) else (first, "")
    return second, f"[stacked] {a}; then {b}" if b else f"[stacked] {a}"


# ---------------------------------------------------------------------------------------------------------------
# Reading one mutant (in the child): ours, then the reference, then the comparison

def _f32_from_bf16(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _same_floats(a, b):
    """Equal values (every NaN equal to every NaN, -0 to 0: decoders differ in the sign of a zero product)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def read_ours(path):
    """{name: (kind, numpy array)}: what mlxdiff reads, every array evaluated, quantized tensors dequantized."""
    out = {}
    for name, value in open_weights(path, mx.float32).items():
        kind = None   # the array's dtype, or the quantized form and its GGUF type
        if isinstance(value, QuantizedTensor):
            kind, value = f"QuantizedTensor {value.source_type}", value.dequantize()
        elif isinstance(value, RawBlocks):
            kind, value = f"RawBlocks {value.type_name}", value.dequantize()
        elif isinstance(value, Float8Weight):   # fp8 kept at 8 bits (formats/fp8.py): its decoded values
            kind, value = "Float8Weight", value.dequantize(mx.float32)
        mx.eval(value)
        if value.dtype == mx.bfloat16:
            out[name] = (kind or "bfloat16", _f32_from_bf16(np.array(mx.view(value, mx.uint16))))
        else:
            out[name] = (kind or str(value.dtype).split(".")[-1], np.array(value))
    return out


def compare_safetensors(ours, data, tables):
    ref = {name: t for name, t in safetensors.deserialize(data)}
    if ours.keys() != ref.keys():
        return f"names differ: {sorted(ours.keys() ^ ref.keys())[:3]}"
    for name, t in ref.items():
        kind, got = ours[name]
        dtype, shape, raw = t["dtype"], tuple(t["shape"]), bytes(t["data"])
        if got.shape != shape:
            return f"{name!r}: shape {got.shape}, the reference {shape}"
        if dtype in tables:   # float8: decoded at load (a float dtype) or kept at 8 bits; each code by torch's table
            want = tables[dtype][np.frombuffer(raw, np.uint8)].reshape(shape)
            if kind not in ("bfloat16", "float16", "float32", "Float8Weight") or not _same_floats(got, want):
                return f"{name!r} ({dtype}): values differ (read as {kind})"
        elif dtype == "BF16":
            if kind != "bfloat16" or not _same_floats(got, _f32_from_bf16(np.frombuffer(raw, "<u2")).reshape(shape)):
                return f"{name!r} (BF16): values differ (read as {kind})"
        else:
            want = np.frombuffer(raw, NUMPY[dtype]).reshape(shape)
            if got.dtype != want.dtype or got.tobytes() != want.tobytes():
                return f"{name!r} ({dtype}): read as {got.dtype}, values {'equal' if got.dtype == want.dtype else '?'}"
    return None


# 1-D tensors of these types are returned as an affine approximation (formats/gguf.py: Q6_K near-exact, Q2_K
# requantized); every other type and layout is exact against gguf-py
APPROXIMATE_1D = {"Q6_K": 0.02, "Q2_K": 0.2}


class SpecViolation(Exception):
    """What the GGUF spec forbids and gguf-py does not check: the reference refuses the file."""


def compare_gguf(ours, path):
    reader = GGUFReader(path)
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in reader.tensors)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise SpecViolation(f"tensors {a!r} and {b!r} overlap")
    for start, _, name in spans:
        if (start - reader.data_offset) % reader.alignment:
            raise SpecViolation(f"tensor {name!r} is not aligned to {reader.alignment}")
    ref = {t.name: t for t in reader.tensors}
    if ours.keys() != ref.keys():
        return f"names differ: {sorted(ours.keys() ^ ref.keys())[:3]}"
    for name, t in ref.items():
        kind, got = ours[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        want = gq.dequantize(t.data, t.tensor_type).reshape(shape)
        type_name = t.tensor_type.name
        if got.shape != shape:
            return f"{name!r} ({type_name}): shape {got.shape}, the reference {shape}"
        if type_name in ("F32", "F16", "BF16"):
            expected = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[type_name]
            if kind != expected or not _same_floats(got, want):
                return f"{name!r} ({type_name}): values differ (read as {kind})"
            continue
        if len(shape) == 1 and type_name in APPROXIMATE_1D:
            scale = max(float(np.abs(want).max()), 1e-30)
            if float(np.abs(got - want).max()) > APPROXIMATE_1D[type_name] * scale:
                return f"{name!r} ({type_name}, 1-D): beyond its documented approximation"
            continue
        if not kind.endswith(type_name) and len(shape) > 1:
            return f"{name!r}: read as {kind}, the reference says {type_name}"
        if not _same_floats(got, want):
            return f"{name!r} ({type_name}): values differ from gguf-py's dequantize"
    return None


def _coreml_fuzz():
    """bench/fuzz_coreml.py (--format coreml), imported only for it: coremltools (and the torch it loads) would grow
    every other format's children's address space past their cap."""
    import fuzz_coreml  # heavy: coremltools, for --format coreml alone
    return fuzz_coreml


def classify(path, fmt, tables, report=lambda provisional: None):
    """One outcome class (and a detail) for the file at `path`. `report(outcome)`: a provisional outcome, the one
    counted if what follows it (a reference) hangs or crashes the child; for LoRA files `tables` is the context
    fuzz_lora.lora_context() made."""
    if fmt == "lora":
        return lora_fuzz.classify(path, tables, report)
    if fmt == "palettized":   # `tables`: fuzz_palettized.context()'s base checkpoint and layer shapes
        return palettized_fuzz.classify(path, tables, report)
    if fmt == "unet-lora":   # `tables`: fuzz_unet_lora.context()'s twins and base LoRA
        return unet_lora_fuzz.classify(path, tables, report)
    if fmt == "coreml":   # `tables`: fuzz_coreml.context()'s base package, UNet config and const names
        return _coreml_fuzz().classify(path, tables, report)
    if fmt == "gguf-text":   # ours: the text encoder read, built and run; the reference: bench/fuzz_gguf_text.py
        return gguf_text.classify(path)
    data = Path(path).read_bytes()
    try:
        ours = read_ours(path)
    except MlxdiffError as e:
        message = str(e)
        if "\n" in message or str(path) not in message:
            return "unclean error", message[:300]
        if fmt == "gguf":   # gguf-py is not safe to run on a file we refuse (it can loop without bound)
            return "refused", message[:600]
        try:
            safetensors.deserialize(data)
        except Exception:
            return "refused (reference refuses too)", message[:600]
        return "refused (reference accepts)", message[:600]
    try:
        diff = compare_safetensors(ours, data, tables) if fmt == "safetensors" else compare_gguf(ours, path)
    except Exception as e:
        return "WRONG: loaded, the reference refuses", f"{type(e).__name__}: {str(e)[:200]}"
    return ("WRONG: differs from the reference", diff) if diff else ("loaded = reference", "")


def _where():
    """file:line of the innermost frame of the exception being handled that is not the standard library's."""
    frames = traceback.extract_tb(sys.exc_info()[2])
    ours = [f for f in frames if "python3." not in f.filename] or frames
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"


def _child(path, fmt, tables, wfd, timeout, memory):
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.alarm(timeout)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    start = time.perf_counter()

    def report(provisional):
        os.write(wfd, (json.dumps({**provisional, "s": time.perf_counter() - start}) + "\n").encode())
    try:
        outcome, detail = classify(path, fmt, tables, report)
    except MemoryError:
        outcome, detail = "memory", _where()
    except BaseException as e:
        outcome, detail = f"exception {type(e).__name__}", f"{_where()}: {str(e)[:200]}"
    os.write(wfd, json.dumps({"class": outcome, "detail": detail, "s": time.perf_counter() - start}).encode())
    os._exit(0)


def run_one(path, fmt, tables, timeout=TIMEOUT_S, memory=MEMORY) -> dict:
    """Classify one file in a forked child; a signal, a hang or no answer is a class of its own."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(path, fmt, tables, w, timeout, memory)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout + 10
    while True:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:   # the alarm did not end it: stop it here
            os.kill(pid, signal.SIGKILL)
            break
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    lines = b"".join(chunks).split(b"\n")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        what = "hang" if sig in (signal.SIGALRM, signal.SIGKILL) else f"crash {signal.Signals(sig).name}"
        if len(lines) > 1:   # ours was done, then the reference hung or crashed: the provisional outcome
            provisional = json.loads(lines[-2])
            return {**provisional, "detail": f"{provisional['detail'][:400]} (the reference: {what})", "s": None}
        return {"class": what, "detail": "", "s": None}
    try:
        return json.loads(lines[-1])
    except ValueError:
        return {"class": f"no answer (exit {os.WEXITSTATUS(status)})", "detail": "", "s": None}


def float8_tables() -> dict:
    """{dtype: float32[256]}: torch's decoding of every F8_E4M3 and F8_E8M0 code (in a subprocess: importing torch
    here would put it in every forked child)."""
    code = ("import torch, json; t = torch.arange(256, dtype=torch.uint8); print(json.dumps({d: t.view(getattr("
            "torch, n)).float().view(torch.int32).tolist() for d, n in (('F8_E4M3', 'float8_e4m3fn'), "
            "('F8_E8M0', 'float8_e8m0fnu'))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return {d: np.array(bits, np.int32).view(np.float32) for d, bits in json.loads(out.stdout).items()}


# ---------------------------------------------------------------------------------------------------------------
# The run


def mutant(fmt, base, layout, seed, i):
    rng = random.Random(f"{fmt}-{seed}-{i}")
    return mutate_safetensors(base, rng) if fmt == "safetensors" else mutate_gguf(base, rng, layout)


def _reason(message, path):
    """A refusal message without its particulars (path, names, numbers), to count refusals by reason."""
    text = message.replace(str(path), "").lstrip(": ")
    for pattern, repl in ((r"'[^']*'", "'.'"), (r"\[[^\]]*\]", "[..]"), (r"\d+", "N")):
        text = re.sub(pattern, repl, text)
    return text.split("; re-")[0][:110]


def _virtual_size() -> int:
    """This process's address space in bytes (torch, diffusers and MLX imported reserve some GB of it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def fuzz(fmt, n, seed, workdir, keep=None, only=None, timeout=TIMEOUT_S, memory=MEMORY) -> dict:
    if fmt == "lora":   # the cap is on what a child adds to the address space it inherits (torch's included)
        return lora_fuzz.fuzz(n, seed, workdir, keep, only,
                              lambda path, ctx: run_one(path, fmt, ctx, timeout, memory + _virtual_size()),
                              run_mutants)
    if fmt == "unet-lora":   # as lora: torch's address space inherited
        return unet_lora_fuzz.fuzz(n, seed, workdir, keep, only,
                                   lambda path, ctx: run_one(path, fmt, ctx, timeout, memory + _virtual_size()),
                                   run_mutants)
    if fmt == "coreml":   # mutant package folders; coremltools' address space inherited, as torch's for lora
        return _coreml_fuzz().fuzz(n, seed, workdir, keep, only,
                                lambda path, ctx: run_one(path, fmt, ctx, timeout, memory + _virtual_size()),
                                run_mutants)
    if fmt == "palettized":   # mutants of a converted checkpoint, made in a subprocess
        return palettized_fuzz.fuzz(n, seed, workdir, keep, only,
                                    lambda path, ctx: run_one(path, fmt, ctx, timeout, memory), run_mutants)
    if fmt == "gguf-text":   # mutants made from a metadata list, not from a base file's bytes
        return gguf_text.fuzz(n, seed, workdir, keep, only, lambda path: run_one(path, fmt, {}, timeout, memory),
                              run_mutants)
    workdir = Path(workdir)
    ext = ".safetensors" if fmt == "safetensors" else ".gguf"
    base_path = (safetensors_base if fmt == "safetensors" else gguf_base)(workdir / f"base{ext}")
    base = base_path.read_bytes()
    layout = gguf_fields(base) if fmt == "gguf" else None
    tables = float8_tables() if fmt == "safetensors" else {}
    check = run_one(base_path, fmt, tables, timeout, memory)
    if check["class"] != "loaded = reference":
        raise SystemExit(f"the base file does not read as the reference: {check}")

    def write_case(i):
        data, what = mutant(fmt, base, layout, seed, i)
        path = workdir / f"mutant-{i}{ext}"
        path.write_bytes(data)
        return path, what

    return run_mutants(fmt, n, seed, only, keep, write_case,
                       lambda path: run_one(path, fmt, tables, timeout, memory),
                       ST_KINDS if fmt == "safetensors" else GGUF_KINDS)


def run_mutants(fmt, n, seed, only, keep, write_case, classify, kinds=()) -> dict:
    """The loop every format shares: mutant i written (`write_case(i)` -> (path, what it changed)), classified in a
    forked child (`classify(path)`, run_one), counted; the unacceptable ones (and `only`) listed, and kept in `keep`.
    `kinds`: the format's kinds of mutation, each tagged "[kind]" in the descriptions; the result's "kinds" counts the
    mutants that drew each (every one listed, zeros too)."""
    counts, failures, stricter, slowest = Counter(), [], Counter(), (0.0, None)
    drawn = Counter({k: 0 for k in kinds})
    started = time.perf_counter()
    for i in (range(n) if only is None else [only]):
        path, what = write_case(i)
        drawn.update(k for k in kinds if f"[{k}]" in what)
        result = classify(path)
        cls = result["class"]
        counts[cls] += 1
        if cls == "refused (reference accepts)":
            stricter[_reason(result["detail"], path)] += 1
        if result["s"] is not None and result["s"] > slowest[0]:
            slowest = (result["s"], i)
        if not cls.startswith(ACCEPTABLE) or only is not None:
            failures.append({"i": i, "mutation": what, **result})
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                (Path(keep) / path.name).write_bytes(path.read_bytes())
        path.unlink()
    result = {"format": fmt, "n": sum(counts.values()), "seed": seed, "counts": dict(counts),
              "unacceptable": sum(c for k, c in counts.items() if not k.startswith(ACCEPTABLE)),
              "slowest_s": slowest[0], "slowest_mutant": slowest[1], "wall_s": time.perf_counter() - started,
              "stricter": dict(stricter.most_common()), "failures": failures[:500]}
    if kinds:
        result["kinds"] = dict(drawn)
    return result


def table(result) -> str:
    n = result["n"]
    lines = [f"{result['format']}: {n} mutants, seed {result['seed']}, {result['wall_s']:.0f} s "
             f"(slowest mutant {result['slowest_s']:.2f} s, #{result['slowest_mutant']})", "",
             "| outcome | count | share | acceptable |", "|---|---:|---:|---|"]
    for cls, c in sorted(result["counts"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cls} | {c} | {100 * c / n:.1f}% | {'yes' if cls.startswith(ACCEPTABLE) else '**NO**'} |")
    lines.append(f"| **unacceptable** | **{result['unacceptable']}** | | |")
    if result["stricter"]:
        lines += ["", "Refused where the reference accepts (checks it does not make), by reason:"]
        lines += [f"- {c} x {reason}" for reason, c in list(result["stricter"].items())[:12]]
    shown = Counter()
    for f in result["failures"]:   # the first three of each class
        shown[f["class"]] += 1
        if shown[f["class"]] <= 3:
            detail = " ".join(str(f["detail"]).split())[:300]
            lines.append(f"- #{f['i']} {f['mutation'][:100]}: {f['class']}: {detail}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=("safetensors", "gguf", "gguf-text", "lora", "palettized",
                                                 "unet-lora", "coreml"), required=True)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", type=int, help="run (and report) mutant i alone")
    p.add_argument("--keep", help="a folder to copy every unacceptable mutant (or --only's) into")
    p.add_argument("--json", help="also write the result as JSON here")
    p.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per mutant")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxdiff-fuzz-") as work:
        result = fuzz(args.format, args.n, args.seed, work, args.keep, args.only, args.timeout)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result["unacceptable"] else 0


if __name__ == "__main__":
    sys.exit(main())
