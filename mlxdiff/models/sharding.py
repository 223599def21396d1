"""Tensor-parallel layers (what each architecture's `Model.shard(group)` uses; mlxdiff/distributed.py says how a
run splits): one linear layer as mlx.nn's sharded twin, a row-split layer whose outputs are gathered back, and the
one-line refusal of counts or layers the ranks cannot split."""

import copy

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxdiffError


def _refuse(where, why):
    return MlxdiffError(f"tensor-parallel split: layer {where} {why}")


def shard_layer(layer, sharding: str, group, where: str, boundaries=()):
    """`layer` as mlx.nn's sharded layer of the same kind (AllToShardedLinear / ShardedToAllLinear, or their
    Quantized* twins for a quantized layer), through mlx's own `shard_linear`. `sharding`: "all-to-sharded" (output
    rows split: q, k, v, a feed-forward's input) or "sharded-to-all" (input columns split, then one all_sum: the
    attention and feed-forward outputs). `boundaries`: offsets (in output rows, or input columns) of the parts a
    fused layer is made of ([gate; value], [q; k; v; gate; up], [attention | mlp]): each part is split over the
    ranks on its own. A GGUF file's raw blocks and float8 codes keep their form, split on their blocks
    (_shard_decoding). Layers whose stored form cannot be split so (palettized tables, a LoRA around a layer) are
    refused in one line naming the layer."""
    n = group.size()
    kind = type(layer).__name__
    if hasattr(layer, "column_unit"):     # a GGUF file's raw blocks, float8 codes: split on block boundaries
        return _shard_decoding(layer, sharding, group, where, boundaries)
    if type(layer) is not nn.Linear and not isinstance(layer, nn.QuantizedLinear):
        advice = {"PalettizedLinear": "is palettized, which is not split yet; use --split guidance"}
        raise _refuse(where, advice.get(kind, f"is a {kind}, which cannot be split; use --split guidance"))
    rows = sharding == "all-to-sharded"
    quantized = isinstance(layer, nn.QuantizedLinear)
    out_dims = layer.weight.shape[0]
    in_dims = layer.weight.shape[1] * 32 // layer.bits if quantized else layer.weight.shape[1]
    width = out_dims if rows else in_dims
    edges = [0, *boundaries, width]
    parts = [b - a for a, b in zip(edges, edges[1:])]
    unit = layer.group_size * n if quantized and not rows else n
    if any(p % unit for p in parts):
        what = "output rows" if rows else "input columns"
        need = f"{n} ranks" + (f" x its group size {layer.group_size}" if unit != n else "")
        raise _refuse(where, f"has {what} in parts of {parts}, which {need} do not divide; start a number of ranks "
                             "that does, or use --split guidance")
    if not boundaries:
        segments = 1
    elif rows or not quantized:
        segments = list(boundaries)      # mx.split indices, in the layer's own (unpacked) rows or columns
    else:
        # a quantized layer's columns are packed (weight) and grouped (scales, biases): mlx splits them at the same
        # fractions of each array's width; each must land exactly on a part's edge
        segments = [b / width for b in boundaries]
        for array in (layer.weight, layer.scales):
            w = array.shape[-1]
            if any(int(s * w) * width != b * w for s, b in zip(segments, boundaries)):
                raise _refuse(where, "has parts that its packed columns cannot be split at; use --split guidance")
    return nn.layers.distributed.shard_linear(layer, sharding, segments=segments, group=group)


def _rank_parts(edges, n, rank) -> list:
    """(start, stop) of this rank's share of each part between consecutive edges."""
    return [(a + (b - a) // n * rank, a + (b - a) // n * (rank + 1)) for a, b in zip(edges, edges[1:])]


def _shard_decoding(layer, sharding, group, where, boundaries):
    """A layer that keeps its file's compact form (formats/quantized.DecodingLinear with `column_unit()`: GGUF raw
    blocks, float8 codes with row scales) split as mlx.nn's sharded layers split theirs, its form kept: output rows
    (every array has them first), or input columns cut on the form's block boundaries (`column_unit()`: values and
    bytes per block), whose partial products are summed over the ranks before the bias (SummedLinear)."""
    n, rank = group.size(), group.rank()
    rows = sharding == "all-to-sharded"
    values, nbytes = layer.column_unit()
    width = layer.weight.shape[0] if rows else layer.in_dims
    edges = [0, *boundaries, width]
    parts = [b - a for a, b in zip(edges, edges[1:])]
    unit = n if rows else values * n
    if any(p % unit for p in parts):
        what = "output rows" if rows else "input columns"
        need = f"{n} ranks" + (f" x its block of {values} values" if unit != n else "")
        raise _refuse(where, f"has {what} in parts of {parts}, which {need} do not divide; start a number of ranks "
                             "that does, or use --split guidance")
    share = copy.copy(layer)
    if rows:
        for name, value in layer.items():
            if isinstance(value, mx.array):
                share[name] = mx.concatenate([value[a:b] for a, b in _rank_parts(edges, n, rank)])
        return share
    weight = layer["weight"]
    share["weight"] = mx.concatenate([weight[:, a // values * nbytes:b // values * nbytes]
                                      for a, b in _rank_parts(edges, n, rank)], axis=1)
    share.in_dims = layer.in_dims // n
    bias = layer["bias"] if "bias" in layer else None
    if bias is not None:
        del share["bias"]
    return SummedLinear(share, bias, group)


class SummedLinear(nn.Module):
    """A layer split by input columns whose partial products are summed over the ranks, then the bias added once
    (as mlx.nn's ShardedToAllLinear), for layers that keep a compact form (_shard_decoding)."""

    def __init__(self, layer, bias, group):
        super().__init__()
        self.layer, self.group = layer, group
        if bias is not None:
            self.bias = bias

    def __call__(self, x):
        y = mx.distributed.all_sum(self.layer(x), group=self.group)
        return y + self["bias"] if "bias" in self else y


class GatheredLinear(nn.Module):
    """A linear layer split by output rows over the ranks (mlx's AllToShardedLinear, or its quantized twin), whose
    output slices are gathered back, so every rank has the whole output (exact: no sum). For the modulation linears,
    whose outputs are small (batch, k x width) vectors and whose weights are not: one all_gather each."""

    def __init__(self, layer, group, where: str):
        super().__init__()
        self.layer = shard_layer(layer, "all-to-sharded", group, where)
        self.group = group

    def __call__(self, x):
        return gather_last(self.layer(x), self.group)


def gather_last(x, group):
    """(..., F / N) on each of N ranks -> (..., F): the ranks' slices side by side, in rank order."""
    n = group.size()
    both = mx.distributed.all_gather(x.reshape(1, -1), group=group)     # (N, prod(x.shape))
    return mx.moveaxis(both.reshape(n, *x.shape), 0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def divides_all(counts: dict, n: int) -> bool:
    """Whether n ranks split every count of {name: (count, unit)} evenly (an encoder's shards_evenly)."""
    return all(count % n == 0 for count, _ in counts.values())


def check_counts(what: str, counts: dict, n: int) -> None:
    """check_divides for every count of {name: (count, unit)}, named "<what>: <name>" (an encoder's
    check_shardable)."""
    for name, (count, unit) in counts.items():
        check_divides(f"{what}: {name}", count, n, unit)


def check_divides(what: str, count: int, n: int, unit: str = "") -> None:
    """A count (heads, a hidden width) the N ranks must split evenly, else one line."""
    if count % n:
        raise MlxdiffError(f"{what}: {count}{unit} do not split over {n} ranks; start a number of ranks that divides "
                           f"{count}, or use --split guidance")
