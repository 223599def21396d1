"""Core ML package mutants for bench/fuzz_readers.py (`--format coreml`; issue 45).

    python bench/fuzz_readers.py --format coreml --n 1000 --seed 1

The base (make_base, in a subprocess: torch and coremltools' conversion): a tiny diffusers UNet (one level, its
resnets, attention and embeddings) traced inside a wrapper and converted by coremltools as tests/test_coreml.py does
(ct.convert, mlprogram, iOS 18), its larger weights palettized (4-bit uniform tables per group of 4 output channels)
and the rest kept float16: a package of some hundred KB, saved by tests/coreml_helpers.save_package (its bytes a
function of the model alone: mutant i of a seed is the same bytes in every run). A mutant is a copy of it with 1 to 3
edits of what a broken or forged package can carry: Manifest.json (gone, not JSON, its root missing or unknown, an
entry's path changed, pointing out of the package or at another file, an extra entry), model.mlmodel's bytes (cut,
bytes flipped or overwritten) and its protobuf fields (specification version; a weight's value type: dtype, dims; a
blob reference's offset and file name; constexpr_lut_to_dense's indices type and shape and its table's shape),
weights/weight.bin (its header's count and version, a blob's sentinel, dtype, size and data offset, its data bytes,
the file cut), and the folder (a file gone or empty, a symbolic link out of the package, a directory in a file's
place).

Ours: the package as `--transformer X.mlpackage` loads it (loading.sources.transformer_from_file over the base's
UNet config: the names mapped and checked, then ComponentSpec.weights and .build, every parameter evaluated), each
weight as float32 in PyTorch's layout. The reference: coremltools' own reading of the same package
(ct.models.MLModel(path, skip_model_load=True), its MIL loader and each constexpr op's own decompression: the steps
of decompress_weights, which tests/test_coreml.py uses; coremltools_weights),
its values taken by the base's const names (the map from diffusers names to the program's, made once from the base
and checked there against coremltools). Outcome classes, as fuzz_readers': `refused (reference refuses too)`,
`refused (reference accepts)`, `loaded = reference` (every weight equal to coremltools' decoded value, bit for bit),
`loaded = reference (coremltools refuses another op)` (coremltools refuses the whole program for an op that holds
no weight, a misspelt op type or input name, and reads every weight equal to ours from the program cut down to its
weights' ops);
not acceptable: `WRONG: loaded, the reference refuses`, `WRONG: differs from the reference`, `exception`, `unclean
error` (several lines, or a line that names no path of the package), `hang`, `crash`.
"""

import hashlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
from collections import Counter
from pathlib import Path

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import numpy as np

from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import coreml
from mlxdiff.formats.quantized import PalettizedWeight
from mlxdiff.loading.sources import transformer_from_file
from mlxdiff.models import unet as unet_module

import coremltools as ct   # the reference, imported once in the forking parent (its children inherit it)
from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig, palettize_weights
from coremltools.proto import Model_pb2

warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # coreml_helpers: the tiny models and the conversion tests/test_coreml.py uses
from coreml_helpers import UNET, convert_small, palettized_unet, save_package, small_model, tiny_unet  # noqa: E402

MAKE_BASE = ("import sys, json; sys.path.insert(0, sys.argv[2]); import fuzz_coreml as F; "
             "F.make_base(sys.argv[1], json.loads(sys.argv[3]))")
# the suite's share (tests/test_coreml_fuzz.py): its one level without attention (the mid block's kept), half the ops
# to convert and read
SMALL_UNET = dict(UNET, down_block_types=("DownBlock2D",), up_block_types=("UpBlock2D",))
MODEL = Path("Data/com.apple.CoreML/model.mlmodel")
WEIGHTS = Path("Data/com.apple.CoreML/weights/weight.bin")
KINDS = ("manifest", "model bytes", "model fields", "weight.bin", "folder")


def make_base(dest, config=None) -> Path:
    """dest/base.mlpackage and dest/config.json (the UNet's diffusers config; `config`: another than UNET's)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model = tiny_unet(config)
    save_package(palettized_unet(model, nbits=4, weight_threshold=1024), dest / "base.mlpackage")
    (dest / "config.json").write_text(json.dumps(dict(model.config)))
    return dest


def context(workdir: Path, config=None) -> dict:
    """The base package (made in a subprocess: torch's tracing), its UNet config and the map of its weights' names
    (diffusers -> the program's const)."""
    dest = Path(workdir) / "base"
    subprocess.run([sys.executable, "-c", MAKE_BASE, str(dest), str(Path(__file__).parent), json.dumps(config or UNET)],
                   check=True, capture_output=True, timeout=900)
    config = json.loads((dest / "config.json").read_text())
    package = dest / "base.mlpackage"
    spec = transformer_from_file(package, unet_module, config)
    found = coreml._mapped(coreml.program(package), spec.diffusers_targets()["targets"], None)
    return {"package": package, "config": config, "consts": {name: const for name, (_, const) in found.items()},
            "targets": spec.diffusers_targets()["targets"], "mode": "unet"}


def small_base(workdir: Path) -> Path:
    """The suite's seeded share's base package, workdir/small.mlpackage: tests/coreml_helpers' Small (two Linears,
    one without bias, and a conv: 2-D and 4-D weights) converted (iOS 18), its weights palettized at 4 bits in
    tables per 4 output channels, the biases float16: a few KB, in a second where the UNet takes a minute."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    mlmodel = palettize_weights(convert_small(small_model(), "iOS18"), OptimizationConfig(
        global_config=OpPalettizerConfig(mode="uniform", nbits=4, granularity="per_grouped_channel", group_size=4,
                                         weight_threshold=64)))
    return save_package(mlmodel, Path(workdir) / "small.mlpackage")


def small_context(workdir: Path) -> dict:
    """small_base made in this process, read through formats/coreml.read (ours) and coremltools_weights (the
    reference), names kept."""
    package = small_base(workdir)
    weights = {k: np.asarray(v) for k, v in coreml.decode_all(coreml.read(package)).items()}
    return {"package": package, "consts": {k: k for k in weights}, "targets": {k: v.shape for k, v in weights.items()},
            "mode": "weights"}


# -- mutations ------------------------------------------------------------------------------------------------------

def _blob_values(spec):
    """Every Value of the main function's ops that refers to weight.bin: [(op, its Value message)], in the program's
    order (the maps' entries by key: protobuf iterates a map in its hash table's order, another in every process)."""
    f = spec.mlProgram.functions["main"]
    out = []
    for op in f.block_specializations[f.opset].operations:
        values = [a.value for k in sorted(op.inputs) for a in op.inputs[k].arguments if a.HasField("value")]
        values += [op.attributes[k] for k in sorted(op.attributes)]
        out += [(op, v) for v in values if v.HasField("blobFileValue")]
    return out


def _ops(spec, kind):
    f = spec.mlProgram.functions["main"]
    return [op for op in f.block_specializations[f.opset].operations if op.type == kind]


def _tensor_type(value):
    return value.type.tensorType


def _edit_fields(pkg: Path, rng) -> str:
    spec = Model_pb2.Model()
    spec.ParseFromString((pkg / MODEL).read_bytes())
    blobs = _blob_values(spec)
    op, value = rng.choice(blobs)
    name = op.outputs[0].name if op.outputs else op.type
    how = rng.choice(["version", "offset", "offset", "file", "dtype", "dims", "dims", "lut indices", "lut table",
                      "vector axis"])
    if how == "version":
        spec.specificationVersion = rng.choice([0, 1, 7, 8, 9, 10, 99, 2 ** 31 - 1])
        what = f"specificationVersion {spec.specificationVersion}"
    elif how == "offset":
        old = value.blobFileValue.offset
        value.blobFileValue.offset = rng.choice([0, 64, old + 64, old - 64, old + 1, old + 128, 2 ** 40, 2 ** 63,
                                                 rng.choice([b.blobFileValue.offset for _, b in blobs])])
        what = f"{name}: blob offset {old} -> {value.blobFileValue.offset}"
    elif how == "file":
        value.blobFileValue.fileName = rng.choice(["@model_path/weights/other.bin", "@model_path/../weight.bin",
                                                   "/etc/passwd", "", "@model_path/weights/weight.bin\x00x",
                                                   "@model_path/weights/../weights/weight.bin"])
        what = f"{name}: blob file {value.blobFileValue.fileName!r}"
    elif how == "dtype":
        t = _tensor_type(value)
        old = t.dataType
        t.dataType = rng.choice([10, 11, 12, 13, 21, 23, 25, 31, 32, 33, 35, 36, 37, 38, 39, 0, 999])
        what = f"{name}: dtype {old} -> {t.dataType}"
    elif how == "dims":
        t = _tensor_type(value)
        dims = [d.constant.size for d in t.dimensions]
        i = rng.randrange(len(dims)) if dims else 0
        change = rng.choice(["double", "halve", "zero", "one", "huge", "add", "drop"])
        if change == "add" or not dims:
            t.dimensions.add().constant.size = rng.choice([1, 2])
            t.rank = len(t.dimensions)
        elif change == "drop":
            del t.dimensions[i]
            t.rank = len(t.dimensions)
        else:
            t.dimensions[i].constant.size = {"double": dims[i] * 2, "halve": dims[i] // 2, "zero": 0, "one": 1,
                                             "huge": 2 ** 40}[change]
        what = f"{name}: dims {dims} ({change} at {i})"
    else:
        luts = _ops(spec, "constexpr_lut_to_dense")
        op = rng.choice(luts)
        name = op.outputs[0].name
        key = {"lut indices": "indices", "lut table": "lut", "vector axis": "vector_axis"}[how]
        if key not in op.inputs:
            return _edit_fields(pkg, rng)
        binding = op.inputs[key].arguments[0]
        if binding.HasField("value"):
            t = _tensor_type(binding.value)
        else:   # a const op's output: its value
            t = None
            for o in _ops(spec, "const"):
                if o.outputs and o.outputs[0].name == binding.name:
                    t = _tensor_type(o.attributes["val"])
            if t is None:
                return _edit_fields(pkg, rng)
        if key == "indices" and rng.random() < 0.5:
            old = t.dataType
            t.dataType = rng.choice([35, 36, 37, 38, 39, 31, 21, 25])
            what = f"{name}: indices dtype {old} -> {t.dataType}"
        else:
            dims = [d.constant.size for d in t.dimensions]
            if not dims:
                t.dimensions.add().constant.size = 2
                t.rank = 1
                what = f"{name}: {key} given a dimension"
            else:
                i = rng.randrange(len(dims))
                t.dimensions[i].constant.size = rng.choice([1, 2, 3, 8, 16, 32, dims[i] * 2, max(1, dims[i] // 2)])
                what = f"{name}: {key} dims {dims} -> dim {i} = {t.dimensions[i].constant.size}"
    (pkg / MODEL).write_bytes(spec.SerializeToString(deterministic=True))   # (save_package's map order)
    return what


def _manifest(pkg: Path, rng) -> str:
    path = pkg / "Manifest.json"
    info = json.loads(path.read_text())
    root = info["rootModelIdentifier"]
    entries = info["itemInfoEntries"]
    how = rng.choice(["gone", "not json", "root missing", "root unknown", "root path", "root path", "entry path",
                      "extra entry", "entries type"])
    if how == "gone":
        path.unlink()
        return "Manifest.json removed"
    if how == "not json":
        path.write_bytes(rng.choice([b"", b"{", b"\xff\xfe", b"[]", b"null", path.read_bytes()[:40]]))
        return "Manifest.json not JSON"
    if how == "root missing":
        del info["rootModelIdentifier"]
    elif how == "root unknown":
        info["rootModelIdentifier"] = rng.choice(["nope", "", 1, None])
    elif how == "root path":
        entries[root]["path"] = rng.choice(["com.apple.CoreML/weights/weight.bin", "com.apple.CoreML/nope.mlmodel",
                                            "../../../etc/passwd", "/etc/passwd", "com.apple.CoreML", "",
                                            "com.apple.CoreML/../com.apple.CoreML/model.mlmodel", 7, None])
    elif how == "entry path":
        other = [k for k in entries if k != root]
        key = rng.choice(other) if other else root
        entries[key]["path"] = rng.choice(["../outside", "/tmp", "com.apple.CoreML/x", None])
    elif how == "extra entry":
        entries["extra"] = rng.choice([{"path": "com.apple.CoreML/extra.bin", "author": "x", "description": "d"},
                                       {"path": "../../etc/passwd"}, "text", {"path": 3}])
    else:
        info["itemInfoEntries"] = rng.choice([[], "x", None, {}])
    path.write_text(json.dumps(info))
    return f"Manifest.json: {how}"


def _model_bytes(pkg: Path, rng) -> str:
    path = pkg / MODEL
    data = bytearray(path.read_bytes())
    how = rng.choice(["cut", "flip", "overwrite"])
    if how == "cut":
        n = rng.choice([0, 1, 2, 10, rng.randrange(len(data)), len(data) - 1])
        path.write_bytes(bytes(data[:n]))
        return f"model.mlmodel cut to {n} bytes"
    for _ in range(rng.choice([1, 1, 2, 8])):
        i = rng.randrange(len(data))
        data[i] = data[i] ^ (1 << rng.randrange(8)) if how == "flip" else rng.randrange(256)
    path.write_bytes(bytes(data))
    return f"model.mlmodel bytes {how}"


def _blob_offsets(data: bytes) -> list:
    """The offsets of the blob metadata records in weight.bin (the fuzzer's own walk: sentinel-marked, 64-aligned)."""
    return [i for i in range(64, len(data) - 63, 64) if data[i:i + 4] == (0xDEADBEEF).to_bytes(4, "little")]


def _weight_bin(pkg: Path, rng) -> str:
    path = pkg / WEIGHTS
    data = bytearray(path.read_bytes())
    blobs = _blob_offsets(bytes(data))
    at = rng.choice(blobs)
    how = rng.choice(["count", "version", "sentinel", "dtype", "size", "data offset", "data offset", "data bytes",
                      "data bytes", "cut"])
    if how == "count":
        data[0:4] = rng.choice([0, 1, 2 ** 32 - 1]).to_bytes(4, "little")
    elif how == "version":
        data[4:8] = rng.choice([0, 1, 3, 2 ** 32 - 1]).to_bytes(4, "little")
    elif how == "sentinel":
        data[at:at + 4] = rng.choice([0, 0xDEADBEEE, 0xEFBEADDE]).to_bytes(4, "little")
    elif how == "dtype":
        data[at + 4:at + 8] = rng.choice([0, 1, 2, 3, 8, 11, 12, 14, 99]).to_bytes(4, "little")
    elif how == "size":
        size = int.from_bytes(data[at + 8:at + 16], "little")
        data[at + 8:at + 16] = rng.choice([0, size - 1, size + 1, size * 2, 2 ** 63, 2 ** 64 - 1]).to_bytes(8, "little")
    elif how == "data offset":
        off = int.from_bytes(data[at + 16:at + 24], "little")
        data[at + 16:at + 24] = rng.choice([0, at, off - 64, off + 1, off + 64, len(data), 2 ** 63, 2 ** 64 - 1,
                                            rng.choice(blobs) + 64]).to_bytes(8, "little")
    elif how == "data bytes":   # values change; both readers must read the same new ones
        off = int.from_bytes(data[at + 16:at + 24], "little")
        size = int.from_bytes(data[at + 8:at + 16], "little")
        for _ in range(rng.choice([1, 4, 32])):
            i = off + rng.randrange(max(1, size))
            data[i] = rng.randrange(256)
    else:
        n = rng.choice([0, 10, 63, 64, 100, at + 30, rng.randrange(len(data)), len(data) - 1])
        del data[n:]
    path.write_bytes(bytes(data))
    return f"weight.bin: {how}" + (f" of the blob at {at}" if how in ("sentinel", "dtype", "size", "data offset",
                                                                       "data bytes") else "")


def _folder(pkg: Path, rng, outside: Path) -> str:
    target = rng.choice([MODEL, WEIGHTS, Path("Manifest.json"), Path("Data/com.apple.CoreML/weights"),
                         Path("Data/com.apple.CoreML")])
    path = pkg / target
    how = rng.choice(["gone", "empty", "link out", "link out", "directory", "link loop"])
    if how == "empty" and path.is_dir():
        how = "gone"
    copy = Path("/etc/hostname")    # where a file's link out points when the file was gone already
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        if how == "link out":   # the same bytes, outside the package (a dangling link: not applicable)
            kept = path.read_bytes()
            copy = outside / f"outside-{rng.randrange(10 ** 9)}-{target.name}"
            copy.write_bytes(kept)
        path.unlink()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "link out":
        os.symlink(copy if target.suffix else outside, path)
    elif how == "directory":
        path.mkdir(parents=True, exist_ok=True)
    elif how == "link loop":
        os.symlink(path, path)
    return f"{target}: {how}"


def mutate(ctx, pkg: Path, rng, outside: Path) -> str:
    """1 to 3 edits of the package at `pkg` (a copy of the base): what was done, and the kinds of edit in order."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.choice(KINDS)
        try:
            what = {"manifest": lambda: _manifest(pkg, rng), "model bytes": lambda: _model_bytes(pkg, rng),
                    "model fields": lambda: _edit_fields(pkg, rng), "weight.bin": lambda: _weight_bin(pkg, rng),
                    "folder": lambda: _folder(pkg, rng, outside)}[kind]()
        except Exception as e:   # an edit that does not apply to what an earlier one left (a file gone, not JSON)
            what = f"not applicable ({type(e).__name__})"
        done.append(f"[{kind}] {what}")
    return "; ".join(done)


# -- ours and the reference ---------------------------------------------------------------------------------------

def _numpy(value, shape):
    """A loaded weight as float32 numpy in PyTorch's layout (a palettized conv's indices are [out, kh, kw, in])."""
    if isinstance(value, PalettizedWeight):
        dense = np.array(value.dequantize().astype(mx.float32))
        if len(shape) == 4:
            return dense.reshape(shape[0], shape[2], shape[3], shape[1]).transpose(0, 3, 1, 2)
        return dense.reshape(shape)
    return np.array(value.astype(mx.float32))


def ours(path, ctx) -> dict:
    """{diffusers name: float32 numpy} as `--transformer X.mlpackage` loads the package, after the model is built;
    for the suite's small base (ctx["mode"] "weights"), {const name: float32 numpy} as the format's reader gives them
    (formats/coreml.read, every weight decoded: what open_diffusers maps)."""
    if ctx["mode"] == "weights":
        return {k: np.asarray(v).astype(np.float32) for k, v in coreml.decode_all(coreml.read(Path(path))).items()}
    spec = transformer_from_file(Path(path), unet_module, ctx["config"])
    weights = spec.weights()
    out = {name: _numpy(v, ctx["targets"][name]) for name, v in weights.items()}
    model = spec.build()
    mx.eval(model.parameters())
    return out


class Refuse(Exception):
    pass


def coremltools_weights(path, weights_only=None) -> dict:
    """{const name: value} of every const and constexpr op of the package's main function, by coremltools: the
    package opened as ct.models.MLModel opens it (its manifest, the spec), the program loaded by its MIL loader
    (milproto.load, what decompress_weights starts from) and each constexpr op decompressed by its own
    materialized_val_inference (what decompress_weights' pass calls), without the passes that follow: decompress_weights
    then get_weights_metadata give the same values in 3 s a package, this in 0.4 s. `weights_only` (const names):
    the program cut down to its const and constexpr ops, those names its outputs: whether coremltools reads the
    weights where it refuses the whole program for an op that holds none (a misspelt op type or input elsewhere)."""
    mlmodel = ct.models.MLModel(str(path), skip_model_load=True)
    spec = mlmodel.get_spec()
    if weights_only is not None:   # the program's weights alone: its other ops left out, the weights its outputs
        f = spec.mlProgram.functions["main"]
        block = f.block_specializations[f.opset]
        kept = [op for op in block.operations if op.type == "const" or op.type.startswith("constexpr_")]
        del block.operations[:]
        block.operations.extend(kept)
        del block.outputs[:]
        block.outputs.extend(sorted(weights_only))
    program = milproto_load(spec, spec.specificationVersion, mlmodel.weights_dir)
    values = {}
    for op in program.functions["main"].operations:
        if op.op_type == "const":
            values[op.outputs[0].name] = op.outputs[0].val
        elif op.op_type.startswith("constexpr_"):
            values[op.outputs[0].name] = op.materialized_val_inference()
    return values


def reference(path, ctx, got=None) -> dict:
    """{diffusers name: float32 numpy} by coremltools' reading, the base's const names; Refuse(why) where it refuses.
    The small base's (`got`: what ours read): the base's weights and those ours read under new names, by name, each
    in coremltools' shape (a mutant's type may give a weight another shape: both readers must read the same)."""
    try:
        values = coremltools_weights(path)
    except Exception as e:
        if got is None:
            raise Refuse(f"coremltools: {type(e).__name__}: {str(e)[:200]}") from None
        try:   # ours loaded: are the weights coremltools' all the same, the refusal about an op that holds none?
            values = coremltools_weights(path, set(ctx["consts"].values()) if ctx["mode"] == "unet" else set(got))
        except Exception:
            raise Refuse(f"coremltools: {type(e).__name__}: {str(e)[:200]}") from None
        ctx = {**ctx, "refused_elsewhere": f"{type(e).__name__}: {str(e)[:120]}"}
    consts, targets = ctx["consts"], ctx["targets"]
    if ctx["mode"] == "weights" and got is not None:   # as the format's reader: each in the shape its type gives
        consts = {**{k: k for k in got}, **{k: k for k in consts if k in values}}
        targets = {k: np.shape(values[k]) for k in consts.values() if k in values}
    out = {}
    for name, const in consts.items():
        if const not in values:
            raise Refuse(f"{const} ({name}) is not a weight of the program")
        v = np.asarray(values[const])
        if v.dtype not in (np.float16, np.float32):
            raise Refuse(f"{const} is {v.dtype}")
        if v.size != int(np.prod(targets[name])):
            raise Refuse(f"{const} has shape {v.shape}, {name} is {targets[name]}")
        out[name] = v.astype(np.float32).reshape(targets[name])
    if "refused_elsewhere" in ctx:
        out[REFUSED_ELSEWHERE] = ctx["refused_elsewhere"]
    return out


REFUSED_ELSEWHERE = "<coremltools refuses an op that holds no weight>"


def _same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def classify(path, ctx, report):
    path = Path(path)
    try:
        got = ours(path, ctx)
    except MlxdiffError as e:
        message = str(e)
        if "\n" in message or str(path) not in message:
            return "unclean error", message[:300]
        report({"class": "refused", "detail": message[:600]})
        try:
            reference(path, ctx)
        except Refuse:
            return "refused (reference refuses too)", message[:600]
        return "refused (reference accepts)", message[:600]
    report({"class": "loaded (the reference unfinished)", "detail": ""})
    try:
        want = reference(path, ctx, got)
    except Refuse as e:
        return "WRONG: loaded, the reference refuses", str(e)[:300]
    elsewhere = want.pop(REFUSED_ELSEWHERE, None)
    if got.keys() != want.keys():
        return "WRONG: differs from the reference", f"names {sorted(set(got) ^ set(want))[:3]}"
    for name in want:
        if not _same(got[name], want[name]):
            return "WRONG: differs from the reference", name
    if elsewhere:   # acceptable: the weights are defined, and equal (coremltools' program check is not a weight's)
        return "loaded = reference (coremltools refuses another op)", elsewhere
    return "loaded = reference", ""


def fuzz(n, seed, workdir, keep, only, run_one, run_mutants) -> dict:
    """`run_one(path, ctx)`: fuzz_readers' forked classification; `run_mutants`: its loop over the mutants."""
    workdir = Path(workdir)
    ctx = context(workdir)
    outside = workdir / "outside"
    outside.mkdir()
    check = run_one(ctx["package"], ctx)
    if check["class"] != "loaded = reference":
        raise SystemExit(f"the base package does not read as the reference: {check}")
    kinds = Counter()

    def write_case(i):
        pkg = workdir / f"mutant-{i}.mlpackage"
        shutil.copytree(ctx["package"], pkg, symlinks=True)
        what = mutate(ctx, pkg, random.Random(f"coreml-{seed}-{i}"), outside)
        kinds.update(k for k in KINDS if f"[{k}]" in what)
        return _Package(pkg), what

    reasons = Counter()

    def classified(path):
        result = run_one(path, ctx)
        if result["class"].startswith("refused"):
            reasons[reason(result["detail"], path)] += 1
        return result

    result = run_mutants("coreml", n, seed, only, keep, write_case, classified)
    result["kinds"] = dict(kinds)
    result["refusals"] = dict(reasons.most_common())
    return result


def reason(message, path) -> str:
    """A refusal without its particulars (the mutant's paths, names, numbers), to count refusals by reason."""
    text = message.replace(str(path), "<package>")
    for pattern, repl in ((r"/tmp/\S*", "<outside>"), (r"'[^']*'", "'.'"), (r"\[[^\]]*\]", "[..]"), (r"\d+", "N")):
        text = re.sub(pattern, repl, text)
    return text.split("; the ")[0].split("; re-")[0][:140]


class _Package(type(Path())):
    """A mutant package folder as run_mutants handles a file: `unlink` removes it, `read_bytes` (kept mutants: its
    copy) is a tar of it."""

    def unlink(self, missing_ok=False):
        shutil.rmtree(self, ignore_errors=True)

    def read_bytes(self):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(self, arcname=self.name, recursive=True)
        return buf.getvalue()


def digest(pkg: Path, workdir: Path) -> str:
    """A package folder's bytes as one hash: its paths, its files' bytes, its links' targets (`workdir` in them
    written as <workdir>: a link out points into this run's own folder)."""
    h = hashlib.sha256()
    for f in sorted(Path(pkg).rglob("*")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0")
        if f.is_symlink():
            h.update(os.readlink(f).replace(str(workdir), "<workdir>").encode() + b"\0")
        elif f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def digests(n, seed, workdir) -> list:
    """The digests of the small base (small_base, made in this process) and its `n` mutants of `seed`, unclassified:
    what run() makes, to compare across processes."""
    workdir = Path(workdir)
    base = small_base(workdir)
    (workdir / "outside").mkdir()
    out = [digest(base, workdir)]
    for i in range(n):
        pkg = workdir / f"mutant-{i}.mlpackage"
        shutil.copytree(base, pkg, symlinks=True)
        mutate({}, pkg, random.Random(f"coreml-{seed}-{i}"), workdir / "outside")
        out.append(digest(pkg, workdir))
        shutil.rmtree(pkg, ignore_errors=True)
    return out


def run(n, seed, workdir) -> dict:
    """The suite's seeded share: `n` mutants of the small base classified in this process (no fork: a crash fails
    the test itself), counted as fuzz_readers counts them, with the kinds of edit made and the digests of the base
    and of each mutant (as digests() makes them)."""
    workdir = Path(workdir)
    ctx = small_context(workdir)
    outside = workdir / "outside"
    outside.mkdir()
    counts, failures, kinds = Counter(), [], Counter()
    base = classify(ctx["package"], ctx, lambda provisional: None)
    made = [digest(ctx["package"], workdir)]
    for i in range(n):
        pkg = workdir / f"mutant-{i}.mlpackage"
        shutil.copytree(ctx["package"], pkg, symlinks=True)
        what = mutate(ctx, pkg, random.Random(f"coreml-{seed}-{i}"), outside)
        made.append(digest(pkg, workdir))
        kinds.update(k for k in KINDS if f"[{k}]" in what)
        try:
            cls, detail = classify(pkg, ctx, lambda provisional: None)
        except Exception as e:
            cls, detail = f"exception {type(e).__name__}", str(e)[:300]
        counts[cls] += 1
        if not cls.startswith(("refused", "loaded = reference")):
            failures.append({"i": i, "mutation": what, "class": cls, "detail": detail})
        shutil.rmtree(pkg, ignore_errors=True)
    return {"n": n, "base": base, "counts": dict(counts), "kinds": dict(kinds), "unacceptable": len(failures),
            "failures": failures, "digests": made}
