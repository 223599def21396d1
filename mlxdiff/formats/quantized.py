"""Weights kept quantized below the models: the QuantizedTensor type (an MLX affine triplet) and the row
operations key maps need on it (split a fused qkv, reorder row blocks) without dequantizing.

A file reader (GGUF today) returns QuantizedTensor values; `flatten_quantized` turns them into the arrays of
`nn.QuantizedLinear` layers and says which layers to quantize before strict loading.
"""

from dataclasses import dataclass

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError

@dataclass
class QuantizedTensor:
    """A weight kept in MLX affine form: w = scales * code + biases per group of `group_size` along the last axis.

    The arrays are exactly those of an `nn.QuantizedLinear` / `nn.QuantizedEmbedding`: `weight` uint32 packed
    [*rows, K * bits / 32], `scales` and `biases` [*rows, K / group_size]. `shape` is the logical PyTorch shape.
    """
    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    source_type: str = ""   # the GGUF type it came from

    @property
    def shape(self):
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    @property
    def quantization(self) -> dict:
        """The per-layer settings `nn.quantize`'s class_predicate returns for this weight."""
        return {"bits": self.bits, "group_size": self.group_size}

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    def dequantize(self, dtype=None) -> mx.array:
        w = mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        return w.astype(dtype) if dtype is not None else w

    def arrays(self, prefix) -> dict:
        """{prefix.weight, prefix.scales, prefix.biases}: the parameters of the quantized layer at `prefix`."""
        return {f"{prefix}.weight": self.weight, f"{prefix}.scales": self.scales, f"{prefix}.biases": self.biases}


def split_rows(tensor, n: int) -> list:
    """Split a weight into `n` equal parts along its rows (axis 0), e.g. a fused qkv into q, k, v.

    A QuantizedTensor is split while still quantized (rows of weight, scales and biases); an array with mx.split.
    """
    if not isinstance(tensor, QuantizedTensor):
        return mx.split(tensor, n, axis=0)
    rows = tensor.weight.shape[0]
    if tensor.weight.ndim < 2 or rows % n:
        raise MlxdiffError(f"cannot split a quantized weight of shape {tensor.shape} into {n} equal row blocks")
    return [QuantizedTensor(w, s, b, tensor.bits, tensor.group_size, tensor.source_type)
            for w, s, b in zip(*(mx.split(a, n, axis=0) for a in (tensor.weight, tensor.scales, tensor.biases)))]


def concat_rows(parts: list):
    """Inverse of split_rows (e.g. to reorder row blocks). Quantized parts must share bits and group size."""
    if not all(isinstance(p, QuantizedTensor) for p in parts):
        return mx.concatenate([p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts], axis=0)
    settings = {(p.bits, p.group_size) for p in parts}
    if len(settings) != 1:
        raise MlxdiffError(f"cannot join quantized weights with different settings {sorted(settings)}")
    return QuantizedTensor(*(mx.concatenate([getattr(p, a) for p in parts], axis=0)
                             for a in ("weight", "scales", "biases")), parts[0].bits, parts[0].group_size,
                           parts[0].source_type)


def flatten_quantized(weights: dict):
    """{name: array | QuantizedTensor} -> (flat {name: array}, {layer path: {"bits", "group_size"}}).

    A quantized "<layer>.weight" becomes "<layer>.weight" / ".scales" / ".biases". Use the second dict with
    `nn.quantize(model, class_predicate=quantized_predicate(layers))` before `load_weights`.
    """
    flat, layers = {}, {}
    for name, value in weights.items():
        if not isinstance(value, QuantizedTensor):
            flat[name] = value
            continue
        if not name.endswith(".weight"):
            raise MlxdiffError(f"quantized tensor {name!r} is not a layer weight (no '.weight' suffix); only "
                               "Linear and Embedding weights can stay quantized")
        prefix = name[: -len(".weight")]
        flat.update(value.arrays(prefix))
        layers[prefix] = value.quantization
    return flat, layers


def quantized_predicate(layers: dict):
    """class_predicate for nn.quantize: per-layer {"bits", "group_size"} for the layers stored quantized."""
    def predicate(path, module):
        return layers.get(path, False) if hasattr(module, "to_quantized") else False
    return predicate
