"""Quantized-layer test pieces shared by several test modules (no test module imports another): a component built
and materialized, the same model with every quantized layer dense (tests/test_quantized_conv.py), and the MLX
bytes a build adds (tests/test_quantized_encoders.py)."""

import gc

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from mlxdiff.formats import palettized as P
from mlxdiff.loading.quantize import PalettizedConv2d, QuantizedConv2d, materialize, parameter_nbytes
from mlxdiff.models.vae import Conv2d


QUANTIZED = (QuantizedConv2d, PalettizedConv2d)


def _built(pipe, name):
    model = pipe.components[name].build()
    materialize(model)
    return model


def _densify(model):
    """Every quantized layer of `model` replaced, in place, by a plain one holding its decoded weight."""
    def swap(_, m):
        if isinstance(m, QUANTIZED):
            out = Conv2d(1, 1, 1)
            out.stride, out.padding, out.dilation, out.groups = m.stride, m.padding, m.dilation, m.groups
            out.weight = m.dense_weight()
            if "bias" in m:
                out.bias = m.bias
            else:
                del out["bias"]
            return out
        if isinstance(m, P.PalettizedLinear):
            out = nn.Linear(m.in_dims, m.weight.shape[0], bias="bias" in m)
            out.weight = m.dense_weight()
        elif isinstance(m, nn.QuantizedLinear):
            out = nn.Linear(m.weight.shape[1] * 32 // m.bits, m.weight.shape[0], bias="bias" in m)
            out.weight = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        else:
            return m
        if "bias" in m:
            out.bias = m.bias
        return out
    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return model


def resident_after_build(spec):
    """(the built, materialized model, MLX active bytes it added, its parameter bytes)."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model = spec.build()
    materialize(model)
    gc.collect()
    mx.clear_cache()
    return model, mx.get_active_memory() - before, parameter_nbytes(model)
