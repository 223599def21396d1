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

Convolutions (the SD UNet's and VAE's 3x3 and 1x1 ones, models/vae.Conv2d and nn.Conv2d) are quantized too, by the
same rule: the kernel flattened to rows (out, kh*kw*in) in mlxdiff's OHWI layout is affine-quantized (group size
dividing kh*kw*in; otherwise the conv stays as it is, as a Linear of such a width does) or palettized over the same
rows. QuantizedConv2d / PalettizedConv2d keep it so and decode the dense kernel once per call, after their input
exists, then convolve as models/vae.Conv2d does (row bands included). Convolutions with fewer than
MIN_CONV_CHANNELS input or output channels stay in full precision: those are the ones that read or write the image or
the latent itself (the UNet's and the VAE's conv_in / conv_out, the VAE's quant_conv / post_quant_conv), a few
thousand weights whose error is not averaged over many channels but lands directly on every pixel or latent value.
"""

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..arguments import DEFAULT_GROUP_SIZE, quantize_setting
from ..errors import MlxdiffError
from ..formats.palettized import (PalettizedLinear, check_row_bytes, decode, palettize, palettized_layers,
                                 row_bytes, use_palettized_layers)
from ..models.vae import Conv2d

MIN_CONV_CHANNELS = 16   # a convolution with fewer input or output channels stays in full precision (above)

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
        wanted_setting = quantize_setting(value, f"quantize[{name!r}]")
        if not stored_as(present[name], wanted_setting):   # stored at that setting already: loaded as it is
            present[name].quantize = wanted_setting.as_dict()


def stored_setting(spec):
    """The QuantizeSetting a checkpoint saved quantized holds (its config.json's `quantization`: mlxdiff.convert's,
    mlx-lm's top-level bits / group size), None for a float one or one whose setting varies per layer."""
    stored = spec.config.get("quantization")
    if not isinstance(stored, dict):
        return None
    top = {k: stored[k] for k in ("mode", "bits", "group_size") if k in stored}
    try:
        return quantize_setting(top)
    except MlxdiffError:
        return None


def stored_as(spec, wanted) -> bool:
    """quantize= on a checkpoint already saved quantized at another setting is refused in one line: its float
    weights are gone, and quantizing the stored values again would add a second rounding to the first (a p4 table
    made from p6's 64 values is not the p4 table of the weights), an error neither setting has; nor may the
    request be dropped silently. The same setting as stored is what it holds: True (nothing to do); False for a
    float checkpoint."""
    stored = spec.config.get("quantization")
    if not stored:
        return False
    held = stored_setting(spec)
    if held is not None and held.as_dict() == wanted.as_dict():
        return True
    what = f"at {held.text}" if held is not None else "quantized (per-layer settings)"
    source = spec.files[0] if spec.files else spec.name
    raise MlxdiffError(f"quantize {spec.name}={wanted.text}: {source} is already stored {what} (its config.json's "
                       "quantization), and quantizing its stored values again would add a second error to the "
                       f"first; leave {spec.name} out of --quantize to run it as stored, or convert the original "
                       f"float model with --quantize {spec.name}={wanted.text}")


def quantizable(model, path, module, group_size, mode="affine") -> bool:
    """The model's own rule, plus what MLX needs: a Linear whose input width is a multiple of the group size (for
    the affine mode; a palettized layer's groups are of output rows, checked as it is palettized), or a plain 2-D
    convolution (conv_quantizable)."""
    if isinstance(module, nn.Conv2d):
        if not conv_quantizable(module, group_size, mode):
            return False
    elif not isinstance(module, nn.Linear) or (mode == "affine" and module.weight.shape[-1] % group_size):
        return False
    rule = getattr(model, "quant_predicate", None)
    return rule is None or rule(path, module)


def conv_quantizable(module, group_size, mode="affine") -> bool:
    """A convolution not quantized yet, of groups 1, with at least MIN_CONV_CHANNELS input and output channels
    (module docstring: the image / latent convolutions stay), whose flattened rows kh*kw*in the affine group size
    divides."""
    if isinstance(module, (QuantizedConv2d, PalettizedConv2d)) or module.groups != 1 or module.weight.ndim != 4:
        return False
    out, kh, kw, cin = module.weight.shape
    if min(out, cin) < MIN_CONV_CHANNELS:
        return False
    return mode != "affine" or (kh * kw * cin) % group_size == 0


class _DecodingConv2d(Conv2d):
    """A convolution (models/vae.Conv2d's stride, padding, dilation, row bands) whose kernel stays compact, as rows
    (out, kh*kw*in) of the OHWI kernel `kernel_shape`, and is decoded once per call after its input (`kernel`)."""

    decodes_per_call = True   # memory.compile_blocks_for: paced per layer, not compiled whole

    def __init__(self, conv, kernel_shape=None):
        nn.Module.__init__(self)
        self.kernel_shape = tuple(kernel_shape or conv.weight.shape)
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.band_bytes = getattr(conv, "band_bytes", None)
        if "bias" in conv:
            self.bias = conv.bias

    @property
    def in_cols(self) -> int:
        return math.prod(self.kernel_shape[1:])

    def decode_rows(self, weight) -> mx.array:
        raise NotImplementedError

    def kernel(self, x) -> mx.array:
        return self.decode_rows(mx.depends(self["weight"], x)).reshape(self.kernel_shape)

    def dense_weight(self) -> mx.array:
        """The whole decoded OHWI kernel (for tests and tools)."""
        return self.decode_rows(self["weight"]).reshape(self.kernel_shape)

    def _extra_repr(self):
        out, kh, kw, cin = self.kernel_shape
        return f"{cin}, {out}, kernel_size={(kh, kw)}, stride={self.stride}, padding={self.padding}"


class QuantizedConv2d(_DecodingConv2d):
    """A convolution whose kernel is kept in MLX affine form over its rows (out, kh*kw*in): `weight` uint32 codes,
    `scales`, `biases` [out, kh*kw*in / group_size] (the arrays of an nn.QuantizedLinear of that width)."""

    def __init__(self, conv, bits, group_size, kernel_shape=None, quantize=True):
        super().__init__(conv, kernel_shape)
        self.bits, self.group_size = bits, group_size
        out, cols = self.kernel_shape[0], self.in_cols
        if quantize:
            self.weight, self.scales, self.biases = mx.quantize(conv.weight.reshape(out, cols), group_size, bits)
        else:   # shapes for load_weights to fill
            self.weight = mx.zeros((out, cols * bits // 32), mx.uint32)
            self.scales = mx.zeros((out, cols // group_size))
            self.biases = mx.zeros((out, cols // group_size))
        self.freeze()

    def decode_rows(self, weight):
        return mx.dequantize(weight, self["scales"], self["biases"], group_size=self.group_size, bits=self.bits)

    def _extra_repr(self):
        return super()._extra_repr() + f", bits={self.bits}, group_size={self.group_size}"


class PalettizedConv2d(_DecodingConv2d):
    """A convolution whose kernel is kept palettized over its rows (out, kh*kw*in): the arrays of a PalettizedLinear
    of that width (`weight` uint8 packed indices, `lut` [groups, 2**nbits], maybe `scale` [out])."""

    def __init__(self, conv, weight=None, nbits=None, groups=1, scale=False, kernel_shape=None):
        super().__init__(conv, kernel_shape)
        if weight is not None:      # a PalettizedWeight of the flattened kernel
            self.weight, self.lut = weight.packed, weight.lut
            if weight.scale is not None:
                self.scale = weight.scale
        else:                       # shapes for load_weights to fill
            out = self.kernel_shape[0]
            if out % groups:
                raise MlxdiffError(f"palettized convolution: {groups} tables do not divide its {out} output rows")
            self.weight = mx.zeros((out, row_bytes(self.in_cols, nbits)), mx.uint8)
            self.lut = mx.zeros((groups, 1 << nbits))
            if scale:
                self.scale = mx.ones((out,))
        self.freeze()

    @property
    def nbits(self) -> int:
        return self["lut"].shape[1].bit_length() - 1

    def decode_rows(self, weight):
        return decode(weight, self["lut"], self.get("scale"), self.in_cols, self.kernel_shape[0] // self["lut"].shape[0])

    def _extra_repr(self):
        return super()._extra_repr() + f", {self.nbits}-bit palette, {self['lut'].shape[0]} table(s)"


def _swap_convs(model, make):
    """Each leaf module m at `path` for which make(path, m) returns a module is replaced by it."""
    def swap(path, m):
        new = make(path, m) if isinstance(m, nn.Conv2d) else None
        return m if new is None else new
    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))


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
        dtype = getattr(model, "compute_dtype", None)

        def swap(path, m):
            if not quantizable(model, path, m, None, "palettize"):
                return m
            where = f"quantize={checked.text}: layer {path}"
            if isinstance(m, nn.Conv2d):
                return PalettizedConv2d(m, palettize(m.weight.reshape(m.weight.shape[0], -1), checked.bits,
                                                     checked.group_size, where=where))
            weight = palettize(m.weight, checked.bits, checked.group_size, where=where)
            return PalettizedLinear.of(weight, m.get("bias"), dtype)

        model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
        return model
    _swap_convs(model, lambda path, m: QuantizedConv2d(m, checked.bits, checked.group_size)
                if quantizable(model, path, m, checked.group_size) else None)
    nn.quantize(model, group_size=checked.group_size, bits=checked.bits,
                class_predicate=lambda path, m: isinstance(m, nn.Linear)
                and quantizable(model, path, m, checked.group_size))
    return model


def prepare_quantized(model, weights: dict, quantization: dict, rename=None, source=None) -> None:
    """For a checkpoint saved quantized (mlxdiff.convert, mlx-lm's convert): quantize exactly the layers that have
    `.scales` in the file, each with the settings its arrays imply (mlx-lm's `infer_quant_config`), or with the
    per-layer entry of `quantization` where there is one. `rename` maps a file key to the model's (per-layer
    entries are keyed by the file's module paths). A palettized checkpoint (quantization {"mode": "palettize"}):
    the layers with `<layer>.lut` in the file become PalettizedLinear of the tables' shapes, each layer's arrays
    checked first (palettized_layers; a refusal names `source`, the file)."""
    if quantization.get("mode") == "palettize":
        try:
            layers = palettized_layers(weights)
            use_palettized_layers(model, layers, getattr(model, "compute_dtype", None))
            use_palettized_convs(model, layers)
        except MlxdiffError as e:
            raise MlxdiffError(f"{source}: {e}" if source else str(e)) from None
        return
    from mlx_lm.utils import infer_quant_config  # heavy: mlx_lm.utils imports transformers and torch
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

    def conv(path, module):
        if f"{path}.scales" not in weights or isinstance(module, (QuantizedConv2d, PalettizedConv2d)):
            return None
        cols = math.prod(module.weight.shape[1:])
        codes, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
        given = overrides.get(path) if isinstance(overrides.get(path), dict) else {}
        return QuantizedConv2d(module, given.get("bits", codes.shape[-1] * 32 // cols),
                               given.get("group_size", cols // scales.shape[-1]), quantize=False)

    _swap_convs(model, conv)
    nn.quantize(model, group_size=quantization.get("group_size", DEFAULT_GROUP_SIZE),
                bits=quantization.get("bits", 4), mode=quantization.get("mode", "affine"), class_predicate=predicate)


def use_palettized_convs(model, layers: dict) -> None:
    """Before loading: the convolutions named in `layers` with {"palettize": nbits, "groups", "scale"}
    (palettized_layers') become PalettizedConv2d of those shapes, for load_weights to fill."""
    def conv(path, module):
        setting = layers.get(path)
        if not setting or "palettize" not in setting or isinstance(module, (QuantizedConv2d, PalettizedConv2d)):
            return None
        check_row_bytes(path, setting, math.prod(module.weight.shape[1:]))
        return PalettizedConv2d(module, nbits=setting["palettize"], groups=setting.get("groups", 1),
                                scale=setting.get("scale", False))
    _swap_convs(model, conv)


def parameter_nbytes(model) -> int:
    """Bytes of a model's parameters; exact also for a lazy (not yet evaluated) model, from shapes and dtypes."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def materialize(model):
    """Evaluate parameters one leaf module at a time (bounded peak when quantizing while loading)."""
    for _, module in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        params = module.parameters()
        if params:
            mx.eval(params)
