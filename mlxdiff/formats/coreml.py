"""Core ML packages (.mlpackage, made by coremltools) read without coremltools, as a diffusers model's weights:
palettized ones kept as indices and tables, decoded exactly as coremltools.optimize.coreml.decompress_weights does.

The reader in pieces: coreml_mil.py (the package's protobuf, MIL data types and weight blobs), coreml_weights.py
(the program's weights: `read`, LutWeight and its exact decode), and here the names. Every public name of those
pieces is importable from here too.

`read_diffusers(...)` maps the names of a model traced from diffusers' modules (torch.jit.trace + ct.convert) back
onto the state dict's, and those of Apple's ml-stable-diffusion conversion (apple/ml-stable-diffusion,
torch2coreml.py): the same module paths, traced without a wrapper, every Linear a 1x1 convolution ([out, in, 1, 1],
read as [out, in]), its LayerNorms fused by the converter into layer_norm ops (found by dataflow, LAYER_NORM_BEFORE).
A package of Apple's chunked UNet (`--chunk-unet`: UnetChunk1 + UnetChunk2, coremltools' bisect_model) stands
for the whole UNet: the two programs are joined by the names of the tensors the first passes to the second
(_Joined; the join checked by name and shape), and read as one. Compiled .mlmodelc bundles are refused in one line
(coreml_mil._model_file): their program is MIL text in a layout coremltools cannot write on Linux, so no test
could check a reader of it against the compiler's output.
"""

import math
import re
from pathlib import Path

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError
from .coreml_mil import CHUNK, _guard, chunk_partner, chunked_unet, unpack_bits  # noqa: F401
from .coreml_weights import LutWeight, _Program, decode_all  # noqa: F401
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


# What a traced model lacks beside the names a target carries: transformers 5's CLIPTextModel has no `text_model`
# level (its state dict does: {target prefix: the traced names' form})
ALIASES = {"text_model.": ""}
# Targets the converter folds into another constant: CLIP's position embedding looked up at every position is the
# constant `position_embeddings` [1, positions, width] (Apple traces the encoder at all 77 positions)
FOLDED = {"embeddings.position_embedding.weight": "position_embeddings"}


def _aliases(name: str) -> list:
    return [name] + [to + name[len(start):] for start, to in ALIASES.items() if name.startswith(start)]


class _Joined:
    """Apple's two UNet chunks as one program: their ops in order and their weights together; the tensors the
    first passes to the second keep their names, so the dataflow (the norms' search) runs through the join."""

    def __init__(self, first, second):
        self.parts = (first, second)
        self.path, self.model_file = first.path, first.model_file
        self.ops = first.ops + second.ops
        self.inputs, self.outputs = first.inputs, second.outputs
        self.consumers = {}
        for part in self.parts:
            for var, users in part.consumers.items():
                self.consumers.setdefault(var, []).extend(users)

    def weights(self) -> dict:
        out = {}
        for part in self.parts:
            for name, value in _guard(part.model_file, part.weights).items():
                out.setdefault(name, value)                # a constant both halves kept: the first's
        return out


def _shown(kind) -> str:
    dtype, shape = kind
    return "?" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def check_join(first, second) -> None:
    """The two chunks are halves of one model: every input of the second is an output of the first of the same
    shape (the tensors passed between them) or an input of the first (the UNet's own inputs), and every output of
    the first is an input of the second. One line otherwise."""
    a, b = first.path.name, second.path.name
    passed = [n for n in first.outputs if n in second.inputs]
    why = ("chunks of two models; give the two packages ml-stable-diffusion's --chunk-unet wrote for one UNet "
           "(or its Unet.mlpackage)")
    if not passed:
        raise MlxdiffError(f"{second.path}: none of its inputs ({', '.join(list(second.inputs)[:4])}) is an output "
                           f"of {a} ({', '.join(list(first.outputs)[:4])}); {why}")
    for name in passed:
        if first.outputs[name][1] != second.inputs[name][1]:
            raise MlxdiffError(f"{second.path}: {a} gives {name!r} as {_shown(first.outputs[name])} but {b} takes "
                               f"{_shown(second.inputs[name])}; {why}")
    strange = [n for n in second.inputs if n not in first.outputs and n not in first.inputs]
    if strange:
        raise MlxdiffError(f"{second.path}: takes {strange[0]!r}, which {a} neither takes nor gives; {why}")
    unused = [n for n in first.outputs if n not in second.inputs]
    if unused:
        raise MlxdiffError(f"{first.path}: gives {unused[0]!r}, which {b} does not take; {why}")


def program(path):
    """A package's program, or, for a package of Apple's chunked UNet, its two halves joined (_Joined)."""
    path = Path(path)
    first = chunked_unet(path) if CHUNK.fullmatch(path.name) else None
    if first is None:
        return _guard(path, lambda: _Program(path))
    halves = [_guard(p, lambda p=p: _Program(p)) for p in (first, chunk_partner(first))]
    check_join(*halves)
    return _Joined(*halves)


# Apple's packages of one model's parts, beside each other: {(its Resources name, the converter's): the partners'
# names alike} (torch2coreml.py's VAEDecoder wraps post_quant_conv + decoder, VAEEncoder encoder + quant_conv: one
# AutoencoderKL together)
PARTNERS = {("VAEDecoder", "vae_decoder"): (("VAEEncoder", "vae_encoder"),)}


def partners(path: Path) -> list:
    """The packages beside `path` that hold the rest of its model (PARTNERS: `VAEDecoder.mlpackage` and
    `VAEEncoder.mlpackage`, or the converter's `<model>_vae_decoder` / `<model>_vae_encoder`), those that exist."""
    stem = path.name[:-len(path.suffix)]
    out = []
    for names, others in PARTNERS.items():
        for form, name in enumerate(names):
            if stem == name or (form == 1 and stem.endswith("_" + name)):
                for other in others:
                    partner = path.parent / (stem[:-len(name)] + other[form] + path.suffix)
                    if partner.exists():
                        out.append(partner)
    return out


def parts(path) -> list:
    """The programs a package stands for: its own (a chunked UNet's two halves joined: program), then its
    partners' (PARTNERS)."""
    path = Path(path)
    return [program(path)] + [program(p) for p in partners(path)]


def read(path) -> dict:
    """{weight name: np.ndarray | LutWeight} of an .mlpackage (coreml_weights.read): of both halves of a chunked
    UNet (a package of it named), and its partners' (parts; their names after `<package>:`). Bad input: one
    MlxdiffError line."""
    path = Path(path)
    if not path.exists():
        raise MlxdiffError(f"{path}: no such Core ML package")
    out = {}
    for i, found in enumerate(parts(path)):
        for name, value in _guard(found.model_file, found.weights).items():
            out[name if i == 0 else f"{found.path.name}:{name}"] = value   # another program's own names
    return out


def read_diffusers(path, targets: dict, prefix: str = "") -> dict:
    """{state-dict name: np.ndarray | LutWeight} for `targets` ({name: torch shape}) from an .mlpackage converted
    from those modules by torch.jit.trace + ct.convert (`prefix`: the traced wrapper's attribute path, e.g. "unet_"
    for a wrapper holding the model as `self.unet`; None: found from the names, see _find_prefix). Names are the
    tracer's (dots -> '_', plus coremltools' suffixes), checked by shape; GroupNorm affines (renamed by the
    converter) are found by dataflow (NORM_BEFORE). A package of Apple's that holds one part of a model (its
    VAEDecoder, whose VAEEncoder lies beside it: parts()) is read with the others. A name no package has, or a
    shape that differs, is refused in one line."""
    path = Path(path)
    if not path.exists():
        raise MlxdiffError(f"{path}: no such Core ML package")
    found, where = {}, {}
    for part in parts(path):
        for name, (value, const) in _mapped(part, {k: v for k, v in targets.items() if k not in found},
                                            prefix).items():
            found[name], where[name] = value, (part.model_file, const)
    missing = [n for n in targets if n not in found]
    if missing:
        raise MlxdiffError(f"{where_of(path)}: {len(missing)} of {len(targets)} weights not found by name "
                           f"(e.g. {', '.join(missing[:3])}); the package was not converted from these diffusers "
                           "modules (torch.jit.trace of them, or Apple's ml-stable-diffusion of the same config)")
    out = {}
    for name, value in found.items():
        shape = tuple(value.shape)
        if len(targets[name]) == 2 and shape == (*targets[name], 1, 1):   # a Linear converted as a 1x1 convolution
            value = value.as_linear() if isinstance(value, LutWeight) else value.reshape(shape[:2])
            shape = shape[:2]
        elif len(targets[name]) == 1 and shape[:2] == (1, *targets[name]) and set(shape[2:]) == {1}:   # [1, C, 1..]
            value = (value.dense() if isinstance(value, LutWeight) else value).reshape(targets[name])
            shape = tuple(targets[name])
        elif shape == (1, *targets[name]) and _base(where[name][1]) in FOLDED.values():   # rows looked up: the table
            value = (value.dense() if isinstance(value, LutWeight) else value).reshape(targets[name])
            shape = tuple(targets[name])
        if shape != tuple(targets[name]):
            model_file, const = where[name]
            raise MlxdiffError(f"{model_file}: {const} has shape {list(shape)}, {name} expects "
                               f"{list(targets[name])}; the package was converted from another configuration")
        out[name] = value
    return out


def where_of(path) -> Path:
    """The model file a refusal names: the package's own (its first chunk's for a chunked UNet)."""
    return parts(path)[0].model_file


def _mapped(program, targets: dict, prefix) -> dict:
    """{target name: (value, const name)} of the targets one program holds, by name (_aliases, FOLDED) and, for
    the norms, by dataflow."""
    weights = _guard(program.model_file, program.weights)
    by_base = {}
    for const in weights:
        by_base.setdefault(_base(const), []).append(const)
    if prefix is None:
        prefix = _find_prefix(by_base, targets)
    found = {}
    for name in targets:
        names = [_sanitized(prefix + a) for a in _aliases(name)]
        hits = next((by_base[c] for s in names for c in (s, "op_" + s, "var_" + s, "_" + s) if c in by_base), None)
        fold = next((FOLDED[k] for k in FOLDED if name.endswith(k)), None)
        if not hits and fold in by_base:
            hits = by_base[fold]
        if hits and len(hits) == 1:
            found[name] = hits[0]
    if len(found) < len(targets):
        found.update(_guard(program.model_file, lambda: _norms_by_dataflow(program, weights, targets, found, prefix)))
    return {name: (weights[const], const) for name, const in found.items()}


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
        if op.type in NORM_OPS and op.outputs:
            norm_out, table = op.outputs[0], NORM_OPS[op.type]
            params = {key: op.inputs.get(key, [None])[0] for key in ("gamma", "beta")}
        else:
            affine = _decomposed_affine(program, op, weights)
            if affine is None:
                continue
            norm_out, table, params = affine[0], NORM_BEFORE, affine[1]
        layer = _next_named_layer(program, norm_out, named)
        norm = None if layer is None else _norm_before(layer, table)
        if norm is None:
            continue
        for key, param in (("gamma", "weight"), ("beta", "bias")):
            binding = params[key]
            target = f"{norm}.{param}"
            if isinstance(binding, str) and binding in weights and target in targets and target not in found:
                out[target] = binding
    return out


def _decomposed_affine(program, op, weights):
    """A GroupNorm the torch frontend wrote out by hand (reduce_mean ... then `mul` by gamma and `add` of beta,
    both constants [1, C, 1, ..] with op-made names: the VAE attention's group_norm): (the add's output, {"gamma",
    "beta": their names}), else None."""
    if op.type != "mul" or not op.outputs:
        return None
    gamma = next((b for k in ("x", "y") for b in op.inputs.get(k, ()) if isinstance(b, str) and b in weights), None)
    users = program.consumers.get(op.outputs[0], [])
    if gamma is None or len(users) != 1 or users[0][0].type != "add":
        return None
    add = users[0][0]
    beta = next((b for k in ("x", "y") for b in add.inputs.get(k, ()) if isinstance(b, str) and b in weights), None)
    shape = tuple(weights[gamma].shape)
    if beta is None or len(shape) < 3 or shape[0] != 1 or set(shape[2:]) != {1} or \
            tuple(weights[beta].shape) != shape or not add.outputs:
        return None
    return add.outputs[0], {"gamma": gamma, "beta": beta}


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
        for s in map(_sanitized, _aliases(name)):
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
