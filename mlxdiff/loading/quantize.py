"""Quantization in one place: the plan over a pipeline's components, quantize-while-loading, the rule for
checkpoints saved quantized, and streaming materialization. The settings (bits, group sizes) and their one check are
arguments.py's (SUPPORTED_BITS, GROUP_SIZES, QuantizeSetting, quantize_setting).

Which layers may be quantized is each model's own statement (`Model.quant_predicate(path, module)`, as mlx-lm's
models have): embedders, output layers and shared modulations stay in full precision, because they are small and an
error there reaches every block. Here only the generic conditions are added: a Linear layer whose input width is a
multiple of the group size. SD3's per-block adaLN layers ARE quantized: they hold about a third of the MMDiT.

Streaming: nn.quantize replaces each Linear by a QuantizedLinear whose arrays are still lazy functions of the lazily
mapped file; `materialize` then evaluates one module at a time, so the full-precision model never exists at once.
The peak is the quantized size plus about one layer in its stored dtype.

Palettized settings ({"mode": "palettize", "bits", "group_size"}: "p6", "p6:g16") take the same layers by the model's
own rule, with no condition on the input width, and make them PalettizedLinear (formats/palettized.py), whose k-means
is as lazy and is streamed the same way.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..arguments import DEFAULT_GROUP_SIZE, quantize_setting
from ..errors import MlxdiffError

def setting(value, where="quantize") -> dict:
    """4, {"bits": 4[, "group_size": 64]}, "p6[:g16]" or a QuantizeSetting -> the {["mode",] "bits", "group_size"} a spec holds
    (`spec.quantize`), through the one check of quantize settings (arguments.quantize_setting; a QuantizeSetting,
    checked already, is taken as it is)."""
    return quantize_setting(value, where).as_dict()


def plan(components: dict, quantize) -> None:
    """Set `spec.quantize` on a pipeline's specs. `quantize`: what arguments.check_quantize returns (a
    QuantizeSetting for every model component, or {component: QuantizeSetting}), whose settings are trusted here;
    only the component names are checked, against this pipeline. (Plain bits or dicts pass through the same one
    check on the way.)"""
    if quantize is None:
        return
    present = {k: v for k, v in components.items() if v is not None}
    wanted = {name: quantize for name in present} if not isinstance(quantize, dict) else dict(quantize)
    for name, value in wanted.items():
        if name not in present:
            raise MlxdiffError(f"quantize: unknown component {name!r}; this pipeline has "
                               + ", ".join(sorted(present)))
        present[name].quantize = setting(value, f"quantize[{name!r}]")


def quantizable(model, path, module, group_size, mode="affine") -> bool:
    """The model's own rule, plus what MLX needs: a Linear whose input width is a multiple of the group size (for
    the affine mode; a palettized layer's groups are of output rows, checked as it is palettized)."""
    if not isinstance(module, nn.Linear) or (mode == "affine" and module.weight.shape[-1] % group_size):
        return False
    rule = getattr(model, "quant_predicate", None)
    return rule is None or rule(path, module)


def quantized_paths(model, quantize: dict) -> set:
    """The parameter paths (`<layer>.weight`) that quantize-while-loading with the setting `quantize` replaces."""
    mode = quantize.get("mode", "affine")
    return {f"{path}.weight" for path, m in model.named_modules()
            if quantizable(model, path, m, quantize["group_size"], mode)}


def quantize_model(model, bits: int, group_size: int | None = DEFAULT_GROUP_SIZE, mode: str = "affine"):
    """Replace the quantizable Linear layers by QuantizedLinear, or by PalettizedLinear for mode "palettize"
    (lazily; call materialize to stream). A palettized group size that does not divide a layer's rows is refused
    in one line naming the layer."""
    checked = quantize_setting({"bits": bits, "group_size": group_size} | ({"mode": mode} if mode != "affine" else {}))
    if checked.mode == "palettize":
        from mlx.utils import tree_map_with_path
        from ..formats.palettized import PalettizedLinear, palettize
        dtype = getattr(model, "compute_dtype", None)

        def swap(path, m):
            if not quantizable(model, path, m, None, "palettize"):
                return m
            weight = palettize(m.weight, checked.bits, checked.group_size,
                               where=f"quantize={checked.text}: layer {path}")
            return PalettizedLinear.of(weight, m.get("bias"), dtype)

        model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
        return model
    nn.quantize(model, group_size=checked.group_size, bits=checked.bits,
                class_predicate=lambda path, m: quantizable(model, path, m, checked.group_size))
    return model


def prepare_quantized(model, weights: dict, quantization: dict, rename=None) -> None:
    """For a checkpoint saved quantized (mlxdiff.convert, mlx-lm's convert): quantize exactly the layers that have
    `.scales` in the file, each with the settings its arrays imply (mlx-lm's `infer_quant_config`), or with the
    per-layer entry of `quantization` where there is one. `rename` maps a file key to the model's (per-layer
    entries are keyed by the file's module paths). A palettized checkpoint (quantization {"mode": "palettize"}):
    the layers with `<layer>.lut` in the file become PalettizedLinear of the tables' shapes."""
    if quantization.get("mode") == "palettize":
        from ..formats.palettized import palettized_layers, use_palettized_layers
        use_palettized_layers(model, palettized_layers(weights), getattr(model, "compute_dtype", None))
        return
    from mlx_lm.utils import infer_quant_config
    overrides = {}
    for path, value in quantization.items():
        if isinstance(value, (dict, bool)):
            mapped = list(rename({f"{path}.weight": None})) if rename else [f"{path}.weight"]
            if mapped:
                overrides[mapped[0][:-len(".weight")]] = value

    def predicate(path, module):
        if path in overrides:
            return overrides[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=quantization.get("group_size", DEFAULT_GROUP_SIZE),
                bits=quantization.get("bits", 4), mode=quantization.get("mode", "affine"), class_predicate=predicate)


def parameter_nbytes(model) -> int:
    """Bytes of a model's parameters; exact also for a lazy (not yet evaluated) model, from shapes and dtypes."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def materialize(model):
    """Evaluate parameters one leaf module at a time (bounded peak when quantizing while loading)."""
    for _, module in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        params = module.parameters()
        if params:
            mx.eval(params)
