"""Strict loading of mapped weights into an mlx.nn module, with errors that name the keys."""

from mlx.utils import tree_flatten

from ..errors import MlxdiffError


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


def build(arch, config: dict, weights: dict, source, compute_dtype=None, native=False, quantize=None):
    """Make `arch.Model` from its config dict and weights in the names `arch.Model.sanitize` reads (already remapped
    from any other naming), for every architecture alike, LLM text encoders included.

    `arch` is a model module (mlxdiff.models.clip, ...) with `ModelArgs`, `Model` and `Model.sanitize`.
    The arrays stay lazy: nothing is read from disk until the model runs or the caller evaluates its parameters.
    """
    import mlx.core as mx
    from ..formats.quantized import flatten_quantized, quantized_predicate
    from .quantize import prepare_quantized, quantize_model
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.compute_dtype = compute_dtype or mx.float32
    # mlxdiff's own checkpoints (`native`) are saved after sanitize, in the module's own names and layouts
    rename = None if native else model.sanitize
    if not native:
        weights = model.sanitize(weights)
    else:  # float8 layers saved as they are held (mlxdiff.convert of an fp8 file): codes and row scales again
        from ..formats.fp8 import saved_fp8
        weights = saved_fp8(weights)
    if config.get("quantization"):  # saved quantized (mlxdiff.convert, mlx-lm's convert)
        prepare_quantized(model, weights, config["quantization"], rename)
    weights, gguf_layers = flatten_quantized(weights)
    if gguf_layers:  # GGUF weights stay quantized: exactly those layers become QuantizedLinear (per their own
        import mlx.nn as nn  # bits) or RawLinear (the file's blocks); float8 ones Fp8Linear (formats/fp8.py)
        from ..formats.fp8 import use_fp8_layers
        from ..formats.gguf import use_raw_layers
        nn.quantize(model, class_predicate=quantized_predicate(gguf_layers))
        use_raw_layers(model, gguf_layers, model.compute_dtype)
        use_fp8_layers(model, gguf_layers, weights, model.compute_dtype)
    load_into(model, weights, source)
    keep_activations_in(model, model.compute_dtype)
    if quantize:  # quantize while loading: still lazy here, materialized layer by layer by the caller
        quantize_model(model, quantize["bits"], quantize["group_size"])
    return model


def keep_activations_in(model, compute_dtype) -> None:
    """No weight may change the dtype the activations are computed in: a float weight that would promote them
    (float32 norm scales, which GGUF and ComfyUI files keep, under bfloat16 compute; bfloat16 under float16) is cast
    to the compute dtype, lazily. Weights that the compute dtype absorbs (bfloat16 under float32) stay as stored."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    def cast(path, w):
        if not isinstance(w, mx.array) or w.dtype == compute_dtype or not mx.issubdtype(w.dtype, mx.floating):
            return w
        if path.endswith(".weight_scale"):   # a float8 layer's float32 scales: only the decoded weight is cast
            return w
        promoted = (mx.zeros((), w.dtype) + mx.zeros((), compute_dtype)).dtype
        return w if promoted == compute_dtype else w.astype(compute_dtype)

    model.update(tree_map_with_path(cast, model.parameters()))
