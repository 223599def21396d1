"""How quantized layers multiply: the matmul strategy of a model whose Linear layers are kept quantized.

- "qmm" (what `build` makes): nn.QuantizedLinear, `mx.quantized_matmul` straight on the packed weights.
- "dequantize": DequantizedLinear holds the very same arrays (weight, scales, biases, bias) and, at each call,
  dequantizes its weight to the compute dtype just before an ordinary matmul, then lets it go.

`use_strategy(model, name)` swaps one kind of layer for the other in place; the arrays are moved, never copied,
so it can be called again to swap back.

Why the dequantize path waits for each layer's input and, on the CPU, goes a chunk of rows at a time: lazily, MLX
would dequantize every layer's weights first and hold them all, and mx.dequantize's CPU transient is 2-5x its
output (formats/quantized.chunked_matmul; the figures behind the choice: bench/RESULTS.md, GGUF sections).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ..errors import MlxdiffError
from ..formats.quantized import DecodingLinear, affine_dequantize

STRATEGIES = ("qmm", "dequantize")


class DequantizedLinear(DecodingLinear):
    """A quantized linear layer that multiplies through a transient dequantized weight (see the module docstring).

    Parameters and attributes are exactly nn.QuantizedLinear's (weight uint32 packed, scales, biases, optional
    bias; group_size, bits, mode), so checkpoints and `load_weights` treat both alike.
    """

    def __init__(self, weight, scales, biases, bias, group_size, bits, mode="affine",
                 compute_dtype=None):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.compute_dtype = compute_dtype     # None: the input's dtype
        self.weight, self.scales = weight, scales
        self.biases = biases
        if bias is not None:
            self.bias = bias
        self.freeze()

    def _extra_repr(self):
        out_dims, in_dims = self.weight.shape
        return (f"input_dims={in_dims * 32 // self.bits}, output_dims={out_dims}, bias={'bias' in self}, "
                f"group_size={self.group_size}, bits={self.bits}, mode={self.mode}, per-call dequantize")

    @property
    def in_dims(self):
        return self["weight"].shape[-1] * 32 // self.bits

    def decode(self, weight_rows, rows):
        biases = self.get("biases")
        biases = None if biases is None else biases[rows]
        if self.mode == "affine":      # affine_dequantize takes MLX's own op wherever its kernel does not run
            return affine_dequantize(weight_rows, self["scales"][rows], biases, self.group_size, self.bits)
        return mx.dequantize(weight_rows, self["scales"][rows], biases, group_size=self.group_size, bits=self.bits,
                             mode=self.mode)


def _arrays(layer):
    return layer["weight"], layer["scales"], layer.get("biases"), layer.get("bias")


def to_dequantized(layer: nn.QuantizedLinear, compute_dtype=None) -> DequantizedLinear:
    weight, scales, biases, bias = _arrays(layer)
    return DequantizedLinear(weight, scales, biases, bias, layer.group_size, layer.bits,
                             getattr(layer, "mode", "affine"), compute_dtype)


def to_quantized(layer: DequantizedLinear) -> nn.QuantizedLinear:
    """Back to nn.QuantizedLinear around the same arrays (its __init__ would allocate and quantize a random
    weight, so the instance is assembled directly, with the same fields __init__ sets)."""
    out = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
    nn.Module.__init__(out)
    out.group_size, out.bits, out.mode = layer.group_size, layer.bits, layer.mode
    weight, scales, biases, bias = _arrays(layer)
    out.weight, out.scales = weight, scales
    out.biases = biases
    if bias is not None:
        out.bias = bias
    out.freeze()
    return out


def use_strategy(model: nn.Module, strategy: str = "qmm") -> nn.Module:
    """Make every quantized linear layer of `model` use `strategy` ("qmm" or "dequantize"), in place.

    The dequantized weights are cast to `model.compute_dtype` (which `build` sets; without it, the input's dtype).
    Returns the model. Layers that are not quantized are left alone.
    """
    if strategy not in STRATEGIES:
        raise MlxdiffError(f"matmul strategy {strategy!r} is unknown; use one of: {', '.join(STRATEGIES)}")
    dtype = getattr(model, "compute_dtype", None)

    def swap(_, module):
        if strategy == "dequantize" and isinstance(module, nn.QuantizedLinear):
            return to_dequantized(module, dtype)
        if strategy == "qmm" and isinstance(module, DequantizedLinear):
            return to_quantized(module)
        return module

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return model


def strategy_of(model: nn.Module) -> dict:
    """{layer class name: count} of the quantized linear layers in `model` (for reports and tests)."""
    counts = {}
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, DequantizedLinear)):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts
