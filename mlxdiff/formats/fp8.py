"""float8 safetensors files, ComfyUI's two fp8 layouts included, with their weights kept at 8 bits.

The layouts, as ComfyUI writes and reads them (comfy/utils.convert_old_quants, comfy/ops.mixed_precision_ops,
comfy/quant_ops.TensorCoreFP8Layout):
- scaled fp8 (`t5xxl_fp8_e4m3fn_scaled.safetensors`, FLUX / SD3.5 "fp8 scaled" files): a marker tensor
  `<prefix>scaled_fp8` (float8_e4m3fn or float32, both meaning e4m3fn; two elements instead of one only ask ComfyUI
  for a full-precision matmul), and per quantized linear layer `<layer>.weight` in float8_e4m3fn with
  `<layer>.scale_weight`, a float32 scale; maybe `<layer>.scale_input`, the scale ComfyUI quantizes the layer's
  *input* with for an fp8 matmul (the weight does not depend on it).
- comfy_quant (Comfy-Org's `*_fp8mixed` files, fp8 text encoders): per quantized layer `<layer>.weight` in
  float8_e4m3fn, `<layer>.weight_scale` float32, `<layer>.comfy_quant` a uint8 tensor of JSON
  (`{"format": "float8_e4m3fn"}`), maybe `<layer>.input_scale`; the header's `__metadata__` may say the same in
  `_quantization_metadata` (`{"layers": {layer: {"format": ...}}}`), which ComfyUI then takes over the tensors.
Either way a quantized layer's weight is float(weight) * scale (TensorCoreFP8Layout.dequantize); a layer without a
scale is plain (bf16, ...), and a float8 tensor without one has scale 1 (ComfyUI just casts it). Any other
comfy_quant format (nvfp4, int8, ...) is refused, naming the tensor and the format.

In memory: a 2-D float8 `<name>.weight` becomes a Float8Weight (the file's bytes and a float32 scale per row,
formats/quantized.py), which `build` makes an Fp8Linear: decoded to float one layer at a time just before its
matmul, as GGUF's raw blocks are (quantized.chunked_matmul); if the module is not a Linear (an embedding) it is
decoded at load (`use_fp8_layers`). Other float8 tensors are decoded, times their scale, to the compute dtype at
load. The marker, scales, comfy_quant tensors and input scales are consumed here: they never reach load_weights.
"""

import numpy as np

from .. import backend
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ..errors import MlxdiffError
from . import safetensors as st
from .quantized import DecodingEmbedding, DecodingLinear, Float8Weight

SUPPORTED = ("float8_e4m3fn",)
MARKER = "scaled_fp8"
SCALES = (".scale_weight", ".weight_scale")        # scaled fp8's name, comfy_quant's name
INPUT_SCALES = (".scale_input", ".input_scale")
CONF = ".comfy_quant"
METADATA_KEY = "_quantization_metadata"
MAX_CONF_BYTES = 1 << 16
FLOATS = ("F32", "F16", "BF16")


def _is_marker(name) -> bool:
    return name == MARKER or name.endswith("." + MARKER)


def applies(info: dict, meta: dict) -> bool:
    """Whether a checked safetensors header ({name: (dtype, shape)}, __metadata__) needs this reader: any float8
    e4m3 tensor, or any of ComfyUI's quantization markers. Not mlxdiff's own files (mlxdiff.convert's, whose
    float8 layers are saved as held: build reads them back, loading/build.py)."""
    if meta.get("format") == "mlxdiff":
        return False
    return METADATA_KEY in meta or any(
        dtype == "F8_E4M3" or _is_marker(n) or n.endswith(CONF) or n.endswith(SCALES) for n, (dtype, _) in info.items())


def decode(codes, scale) -> mx.array:
    """uint8 float8-e4m3fn codes [rows, ...] and float32 scales [rows] -> float32 weights, as ComfyUI defines them
    (float32(code) * scale; MLX's from_fp8 decodes every code exactly, NaN codes included)."""
    return _times(mx.from_fp8(codes, dtype=mx.float32), scale)


def _short(value):
    return st._short(value)


def _json_tensor(path, name, dtype, shape, array):
    """The JSON object a comfy_quant tensor holds (uint8 bytes of UTF-8 JSON)."""
    def bad(what):
        return MlxdiffError(f"{path}: tensor {_short(name)} is not a valid ComfyUI comfy_quant tensor ({what}); "
                            "re-download the file")
    if dtype not in ("U8", "I8") or len(shape) != 1 or shape[0] > MAX_CONF_BYTES:
        raise bad(f"{dtype} {list(shape)}, expected a 1-D uint8 tensor of JSON")
    try:
        text = np.array(array).astype(np.uint8).tobytes().decode("utf-8")
    except UnicodeDecodeError:
        raise bad("not UTF-8") from None
    value = st.parse_json(text, bad)
    if not isinstance(value, dict):
        raise bad("not a JSON object")
    return value


def _layer_confs(path, info, meta, arrays) -> dict:
    """{layer: {"format": ...}} from the comfy_quant tensors and the `_quantization_metadata` (which wins, as in
    ComfyUI)."""
    confs = {}
    for name, (dtype, shape) in info.items():
        if name.endswith(CONF):
            confs[name[:-len(CONF)]] = _json_tensor(path, name, dtype, shape, arrays[name])
    text = meta.get(METADATA_KEY)
    if text is not None:
        def bad(what):
            return MlxdiffError(f"{path}: its __metadata__ {METADATA_KEY} is not valid ({what}); re-download the file")
        value = st.parse_json(text, bad)
        layers = value.get("layers") if isinstance(value, dict) else None
        if not isinstance(layers, dict):
            raise bad("no \"layers\" object")
        for layer, conf in layers.items():
            conf = {"format": conf} if isinstance(conf, str) else conf
            if not isinstance(conf, dict):
                raise bad(f"layer {_short(layer)}: {_short(conf)} is not an object")
            confs[layer] = conf
    return confs


def _plan(path, info, meta, arrays):
    """(the names of the tensors kept, {weight name: scale name}), every conf's format and every scale checked."""
    confs = _layer_confs(path, info, meta, arrays)
    for layer, conf in confs.items():
        weight = f"{layer}.weight"
        if weight not in info:
            continue   # (ComfyUI ignores a conf for a layer it does not have)
        fmt = conf.get("format")
        if fmt not in SUPPORTED:
            raise MlxdiffError(f"{path}: tensor {_short(weight)} is in ComfyUI's {_short(fmt)} quantization, which "
                               f"mlxdiff does not read (it reads {', '.join(SUPPORTED)}); use a bf16 or fp8 file")
        if info[weight][0] != "F8_E4M3":
            raise MlxdiffError(f"{path}: tensor {_short(weight)} is {info[weight][0]}, but its comfy_quant says "
                               f"{fmt}; the file is inconsistent, re-convert it")
        if not any(f"{layer}{s}" in info for s in SCALES):
            raise MlxdiffError(f"{path}: tensor {_short(weight)} is quantized ({fmt}) but has no "
                               f"{_short(layer + '.weight_scale')}; the file is incomplete, re-download it")
    keep, scales = [], {}
    for name, (dtype, shape) in info.items():
        if _is_marker(name) or name.endswith(CONF) or name.endswith(INPUT_SCALES):
            continue
        scale_of = next((name[:-len(s)] for s in SCALES if name.endswith(s)), None)
        if scale_of is None:
            keep.append(name)
            continue
        weight = f"{scale_of}.weight"
        if weight not in info:
            raise MlxdiffError(f"{path}: tensor {_short(name)} is the scale of {_short(weight)}, which the file does "
                               "not have; the file is incomplete, re-download it")
        if weight in scales:
            raise MlxdiffError(f"{path}: {_short(weight)} has two scales ({scales[weight]}, {name}); re-convert it")
        if info[weight][0] not in ("F8_E4M3", *FLOATS):
            raise MlxdiffError(f"{path}: tensor {_short(weight)} is {info[weight][0]} with a scale "
                               f"({_short(name)}) but no ComfyUI format mlxdiff reads (float8_e4m3fn weights); use a "
                               "bf16 or fp8 file")
        rows = info[weight][1][0] if info[weight][1] else 1
        size = int(np.prod(shape)) if shape else 1
        if dtype not in FLOATS or size not in (1, rows):
            raise MlxdiffError(f"{path}: tensor {_short(name)} ({dtype} {list(shape)}) is not a scale of "
                               f"{_short(weight)} {list(info[weight][1])} (one float, or one per row); re-convert it")
        scales[weight] = name
    return keep, scales


def load(path, info, meta, compute_dtype=None) -> dict:
    """{name: mx.array | Float8Weight} from a checked safetensors file (`info`, `meta`: check_safetensors with
    metadata), lazily: float8 linear weights at 8 bits, other float8 tensors decoded to the compute dtype."""
    arrays = st.load_safetensors(path, decode_fp8=False, info=info)
    keep, scales = _plan(path, info, meta, arrays)
    # every scale read whole (one float, or one per row) and checked finite at once: a NaN or infinite scale would
    # make its whole layer NaN (an all-black image), and a big weight's scale is folded in below, past any later check
    bad = st.first_false(st.finite_flags(((s, arrays[s]) for s in scales.values()), limit=None))
    if bad is not None:
        raise MlxdiffError(f"{path}: tensor {_short(bad)} (a float8 scale) holds NaN or infinite values; the file is "
                           "corrupt, re-download or re-convert it")
    dtype = backend.compute_dtype(compute_dtype)
    out = {}
    for name in keep:
        kind, shape = info[name]
        a = arrays[name]
        scale = arrays[scales[name]].astype(mx.float32) if name in scales else None
        rows = shape[0] if shape else 1
        if scale is not None:
            scale = mx.broadcast_to(scale.reshape(()), (rows,)) if scale.size == 1 else scale.reshape(rows)
        if kind == "F8_E4M3" and len(shape) == 2 and name.endswith(".weight"):
            out[name] = Float8Weight(a, scale if scale is not None else mx.ones((rows,), mx.float32))
        elif kind == "F8_E4M3":
            out[name] = _times(mx.from_fp8(a, dtype=mx.float32), scale).astype(dtype)
        elif scale is not None:   # a float weight with a scale: the same definition, kept in its own dtype
            out[name] = _times(a.astype(mx.float32), scale).astype(a.dtype)
        else:
            out[name] = a
    return out


def _times(w, scale):
    """float32 `w` times a scale per row (axis 0), or unchanged for None."""
    if scale is None:
        return w
    return w * (scale.reshape(()) if w.ndim == 0 else scale.reshape(scale.shape[0], *([1] * (w.ndim - 1))))


def loaded_nbytes(info, meta, compute_dtype=None) -> int:
    """Bytes `load` holds for a file, from its header alone: float8 linear weights at 1 byte plus a float32 scale
    per row, other float8 tensors in the compute dtype, the rest as stored; markers and scales nothing."""
    size = backend.compute_dtype(compute_dtype).size
    total = 0
    for name, (dtype, shape) in info.items():
        if _is_marker(name) or name.endswith(CONF) or name.endswith(INPUT_SCALES) or name.endswith(SCALES):
            continue
        n = int(np.prod(shape)) if shape else 1
        if dtype == "F8_E4M3":
            total += n + 4 * shape[0] if len(shape) == 2 and name.endswith(".weight") else n * size
        else:
            total += st.nbytes(dtype, shape)
    return total


def saved_fp8(weights: dict) -> dict:
    """mlxdiff's own checkpoints hold an Fp8Linear as its arrays (`<layer>.weight` uint8 codes, `<layer>.weight_scale`
    float32 rows): those pairs become Float8Weight again, so that they load as Fp8Linear."""
    out = dict(weights)
    for name in weights:
        if not name.endswith(".weight_scale"):
            continue
        weight = name[:-len("_scale")]
        codes = out.get(weight)
        if codes is not None and codes.dtype == mx.uint8 and codes.ndim == 2:
            out[weight] = Float8Weight(codes, out.pop(name))
    return out


class Fp8Linear(DecodingLinear):
    """A linear layer whose weight stays float8 e4m3fn (`weight` uint8 [out, in], `weight_scale` float32 [out]),
    decoded to float (x scale) just before its matmul, a chunk of rows at a time on the CPU (formats/quantized.py)."""

    def __init__(self, in_dims, out_dims, bias=False, compute_dtype=None):
        super().__init__()
        self.in_dims, self.compute_dtype = in_dims, compute_dtype
        self.weight = mx.zeros((out_dims, in_dims), dtype=mx.uint8)
        self.weight_scale = mx.zeros((out_dims,), dtype=mx.float32)
        if bias:
            self.bias = mx.zeros((out_dims,))
        self.freeze()

    def _extra_repr(self):
        return f"input_dims={self.in_dims}, output_dims={self.weight.shape[0]}, float8_e4m3fn x scale"

    def decode(self, weight_rows, rows):
        return decode(weight_rows, self["weight_scale"][rows])

    def column_unit(self) -> tuple:
        """(values, bytes) per column unit: one code per value, the scale per row (models/sharding.py splits
        columns anywhere)."""
        return 1, 1


class Fp8Embedding(DecodingEmbedding):
    """An embedding whose table stays float8 e4m3fn (`weight` uint8 [vocab, dims], `weight_scale` float32 [vocab]):
    only the looked-up rows are decoded, so the table stays at the file's size."""

    def __init__(self, vocab, dims, compute_dtype=None):
        super().__init__()
        self.dims, self.compute_dtype = dims, compute_dtype
        self.weight = mx.zeros((vocab, dims), dtype=mx.uint8)
        self.weight_scale = mx.zeros((vocab,), dtype=mx.float32)
        self.freeze()

    def _extra_repr(self):
        return f"{self.weight.shape[0]}, {self.dims}, float8_e4m3fn x scale"

    def decode(self, weight_rows, rows):
        return decode(weight_rows, self["weight_scale"][rows])


def use_fp8_layers(model, layers: dict, weights: dict, compute_dtype=None) -> None:
    """Before loading: the Linear layers named in `layers` with {"fp8": ...} become Fp8Linear and the Embedding
    layers Fp8Embedding; a float8 weight of any other module is decoded in `weights` to the compute dtype instead
    (in place)."""
    fp8 = {path for path, setting in layers.items() if "fp8" in setting}
    if not fp8:
        return
    modules = dict(model.named_modules())
    for path in fp8:
        if not isinstance(modules.get(path), (nn.Linear, nn.Embedding)):
            scale = weights.pop(f"{path}.weight_scale")
            weights[f"{path}.weight"] = decode(weights[f"{path}.weight"], scale).astype(
                backend.compute_dtype(compute_dtype))

    def swap(path, module):
        if path not in fp8 or not isinstance(module, (nn.Linear, nn.Embedding)):
            return module
        if isinstance(module, nn.Embedding):
            vocab, dims = module.weight.shape
            return Fp8Embedding(vocab, dims, compute_dtype)
        out_dims, in_dims = module.weight.shape
        return Fp8Linear(in_dims, out_dims, "bias" in module, compute_dtype)

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
