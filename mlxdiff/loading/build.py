"""Strict loading of mapped weights into an mlx.nn module, with errors that name the keys."""

import math

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..errors import MlxdiffError
from ..formats import format_of
from ..formats.fp8 import Fp8Embedding, Fp8Linear, saved_fp8, use_fp8_layers
from ..formats.palettized import use_palettized_layers
from ..formats.quantized import flatten_quantized, quantized_predicate
from ..formats.safetensors import (CHECK_WHOLE_ELEMENTS, check_safetensors, finite_flags, first_false,
                                   load_safetensors)
from ..policy import current_dtype
from .quantize import prepare_quantized, quantize_model, quantized_paths, use_palettized_convs


def _listing(names, limit=6):
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_into(module, weights: dict, source) -> None:
    """Put `weights` into `module`. Every parameter must be present with its exact shape, and nothing extra."""
    expected = dict(tree_flatten(module.parameters()))
    missing = expected.keys() - weights.keys()
    unexpected = weights.keys() - expected.keys()
    misshaped = [f"{k} {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
                 for k in expected.keys() & weights.keys() if tuple(weights[k].shape) != tuple(expected[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped: {_listing(misshaped)}")
    if problems:
        raise MlxdiffError(f"{source}: weights do not match the {type(module).__name__} config; "
                           + "; ".join(problems) + ". Check that the file and config.json belong together")
    module.load_weights(list(weights.items()), strict=True)


def in_model_names(model, weights: dict, native=False) -> dict:
    """Mapped weights in the names and layouts of the model's own parameters: Model.sanitize, or, for mlxdiff's own
    checkpoints (`native`, saved after sanitize), the float8 layers' codes and row scales paired again. Also what a
    streamed block's weights go through at every use (loading/streaming.py)."""
    if not native:
        return model.sanitize(weights)
    return saved_fp8(weights)


def build(arch, config: dict, weights: dict, source, native=False, quantize=None, check=True):
    """Make `arch.Model` from its config dict and weights in the names `arch.Model.sanitize` reads (already remapped
    from any other naming), for every architecture alike, LLM text encoders included.

    `arch` is a model module (mlxdiff.models.clip, ...) with `ModelArgs`, `Model` and `Model.sanitize`.
    The arrays stay lazy: nothing is read from disk until the model runs or the caller evaluates its parameters,
    except the small ones check_finite reads (`check` False: not even those; loading/streaming.py, whose
    stand-ins must stay unread, checks what it reads itself). It computes in the installed policy's compute dtype
    (float32 with none installed), kept as `model.compute_dtype` for what later reads the model's own.
    """
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.compute_dtype = current_dtype()
    given = {id(v): k for k, v in weights.items()}   # a refusal names a tensor as given, where sanitize only renamed it
    rename = None if native else model.sanitize
    weights = in_model_names(model, weights, native)
    if config.get("quantization"):  # saved quantized (mlxdiff.convert, mlx-lm's convert)
        prepare_quantized(model, weights, config["quantization"], rename, source)
    weights, gguf_layers = flatten_quantized(weights)
    if gguf_layers:  # GGUF weights stay quantized: exactly those layers become QuantizedLinear (per their own
        # bits) or RawLinear (the file's blocks); float8 ones Fp8Linear (formats/fp8.py)
        from ..formats.gguf import use_raw_layers  # heavy: formats.gguf imports the gguf package (~0.7 s)
        nn.quantize(model, class_predicate=quantized_predicate(gguf_layers))
        use_raw_layers(model, gguf_layers, model.compute_dtype)
        use_palettized_layers(model, gguf_layers, model.compute_dtype)
        use_palettized_convs(model, gguf_layers)
        use_fp8_layers(model, gguf_layers, weights, model.compute_dtype)
    load_into(model, weights, source)
    stored = keep_activations_in(model, model.compute_dtype)
    del weights
    # the weights that quantize-while-loading quantizes stay unread here (materialize streams them, layer by layer)
    skip = set() if not quantize else quantized_paths(model, quantize)
    if check:
        check_finite(model, source, stored, skip, given)
    if quantize:  # quantize while loading: still lazy here, materialized layer by layer by the caller
        quantize_model(model, **quantize)
    return model


def keep_activations_in(model, compute_dtype) -> dict:
    """No weight may change the dtype the activations are computed in: a float weight that would promote them
    (float32 norm scales, which GGUF and ComfyUI files keep, under bfloat16 compute; bfloat16 under float16) is cast
    to the compute dtype, lazily. Weights that the compute dtype absorbs (bfloat16 under float32) stay as stored.
    Returns {parameter path: the array as stored} of those cast."""
    stored = {}

    def cast(path, w):
        if not isinstance(w, mx.array) or w.dtype == compute_dtype or not mx.issubdtype(w.dtype, mx.floating):
            return w
        if path.endswith(".weight_scale"):   # a float8 layer's float32 scales: only the decoded weight is cast
            return w
        promoted = (mx.zeros((), w.dtype) + mx.zeros((), compute_dtype)).dtype
        if promoted == compute_dtype:
            return w
        stored[path] = w
        return w.astype(compute_dtype)

    model.update(tree_map_with_path(cast, model.parameters()))
    return stored


def check_finite(model, source, stored=None, skip=(), given=None, compute_dtype=None) -> None:
    """Refuse, in one line naming `source` and the parameter, a model whose floating parameters small enough to read
    whole (formats/safetensors.CHECK_WHOLE_ELEMENTS: norm weights, biases, scales, BatchNorm statistics; the small
    layers of small models) hold a NaN or an infinity, as they compute (after keep_activations_in's casts), or whose
    small float8 layers hold NaN codes: such a model draws an all-black image. One evaluation per batch of
    parameters, whatever the format (safetensors, GGUF's plain tensors, float8 files, quantized checkpoints' scales).
    `stored`: keep_activations_in's {path: array as stored}, to tell a value the file holds from a cast's overflow;
    `skip`: parameter paths left unread (the weights quantize-while-loading streams); `given`: {id(array): the name
    it was given to build under}, so that the line names a tensor as the file does where sanitize only renamed it."""

    params = [(k, v) for k, v in tree_flatten(model.parameters()) if k not in skip]
    flags = list(finite_flags(params))
    for path, module in model.named_modules():   # float8 e4m3fn codes 0x7F / 0xFF are its NaN (it has no inf)
        if isinstance(module, (Fp8Linear, Fp8Embedding)) and module["weight"].size <= CHECK_WHOLE_ELEMENTS:
            codes = module["weight"]
            flags.append((f"{path}.weight" if path else "weight", mx.all((codes & 0x7F) != 0x7F), codes.size))
    bad = first_false(flags)
    if bad is None:
        return
    original = (stored or {}).get(bad)
    name = (given or {}).get(id(original if original is not None else dict(params).get(bad)), bad)
    if original is not None and first_false(finite_flags([(bad, original)], limit=None)) is None:
        dtype = str(compute_dtype or model.compute_dtype).rsplit(".", 1)[-1]
        raise MlxdiffError(f"{source}: tensor {name!r} has values beyond {dtype}'s range, which the {dtype} compute "
                           "dtype makes infinite; use dtype bfloat16 or float32 (--dtype)")
    raise MlxdiffError(f"{source}: tensor {name!r} holds NaN or infinite values (it would draw a black image); the "
                       "file is corrupt, re-download or re-convert it")


def check_stored_values(files, prefix="") -> None:
    """Refuse, before any model is built, safetensors weight files (those of `files`; GGUF files are checked as they
    are read and built) whose floating tensors small enough to read whole (formats/safetensors.CHECK_WHOLE_ELEMENTS),
    float8 ones decoded, hold a NaN or an infinity: one line naming the file and the tensor as stored. Only tensors
    under `prefix` (a single file's component). A few MB of a real model are read; check_finite does the same at
    build time for every format, after the casts."""
    for path in files:
        if format_of(path, header=False).converts:   # checked as read (GGUF) or once built (a Core ML package)
            continue
        info = check_safetensors(path)
        small = [k for k, (_, shape) in info.items()
                 if k.startswith(prefix) and math.prod(shape) <= CHECK_WHOLE_ELEMENTS]
        if not small:
            continue
        arrays = load_safetensors(path, info=info)
        bad = first_false(finite_flags((k, arrays[k]) for k in small))
        if bad is not None:
            raise MlxdiffError(f"{path}: tensor {bad!r} holds NaN or infinite values (it would draw a black image); "
                               "the file is corrupt, re-download or re-convert it")
