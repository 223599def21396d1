"""Core ML packages (.mlpackage, made by coremltools) read without coremltools, as a diffusers model's weights:
palettized ones kept as indices and tables, decoded exactly as coremltools.optimize.coreml.decompress_weights does.

The reader in pieces: coreml_mil.py (the package's protobuf, MIL data types and weight blobs), coreml_weights.py
(the program's weights: `read`, LutWeight and its exact decode), and here the names. Every public name of those
pieces is importable from here too.

`read_diffusers(...)` maps the names of a model traced from diffusers' modules (torch.jit.trace + ct.convert) back
onto the state dict's, and those of Apple's ml-stable-diffusion conversion (apple/ml-stable-diffusion,
torch2coreml.py): the same module paths, traced without a wrapper, every Linear a 1x1 convolution ([out, in, 1, 1],
read as [out, in]), its LayerNorms fused by the converter into layer_norm ops (found by dataflow, LAYER_NORM_BEFORE).
How far that goes: one .mlpackage UNet (the form `--chunk-unet` splits in two is not joined; compiled .mlmodelc
folders, whose program is MIL text, are not read).
"""

import math
import re
from pathlib import Path

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError
from .coreml_mil import _guard, unpack_bits  # noqa: F401
from .coreml_weights import LutWeight, _Program, decode_all, read  # noqa: F401
from .palettized import row_bytes

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
    total = 0
    for name, v in read_diffusers(path, targets, prefix).items():
        if not isinstance(v, LutWeight):
            total += int(v.nbytes)
        elif ((name in linear and len(v.shape) == 2) or (name in convs and len(v.shape) == 4)) and v.has_row_tables:
            total += v.shape[0] * row_bytes(math.prod(v.shape[1:]), v.nbits) + int(v.lut.nbytes)
        else:
            total += math.prod(v.shape) * v.lut.dtype.itemsize
    return total
