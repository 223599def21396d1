"""Planning one LoRA file on a model (every tensor checked against the layers it reaches), checking it before the
model's weights are read, adding the LoRAs to a model, removing them, and describing them."""

import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxdiffError
from ..formats import tensor_nbytes
from ..formats.quantized import linear_dims, split_rows
from .files import ALPHA_DTYPES, FACTOR_DTYPES, _check_values, _read, _short
from .layers import LoRAConv, LoRALinear, conv_dims
from .names import (DENOISERS, LORA_DENOISERS, TEXT_ENCODERS, _entries, _Layers, _naming, _other_architecture,
                    takes_loras)
from .peft import _by_pattern, _coverage, _peft_config


def _scale(path, slot, config, target, rank):
    """alpha / rank of one LoRA layer reaching mlxdiff layer `target` (diffusers' module name): PEFT's reading of
    its metadata (`config`: its r or rank_pattern must be the tensors' rank), else its .alpha tensor, else 1."""
    if config is not None:
        if "alpha" in slot:
            raise MlxdiffError(f"{path}: {_short(slot['alpha'][0])!r} and the lora_adapter_metadata both give the "
                               "alpha; keep one (drop the .alpha tensors or the metadata)")
        r = _by_pattern(config["rank_pattern"], target, config["r"])
        if r != rank:
            raise MlxdiffError(f"{path}: {_short(slot['A'][0])!r} is rank {rank}, its lora_adapter_metadata says rank "
                               f"{r} for layer {target!r} (r / rank_pattern); the file is inconsistent, re-save it")
        alpha = float(_by_pattern(config["alpha_pattern"], target, config["lora_alpha"]))
        return alpha / (math.sqrt(rank) if config["use_rslora"] else rank)
    if "alpha" not in slot:
        return 1.0
    key, value = slot["alpha"]
    if value.size != 1:
        raise MlxdiffError(f"{path}: {_short(key)!r} must be one number, got shape {tuple(value.shape)}")
    alpha = float(value.reshape(-1)[0].item())
    if not (math.isfinite(alpha) and alpha > 0):   # kohya's alpha: a positive number (0 would turn the LoRA off)
        raise MlxdiffError(f"{path}: {_short(key)!r} is {alpha:g}, not a positive number; re-save the LoRA")
    return alpha / rank


def components(path) -> list:
    """The pipeline components a LoRA file has layers for ("transformer", "text_encoder", ...; its header and
    names only)."""
    return sorted({c for c, _, _ in _entries(path, _read(path)[0])})


def model_dtype(model):
    """The dtype `model` computes in: its own `compute_dtype` (each Model's, float32 until loading/build sets the
    run's); float32 for a module without one."""
    return getattr(model, "compute_dtype", mx.float32)


def plan(model, arch, path, scale=1.0, component="transformer"):
    """[(mlxdiff layer path, A, B, scale, DoRA magnitude or None, its side ("out": per output row, "in": per input
    column), the file's key of A (the parts of one fused layer share it))] for the `component` part of one LoRA file
    on `model` (that component:
    an mlxdiff transformer, or a CLIP / T5 encoder, of `arch`), every tensor checked: its layer exists and is
    linear, no layer is reached twice, the shapes fit, the metadata agrees, and every value is finite and keeps the
    layer's weight change within the model's compute dtype (model_dtype). The LoRA's tensors are read; the model's
    are not."""
    tensors, meta, stored = _read(path)
    config = _peft_config(path, meta, component)
    denoiser = component in DENOISERS    # (its part is a file's "transformer" or "unet" one: the names tell which)
    entries = {k: v for k, v in _entries(path, tensors).items()
               if k[0] == component or (denoiser and k[0] in DENOISERS)}
    unmapped = None
    if denoiser:
        what = f"this {arch.LORA_NAME}"
        unmapped = getattr(arch, "LORA_UNMAPPED", None)
        others = _other_architecture(entries, arch.LORA_ARCHITECTURE)
        if others:
            raise MlxdiffError(f"{path}: a LoRA for {' / '.join(sorted(others))} (layer names such as "
                               f"{_short(next(iter(entries))[2])!r}), not for {what}")
    else:
        if arch.__name__ not in TEXT_ENCODERS:
            raise MlxdiffError(f"{path}: has LoRA layers for {component}, a {arch.__name__.rsplit('.', 1)[-1]} "
                               "encoder; mlxdiff applies text-encoder LoRAs to CLIP and T5 encoders only: "
                               "use a LoRA file without text-encoder layers")
        what = f"{component} ({TEXT_ENCODERS[arch.__name__]})"
    layers = _Layers(model, arch)
    planned, reached = [], {}   # reached: mlxdiff layer -> the lora_A key that reaches it
    forms = {}                  # a UNet's layer names: diffusers' (True) or the original SGM / ldm ones (False)
    for (_, kind, module), slot in entries.items():
        key_a, a = slot["A"]
        key_b, b = slot["B"]
        targets = layers.resolve(kind, module)
        if component == "unet" and targets:   # in mlxdiff's (diffusers') module names, or the original model's
            forms.setdefault(module in layers.modules or module in layers.folded, key_a)
        if not targets and unmapped and not layers.rules and unmapped[0].search(module):
            raise MlxdiffError(f"{path}: {_short(key_a)!r} {unmapped[1]}")
        if not targets:
            raise MlxdiffError(f"{path}: {_short(key_a)!r}: {what} has no layer {_short(module)!r}; the LoRA is "
                               "for another model (or another version of it)")
        for target in dict.fromkeys(target for target, *_ in targets):   # a layer named by several parts: once
            if target in reached:
                raise MlxdiffError(f"{path}: {_short(reached[target])!r} and {_short(key_a)!r} are both LoRAs of layer "
                                   f"{target!r} (one layer named twice, in two namings); keep one of them")
            reached[target] = key_a
        if a.ndim not in (2, 4) or b.ndim != a.ndim or a.shape[0] != b.shape[1] or a.shape[0] == 0 or \
                b.shape[2:] not in ((), (1, 1)):
            raise MlxdiffError(f"{path}: {_short(key_a)!r} {tuple(a.shape)} and {_short(key_b)!r} {tuple(b.shape)} "
                               "are not a LoRA pair (A: rank x in, B: out x rank; a convolution's: A rank x in x kh "
                               "x kw, B out x rank x 1 x 1)")
        if "factors" in slot and config is not None:
            raise MlxdiffError(f"{path}: {_short(key_a)!r}: LyCORIS LoHa / LoKr factors with PEFT LoraConfig metadata "
                               "(lora_adapter_metadata); the file is inconsistent, re-save it without the metadata")
        for key in slot.get("factors", (key_a, key_b)):
            if stored[key] not in FACTOR_DTYPES:
                raise MlxdiffError(f"{path}: {_short(key)!r} is {stored[key]}; LoRA factors are float32, float16 or "
                                   "bfloat16: re-save the LoRA in one of them")
        if "alpha" in slot and stored[slot["alpha"][0]] not in ALPHA_DTYPES:
            raise MlxdiffError(f"{path}: {_short(slot['alpha'][0])!r} is {stored[slot['alpha'][0]]}; an alpha is one "
                               "number (float or integer)")
        rank = a.shape[0]
        b = b.reshape(b.shape[:2])     # a convolution's 1x1 up factor is a matrix
        parts = targets[0][2]
        if b.shape[0] % parts:
            raise MlxdiffError(f"{path}: {_short(key_b)!r} has {b.shape[0]} rows; its layer {_short(module)!r} is "
                               f"{parts} layers here, which it cannot be split into")
        pieces = split_rows(b, parts) if parts > 1 else [b]
        # DoRA: one magnitude per output row, split as B's rows (PEFT's lora_magnitude_vector, LyCORIS's dora_scale
        # (out, 1[, 1, 1]): wd_on_out, its default), or one per input column / channel, shared by a fused layer's
        # parts (a dora_scale (1, in[, 1, 1]): wd_on_out=False): the shape tells which, as LyCORIS's
        # functional/general.py _weight_decompose makes it
        magnitude, side = slot.get("m", (None, None))[1], "out"
        if magnitude is not None:
            key_m, shape_m = slot["m"][0], tuple(magnitude.shape)
            if key_m.endswith((".dora_scale", ".dora_scale.weight")) and magnitude.ndim >= 2 and \
                    shape_m[0] == 1 < shape_m[1] and set(shape_m[2:]) <= {1}:
                side = "in"
            # PEFT's own shapes (DoraLinearLayer: (out,); DoraConv2dLayer: (1, out, 1, 1)): what PEFT loads
            peft_shape = (1, b.shape[0], 1, 1) if a.ndim == 4 else (b.shape[0],)
            if key_m.endswith(".lora_magnitude_vector") and "factors" not in slot and shape_m != peft_shape:
                raise MlxdiffError(f"{path}: {_short(key_m)!r} {shape_m} is not the DoRA magnitude of "
                                   f"{_short(key_b)!r} (PEFT's is {peft_shape}); re-save the LoRA with PEFT")
            magnitude = magnitude.reshape(-1)
            if stored[key_m] not in FACTOR_DTYPES or (side == "out" and magnitude.shape[0] != b.shape[0]):
                lycoris = ": LyCORIS's wd_on_out" if key_m.endswith((".dora_scale", ".dora_scale.weight")) else ""
                raise MlxdiffError(f"{path}: {_short(key_m)!r} {shape_m} is not the DoRA magnitude of "
                                   f"{_short(key_b)!r} (one float per its {b.shape[0]} output rows{lycoris})")
        if config is not None and config.get("use_dora") and magnitude is None:
            raise MlxdiffError(f"{path}: {_short(key_a)!r} has no lora_magnitude_vector, but the file's metadata says "
                               "use_dora; the file is incomplete")
        m_pieces = None if magnitude is None else [magnitude] * parts if side == "in" else \
            split_rows(magnitude, parts) if parts > 1 else [magnitude]
        # a layer named by several consecutive parts takes their rows together (FLUX.1's linear1: q, k, v, then the
        # MLP's four widths)
        grouped = {}
        for (target, i, _, transform) in targets:
            grouped.setdefault(target, ([], transform))[0].append(i)
        for target, (indices, transform) in grouped.items():
            layer = layers.modules[target]
            dims, conv = linear_dims(layer), conv_dims(layer)
            if dims is None and conv is None:
                raise MlxdiffError(f"{path}: {_short(key_a)!r}: layer {target!r} is a {type(layer).__name__}, not a "
                                   "linear layer or a convolution; mlxdiff applies LoRAs to those only")
            piece = pieces[indices[0]] if len(indices) == 1 else mx.concatenate([pieces[j] for j in indices])
            piece = transform(piece) if transform else piece
            factor = a
            if conv is not None and "factors" in slot and a.ndim == 2 and conv[2] != (1, 1) and \
                    a.shape[1] == conv[0] * conv[2][0] * conv[2][1]:   # LoHa / LoKr: PyTorch's flattened kernel
                a = a.reshape(a.shape[0], conv[0], *conv[2])
            if conv is not None:   # A as the down convolution, OHWI (a 1x1 convolution's may be a matrix)
                factor = (a if a.ndim == 4 else a[:, :, None, None]).transpose(0, 2, 3, 1)
                fits = factor.shape[1:3] == conv[2] and factor.shape[3] == conv[0] and piece.shape[0] == conv[1]
                dims, kernel = conv[:2], f", kernel {conv[2][0]}x{conv[2][1]}"
            else:
                fits = a.ndim == 2 and a.shape[1] == dims[0] and piece.shape[0] == dims[1]
                kernel = ""
            if not fits and "factors" in slot:
                shapes = ", ".join(f"{_short(k.rsplit('.', 1)[-1])} {tuple(tensors[k].shape)}"
                                   for k in slot["factors"])
                raise MlxdiffError(
                    f"{path}: {_short(key_a.rsplit('.', 1)[0])!r}: its {slot['form']} factors ({shapes}) make a "
                    f"{b.shape[0]} x {slot['A'][1].shape[1]} weight change, which does not fit layer {target!r} "
                    f"({dims[0]} in{kernel and f' x {conv[2][0]} x {conv[2][1]}'}, {dims[1] * parts // len(indices)} "
                    "out); the LoRA is for another model size")
            if not fits:
                raise MlxdiffError(
                    f"{path}: {_short(key_a)!r}: shapes A {tuple(a.shape)}, B {tuple(slot['B'][1].shape)} do not fit "
                    f"layer {target!r} ({dims[0]} in, {dims[1] * parts // len(indices)} out{kernel}); the LoRA is for "
                    "another model size")
            s = scale * _scale(path, slot, config, target, rank)
            m = None if m_pieces is None else m_pieces[indices[0]] if len(indices) == 1 or side == "in" else \
                mx.concatenate([m_pieces[j] for j in indices])
            if m is not None and side == "in" and m.shape[0] != dims[0]:
                raise MlxdiffError(f"{path}: {_short(slot['m'][0])!r} {tuple(slot['m'][1].shape)} is not the DoRA "
                                   f"magnitude of layer {target!r} per input {'channel' if conv else 'column'} "
                                   f"(LyCORIS's wd_on_out=False: 1 x its {dims[0]} inputs)")
            planned.append((target, key_a, key_b, factor, b, piece, s, m, side))
    namings = {}
    for slot in entries.values():
        for role in ("A", "B"):
            namings.setdefault(_naming(slot[role][0]), slot[role][0])
        key_m = slot.get("m", ("",))[0]
        if key_m.endswith((".lora_magnitude_vector", ".lora_magnitude_vector.weight")) and \
                _naming(slot["A"][0])[1] != 0:   # PEFT's DoRA name beside kohya's factors (diffusers refuses it)
            raise MlxdiffError(f"{path}: {_short(key_m)!r} is PEFT's DoRA magnitude beside {_short(slot['A'][0])!r}"
                               ", another tool's naming (kohya's and LyCORIS's is .dora_scale); re-save it in one "
                               "naming")
    if len(forms) > 1:     # diffusers reads one of the two and drops the other's layers
        raise MlxdiffError(f"{path}: names its {component} LoRA layers two ways (diffusers' module names, "
                           f"{_short(forms[True])!r}, and the original model's, {_short(forms[False])!r}); re-save "
                           "it in one naming")
    if len(namings) > 1:   # each tool reads such a file its own way (diffusers keeps one naming, drops the other)
        first, second = list(namings.values())[:2]
        raise MlxdiffError(f"{path}: names its {component} LoRA layers two ways ({_short(first)!r}, "
                           f"{_short(second)!r}); re-save it in one naming")
    if config is not None:
        _coverage(path, config, layers, reached, component)
    _check_values(path, planned, model_dtype(model))
    return [(target, a, piece, s, m, side, key_a) for target, key_a, _, a, _, piece, s, m, side in planned]


def lora_nbytes(path) -> int:
    """Bytes of a LoRA file's tensors (its header; nothing is read)."""
    return sum(tensor_nbytes(path).values())


def check(spec, path, scale=1.0):
    """Refuse a LoRA whose part for the component `spec` describes does not fit it, before any of the model's weights
    is read: its layers and shapes against a lazily built (never evaluated) model of the spec's config, its metadata,
    and its values (the LoRA's tensors are read whole) in float32, that model's compute dtype (model_dtype)."""
    if spec.name in DENOISERS and not takes_loras(spec.arch):
        takers = [arch.LORA_NAME for arch in LORA_DENOISERS]
        raise MlxdiffError(f"{path}: LoRAs apply to the denoisers that name their LoRA layers (the "
                           f"{', '.join(takers[:-1])} and {takers[-1]}: models/protocol.LoRADenoiser), not "
                           f"{spec.arch.__name__}")
    plan(spec.arch.Model(spec.args), spec.arch, path, scale, spec.name)


def _cast(array, compute_dtype):
    """A LoRA tensor in a dtype that cannot promote the activations (as loading/build.keep_activations_in)."""
    promoted = (mx.zeros((), array.dtype) + mx.zeros((), compute_dtype)).dtype
    return array if promoted == compute_dtype else array.astype(compute_dtype)


def apply_loras(model, arch, loras, component="transformer") -> nn.Module:
    """Add the `component` part of every (file, scale) of `loras` to `model` in place (LoRALinear around each layer
    a LoRA reaches; several on one layer stack) and evaluate the LoRA tensors (the base stays as it is, lazy or
    not), in the model's compute dtype (model_dtype). Every file is planned and checked before the model is changed:
    a refusal leaves it as it was."""
    dtype = model_dtype(model)
    plans = [plan(model, arch, path, scale, component) for path, scale in loras]
    arrays = []
    modules = dict(model.named_modules())
    for planned in plans:
        cast, wrapped, adds = {}, {}, []
        squares = {}   # a per-column DoRA's column norms (squared) over all the parts of its original layer
        for target, a, b, s, m, side, source in planned:
            a = cast.setdefault(id(a), _cast(a, dtype))     # a fused layer's A is one array for its parts
            b = _cast(b, dtype)
            arrays += [a, b]
            layer = wrapped.get(target, modules[target])
            if not isinstance(layer, LoRALinear):
                layer = wrapped[target] = (LoRAConv if a.ndim == 4 else LoRALinear)(layer)
            if m is not None and side == "in":
                part = layer.dora_squares(a, b, s, "in")
                squares[source] = part if source not in squares else squares[source] + part
            adds.append((layer, a, b, s, m, side, source))
        for layer, a, b, s, m, side, source in adds:
            layer.add(a, b, s, None if m is None else layer.dora_factor(a, b, s, m, side, squares.get(source)), side)
            if m is not None:
                arrays.append(layer.lora_dora[-1])
        for target, layer in wrapped.items():
            _put(model, target, layer)
        modules = dict(model.named_modules())
    mx.eval(arrays)
    return model


def _put(model, path, layer):
    """model's module at the dotted `path` (list items by index) replaced by `layer`."""
    *parents, last = path.split(".")
    node = model
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = layer
    else:
        node[last] = layer


def remove_loras(model) -> nn.Module:
    """Every LoRALinear of `model` back to its base layer, in place."""
    for path, m in [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]:
        _put(model, path, m.base)
    return model


def describe(loras) -> str:
    """"name.safetensors:0.8, other.safetensors:1" (the PNG metadata's `lora` entry)."""
    return ", ".join(f"{Path(p).name}:{s:g}" for p, s in loras)
