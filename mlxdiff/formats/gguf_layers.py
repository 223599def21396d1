"""Layers that keep a GGUF tensor as the file's own blocks, decoded exactly (gguf_blocks.decode_rows) per use:
RawLinear (a chunk of rows at a time before its matmul) and RawEmbedding (only the looked-up rows)."""

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .gguf_blocks import decode_rows
from .gguf_header import BLOCKS
from .quantized import DecodingEmbedding, DecodingLinear


class RawLinear(DecodingLinear):
    """A linear layer whose weight is kept as the file's GGUF blocks (`weight` uint8 [out, bytes per row]), decoded
    exactly (decode_rows) just before its matmul, a chunk of rows at a time on the CPU (formats/quantized.py)."""

    def __init__(self, in_dims, out_dims, type_name, bias=False, compute_dtype=None):
        super().__init__()
        block, block_bytes = BLOCKS[type_name]
        self.type_name, self.in_dims, self.compute_dtype = type_name, in_dims, compute_dtype
        self.weight = mx.zeros((out_dims, in_dims // block * block_bytes), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((out_dims,))
        self.freeze()

    def _extra_repr(self):
        return f"input_dims={self.in_dims}, output_dims={self.weight.shape[0]}, {self.type_name} blocks"

    def decode(self, weight_rows, rows):
        return decode_rows(weight_rows, self.type_name)

    def column_unit(self) -> tuple:
        """(values, bytes) of one block along a row: where a tensor-parallel split may cut its columns
        (models/sharding.py)."""
        return BLOCKS[self.type_name]


class RawEmbedding(DecodingEmbedding):
    """An embedding whose table is kept as the file's GGUF blocks (`weight` uint8 [vocab, bytes per row]): only the
    looked-up rows are decoded (exactly, decode_rows), so the table stays at the file's size."""

    def __init__(self, vocab, dims, type_name, compute_dtype=None):
        super().__init__()
        block, block_bytes = BLOCKS[type_name]
        self.type_name, self.dims, self.compute_dtype = type_name, dims, compute_dtype
        self.weight = mx.zeros((vocab, dims // block * block_bytes), dtype=mx.uint8)
        self.freeze()

    def _extra_repr(self):
        return f"{self.weight.shape[0]}, {self.dims}, {self.type_name} blocks"

    def decode(self, weight_rows, rows):
        return decode_rows(weight_rows, self.type_name)


def use_raw_layers(model, layers: dict, compute_dtype=None) -> None:
    """Replace the Linear layers named in `layers` ({path: {"raw": GGUF type}}) by RawLinear and the Embedding
    layers by RawEmbedding, before loading."""
    def swap(path, module):
        setting = layers.get(path)
        if not setting or "raw" not in setting or not isinstance(module, (nn.Linear, nn.Embedding)):
            return module
        if isinstance(module, nn.Embedding):
            vocab, dims = module.weight.shape
            return RawEmbedding(vocab, dims, setting["raw"], compute_dtype)
        out_dims, in_dims = module.weight.shape
        return RawLinear(in_dims, out_dims, setting["raw"], "bias" in module, compute_dtype)

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
