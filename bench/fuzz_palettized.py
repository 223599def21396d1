"""Palettized-checkpoint mutants for bench/fuzz_readers.py (`--format palettized`; issue 45).

    python bench/fuzz_readers.py --format palettized --n 10000 --seed 1

The base is a palettized checkpoint as `python -m mlxdiff.convert --quantize ...=p4:g16` writes one (make_base: a
small CLIP text encoder, its Linear layers as uint8 packed 4-bit indices `<layer>.weight` and a float32 table per 16
output rows `<layer>.lut`, the rest as stored, config.json with `quantization: {"mode": "palettize", ...}` and the
native mark), made in a subprocess (the fuzzer forks children, safe only in a process that has run no MLX work).
A mutant is the checkpoint with 1 to 3 structure-aware edits of its palettized layers: the table's length (2**n for
other n, not a power of two, longer, shorter), its groups (more, fewer, not dividing the rows), dtype (other floats,
integers, bool), rank (1-D, 3-D) and values (NaN, inf, others); the indices' dtype, shape (a byte column or a row
more or less, transposed, flattened) and bytes (any: every bit pattern is an index of a full table); a per-row scale
added (right, of another length, NaN); a layer's table or indices dropped or renamed; the config's quantization
(another mode, removed, other bits). The config travels in the file's `__metadata__` (the child reads it there).

Ours: the model built from the checkpoint as a load builds it (ComponentSpec.build: the strict loader, the
palettized layers made from the file's tables, the value checks), every parameter evaluated and every palettized
layer's dense weight decoded. The reference: the rules of the form written out here (formats/palettized.py's
docstring: a float table (groups, 2**n) with n in 1, 2, 3, 4, 6, 8 whose groups divide the rows, uint8 rows of the
bytes n-bit indices of the layer's inputs take, a float scale per row, finite values, the palettize mode) and a numpy
decode of the file's own bytes (little-endian bit strings per row, the lookup in the row's table, times the scale
in the table's dtype). Outcome classes, as fuzz_readers': `refused (reference refuses too)`, `refused (reference
accepts)`, `loaded = reference` (every palettized layer's weight equal to the reference's, bit for bit); not
acceptable: `WRONG: loaded, the reference refuses`, `WRONG: differs from the reference`, `exception`, `unclean
error`, `hang`, `crash`.
"""

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

from collections import Counter

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.palettized import PalettizedLinear
from mlxdiff.loading.quantize import materialize, quantize_model
from mlxdiff.loading.spec import NATIVE_KEY, ComponentSpec
from mlxdiff.models import clip

ROOT = Path(__file__).resolve().parents[1]
# the fuzzer's own tables (not the reader's: it is what is under test)
NBITS = (1, 2, 3, 4, 6, 8)
UNIT = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1), 6: (4, 3), 8: (1, 1)}   # indices per unit, bytes per unit
FLOATS = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
INTS = {"U8": "<u1", "I8": "<i1", "U16": "<u2", "I32": "<i4"}
TABLE_FLOATS = ("F32", "F16", "BF16")
# the base model: a small CLIP text encoder (widths 48 and 80: every layer's rows in groups of 16), MLX's random
# initial weights, its Linear layers palettized at p4:g16
CONFIG = {"vocab_size": 64, "hidden_size": 48, "intermediate_size": 80, "projection_dim": 48, "num_hidden_layers": 2,
          "num_attention_heads": 2, "max_position_embeddings": 8, "hidden_act": "quick_gelu",
          "architectures": ["CLIPTextModel"]}
SETTING = {"mode": "palettize", "bits": 4, "group_size": 16}
MAKE_BASE = "import sys; sys.path.insert(0, sys.argv[2]); import fuzz_palettized as F; F.make_base(sys.argv[1])"


def make_base(dest) -> Path:
    """The base checkpoint as mlxdiff.convert writes a palettized component (its parameters in the model's own
    names, config.json with the quantization and the native mark), and dims.json: {layer: [rows, inputs]} of its
    palettized layers. MLX work: in a subprocess for the forking fuzzer."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    mx.random.seed(20261207)
    model = clip.Model(clip.ModelArgs.from_dict(CONFIG))
    quantize_model(model, SETTING["bits"], SETTING["group_size"], SETTING["mode"])
    materialize(model)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlxdiff"})
    (dest / "config.json").write_text(json.dumps({**CONFIG, NATIVE_KEY: True, "quantization": SETTING}))
    dims = {p: [m.weight.shape[0], m.in_dims] for p, m in model.named_modules() if isinstance(m, PalettizedLinear)}
    (dest / "dims.json").write_text(json.dumps(dims))
    return dest


def row_bytes(cols, nbits):
    per, nbytes = UNIT[nbits]
    return -(-cols // per) * nbytes


def _bf16_to_f32(u16):
    return (np.asarray(u16, np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(f32):
    """Round to nearest even, as MLX's float32 -> bfloat16 cast (NaN kept NaN)."""
    bits = np.asarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f32), np.uint16(0x7FC0), rounded)


def parse(data: bytes):
    """safetensors bytes -> ({name: (dtype, shape, raw bytes)}, __metadata__), with the fuzzer's own parse."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    body = data[8 + n:]
    return {k: (v["dtype"], list(v["shape"]), body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}, metadata


def values(dtype, shape, raw):
    """A tensor's values as numpy (BF16 as float32; F8 and others as raw bytes, never edited)."""
    if dtype == "BF16":
        return _bf16_to_f32(np.frombuffer(raw, "<u2")).reshape(shape)
    if dtype in FLOATS:
        return np.frombuffer(raw, FLOATS[dtype]).reshape(shape).astype(np.float32)
    if dtype in INTS:
        return np.frombuffer(raw, INTS[dtype]).reshape(shape)
    if dtype == "BOOL":
        return np.frombuffer(raw, np.uint8).reshape(shape).astype(bool)
    return None


def encode(dtype, v) -> bytes:
    v = np.asarray(v)
    if dtype == "BF16":
        return _f32_to_bf16_bits(v.astype(np.float32)).astype("<u2").tobytes()
    if dtype in FLOATS:
        with np.errstate(all="ignore"):
            return v.astype(FLOATS[dtype]).tobytes()
    if dtype == "BOOL":
        return (v != 0).astype(np.uint8).tobytes()
    with np.errstate(all="ignore"):
        return np.nan_to_num(v).astype(np.int64).astype(INTS[dtype]).tobytes()


def to_bytes(tensors: dict, metadata: dict) -> bytes:
    header, pos, chunks = {"__metadata__": metadata}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        chunks.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def context(workdir: Path, here=False) -> dict:
    """The base checkpoint and what the reference knows of its layers; made in a subprocess unless `here`."""
    dest = Path(workdir) / "base-p4g16"
    if here:
        make_base(dest)
    else:
        subprocess.run([sys.executable, "-c", MAKE_BASE, str(dest), str(Path(__file__).parent)], check=True,
                       capture_output=True, timeout=600)
    tensors, _ = parse((dest / "model.safetensors").read_bytes())
    config = json.loads((dest / "config.json").read_text())
    dims = {k: tuple(v) for k, v in json.loads((dest / "dims.json").read_text()).items()}
    return {"tensors": tensors, "config": config, "dims": dims, "names": set(tensors)}


# -- mutations ------------------------------------------------------------------------------------------------------

def _set(t, name, dtype, v):
    v = np.asarray(v)
    t[name] = (dtype, list(v.shape), encode(dtype, v))


def _table(t, layer):
    dtype, shape, raw = t[f"{layer}.lut"]
    return dtype, values(dtype, shape, raw)


def mutate(ctx, rng: random.Random):
    """(tensors, config, what changed): 1 to 3 edits of the base."""
    t, config = dict(ctx["tensors"]), json.loads(json.dumps(ctx["config"]))
    layers, done = sorted(ctx["dims"]), []
    for _ in range(rng.choice([1, 1, 2, 3])):
        layer = rng.choice(layers)
        out, cols = ctx["dims"][layer]
        op = rng.choice(["length", "length", "groups", "table dtype", "table rank", "table value", "index dtype",
                         "index shape", "index bytes", "index bytes", "scale", "drop", "rename", "config"])
        lut_name, w_name = f"{layer}.lut", f"{layer}.weight"
        if lut_name not in t or w_name not in t:
            op = "config"
        try:
            _apply(op, t, config, layer, out, rng, done)
        except (IndexError, ValueError):   # an edit that does not apply to what an earlier one left (a 1-D table)
            done.append(f"{op} on {layer}: not applicable")
    return t, config, "; ".join(done)


def _apply(op, t, config, layer, out, rng, done):
    """One edit of `layer` (or of the config), said in `done`."""
    lut_name, w_name = f"{layer}.lut", f"{layer}.weight"
    if op == "length":
        dtype, lut = _table(t, layer)
        k = rng.choice([1, 2, 3, 4, 5, 8, 12, 16, 32, 64, 128, 256, 512])
        reps = -(-k // lut.shape[-1])
        _set(t, lut_name, dtype, np.concatenate([lut] * reps, axis=-1)[..., :k])
        done.append(f"{lut_name}: {k} entries")
    elif op == "groups":
        dtype, lut = _table(t, layer)
        g = rng.choice([1, 2, 3, 5, 7, out // 8, out, out + 1])
        reps = -(-g // lut.shape[0])
        _set(t, lut_name, dtype, np.concatenate([lut] * reps, axis=0)[:g])
        done.append(f"{lut_name}: {g} tables")
    elif op == "table dtype":
        dtype, lut = _table(t, layer)
        to = rng.choice(["F32", "F16", "F64", "I32", "U8", "BOOL"])
        _set(t, lut_name, to, lut)
        done.append(f"{lut_name}: {to}")
    elif op == "table rank":
        dtype, lut = _table(t, layer)
        _set(t, lut_name, dtype, lut.reshape(-1) if rng.random() < 0.5 else lut[None])
        done.append(f"{lut_name}: rank")
    elif op == "table value":
        dtype, lut = _table(t, layer)
        lut = lut.copy()
        value = rng.choice([float("nan"), float("inf"), -float("inf"), 1e30, 0.0, -3.5, 1e-30])
        lut.flat[rng.randrange(lut.size)] = value
        _set(t, lut_name, dtype, lut)
        done.append(f"{lut_name}: a {value}")
    elif op == "index dtype":
        dtype, shape, raw = t[w_name]
        to = rng.choice(["I8", "U16", "I32", "F32", "F16", "BOOL"])
        _set(t, w_name, to, values(dtype, shape, raw))
        done.append(f"{w_name}: {to}")
    elif op == "index shape":
        dtype, shape, raw = t[w_name]
        w = values(dtype, shape, raw)
        how = rng.choice(["column less", "column more", "row less", "row more", "transposed", "flat"])
        w = {"column less": lambda: w[:, :-1], "column more": lambda: np.concatenate([w, w[:, :1]], axis=1),
             "row less": lambda: w[:-1], "row more": lambda: np.concatenate([w, w[:1]]),
             "transposed": lambda: w.T, "flat": lambda: w.reshape(-1)}[how]()
        _set(t, w_name, dtype, w)
        done.append(f"{w_name}: {how}")
    elif op == "index bytes":
        dtype, shape, raw = t[w_name]
        data = bytearray(raw)
        for _ in range(rng.choice([1, 4, 64])):
            data[rng.randrange(len(data))] = rng.randrange(256)
        t[w_name] = (dtype, shape, bytes(data))
        done.append(f"{w_name}: bytes")
    elif op == "scale":
        dtype = rng.choice(["F32", "BF16", "F16", "I32"])
        n = rng.choice([out, out, out, out - 1, 1])
        scale = np.asarray([rng.uniform(0.25, 2.0) for _ in range(n)], np.float32)
        if rng.random() < 0.2:
            scale[0] = float("nan")
        _set(t, f"{layer}.scale", dtype, scale if rng.random() < 0.9 else scale.reshape(1, -1))
        done.append(f"{layer}.scale: {dtype} {n}")
    elif op == "drop":
        name = rng.choice([lut_name, w_name])
        t.pop(name)
        done.append(f"{name} dropped")
    elif op == "rename":
        new = layer.replace("layers.", "lairs.", 1) if rng.random() < 0.5 else layer + "_x"
        for name in [n for n in t if n.startswith(layer + ".")]:
            t[new + name[len(layer):]] = t.pop(name)
        done.append(f"{layer} renamed {new}")
    else:
        q = config.get("quantization") or {}
        how = rng.choice(["affine", "removed", "bits", "group size", "mode typo"])
        if how == "affine":
            q["mode"] = "affine"
        elif how == "removed":
            config.pop("quantization", None)
        elif how == "bits":
            q["bits"] = rng.choice([2, 6, 8])
        elif how == "group size":
            q["group_size"] = rng.choice([None, 8, 32])
        else:
            q["mode"] = "palettise"
        if how != "removed":
            config["quantization"] = q
        done.append(f"config: {how}")


# -- ours and the reference ---------------------------------------------------------------------------------------

def ours(path, config) -> dict:
    """{layer: float32 dense weight} of every palettized layer of the model built from the file, as a load builds
    it (ComponentSpec.build: the strict loader, the palettized layers, the value checks), every parameter evaluated."""
    model = ComponentSpec("text_encoder", clip, config, [Path(path)]).build()
    mx.eval(model.parameters())
    return {p: np.array(m.dense_weight().astype(mx.float32)) for p, m in model.named_modules()
            if isinstance(m, PalettizedLinear)}


class Refuse(Exception):
    pass


def _unpack(packed: np.ndarray, nbits, cols):
    """[rows, bytes] -> [rows, cols] indices: each row one little-endian bit string, index i at bits n*i..n*i+n-1."""
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :nbits * cols].reshape(packed.shape[0], cols, nbits)
    return (bits.astype(np.int64) << np.arange(nbits)).sum(axis=2)


def reference(tensors, config, ctx) -> dict:
    """{layer: float32 dense weight}, by the form's rules and a numpy decode; Refuse(why) where a rule fails."""
    q = config.get("quantization")
    if not isinstance(q, dict) or q.get("mode") != "palettize":
        raise Refuse("the config is not a palettized checkpoint's")
    extra = {n for n in tensors if n not in ctx["names"]}
    scales = {n for n in extra if n.endswith(".scale") and n[:-len(".scale")] in ctx["dims"]}
    if extra - scales or ctx["names"] - set(tensors):
        raise Refuse("tensors added, dropped or renamed")
    for name in ctx["names"]:           # everything else as the base has it
        if not any(name == f"{layer}.{part}" for layer in ctx["dims"] for part in ("lut", "weight")) and \
                tensors[name] != ctx["tensors"][name]:
            raise Refuse(f"{name} changed")
    out = {}
    for layer, (rows, cols) in ctx["dims"].items():
        dtype, shape, raw = tensors[f"{layer}.lut"]
        k = shape[1] if len(shape) == 2 else 0
        nbits = k.bit_length() - 1
        if dtype not in TABLE_FLOATS or len(shape) != 2 or k != 1 << nbits or nbits not in NBITS:
            raise Refuse(f"{layer}.lut: {dtype} {shape}")
        lut = values(dtype, shape, raw)
        if not np.isfinite(lut).all():
            raise Refuse(f"{layer}.lut: not finite")
        groups = shape[0]
        if groups < 1 or rows % groups:
            raise Refuse(f"{layer}.lut: {groups} tables for {rows} rows")
        wdtype, wshape, wraw = tensors[f"{layer}.weight"]
        if wdtype != "U8" or wshape != [rows, row_bytes(cols, nbits)]:
            raise Refuse(f"{layer}.weight: {wdtype} {wshape}")
        idx = _unpack(np.frombuffer(wraw, np.uint8).reshape(wshape), nbits, cols)
        w = lut[np.arange(rows)[:, None] // (rows // groups), idx]
        if f"{layer}.scale" in tensors:
            sdtype, sshape, sraw = tensors[f"{layer}.scale"]
            if sdtype not in TABLE_FLOATS or sshape != [rows]:
                raise Refuse(f"{layer}.scale: {sdtype} {sshape}")
            scale = values(sdtype, sshape, sraw)
            if not np.isfinite(scale).all():
                raise Refuse(f"{layer}.scale: not finite")
            w = _in_dtype(_in_dtype(scale, dtype)[:, None] * w, dtype)   # the product in the table's dtype
        out[layer] = w.astype(np.float32)
    return out


def _in_dtype(v, dtype):
    """float32 values rounded to the table's dtype (the multiply's result there)."""
    v = np.asarray(v, np.float32)
    if dtype == "BF16":
        return _bf16_to_f32(_f32_to_bf16_bits(v))
    if dtype == "F16":
        with np.errstate(all="ignore"):
            return v.astype(np.float16).astype(np.float32)
    return v


def classify(path, ctx, report):
    tensors, metadata = parse(Path(path).read_bytes())
    config = json.loads(metadata["mlxdiff_fuzz_config"])
    try:
        got = ours(path, config)
    except MlxdiffError as e:
        message = str(e)
        if "\n" in message or str(path) not in message:
            return "unclean error", message[:300]
        try:
            reference(tensors, config, ctx)
        except Refuse:
            return "refused (reference refuses too)", message[:600]
        return "refused (reference accepts)", message[:600]
    try:
        want = reference(tensors, config, ctx)
    except Refuse as e:
        return "WRONG: loaded, the reference refuses", str(e)[:300]
    if got.keys() != want.keys():
        return "WRONG: differs from the reference", f"layers {sorted(set(got) ^ set(want))[:3]}"
    for layer in want:
        a, b = got[layer], want[layer]
        if a.shape != b.shape or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            where = int(np.argmax(a != b)) if a.shape == b.shape else -1
            return "WRONG: differs from the reference", f"{layer} at {where}"
    return "loaded = reference", ""


def fuzz(n, seed, workdir, keep, only, run_one, run_mutants) -> dict:
    """`run_one(path, ctx)`: fuzz_readers' forked classification; `run_mutants`: its loop over the mutants."""
    workdir = Path(workdir)
    ctx = context(workdir)
    base = workdir / "base.safetensors"
    base.write_bytes(to_bytes(ctx["tensors"], {"format": "mlxdiff", "mlxdiff_fuzz_config": json.dumps(ctx["config"])}))
    check = run_one(base, ctx)
    if check["class"] != "loaded = reference":
        raise SystemExit(f"the base checkpoint does not read as the reference: {check}")

    def write_case(i):
        tensors, config, what = mutate(ctx, random.Random(f"palettized-{seed}-{i}"))
        path = workdir / f"mutant-{i}.safetensors"
        path.write_bytes(to_bytes(tensors, {"format": "mlxdiff", "mlxdiff_fuzz_config": json.dumps(config)}))
        return path, what

    return run_mutants("palettized", n, seed, only, keep, write_case, lambda path: run_one(path, ctx))


def run(n, seed, workdir) -> dict:
    """The suite's seeded share: `n` mutants classified in this process (no fork: a crash fails the test itself),
    counted as fuzz_readers counts them."""
    workdir = Path(workdir)
    ctx = context(workdir, here=True)
    counts, failures = Counter(), []
    for i in range(n):
        tensors, config, what = mutate(ctx, random.Random(f"palettized-{seed}-{i}"))
        path = workdir / f"mutant-{i}.safetensors"
        path.write_bytes(to_bytes(tensors, {"format": "mlxdiff", "mlxdiff_fuzz_config": json.dumps(config)}))
        try:
            cls, detail = classify(path, ctx, lambda provisional: None)
        except Exception as e:
            cls, detail = f"exception {type(e).__name__}", str(e)[:300]
        counts[cls] += 1
        if not cls.startswith(("refused", "loaded = reference")):
            failures.append({"i": i, "mutation": what, "class": cls, "detail": detail})
        path.unlink()
    return {"n": n, "counts": dict(counts), "unacceptable": len(failures), "failures": failures}


def summary(result) -> str:
    return json.dumps({k: result[k] for k in ("counts", "failures")}, indent=1)[:6000]
