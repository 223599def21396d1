"""Palettized weights (Core ML's lookup-table compression): each weight is an n-bit index into a small table of
values, kept so in memory and decoded to float one layer at a time just before its matmul.

The form (formats/quantized.PalettizedWeight; in a model, PalettizedLinear's parameters of the same names):
- `weight` (PalettizedWeight.packed) uint8 [out, bytes per row]: each output row's n-bit indices (n in 1, 2, 3, 4,
  6, 8) as one little-endian bit string, index i at bits n*i .. n*i+n-1 (the low bits of a byte first, the order
  coremltools packs its indices in), padded with zero indices to a whole unit: 8 indices in 1 byte (n = 1), 4 in 1
  (2), 8 in 3 bytes (3), 2 in 1 (4), 4 in 3 (6), 1 in 1 (8). Bytes rather than uint32 words: 3- and 6-bit indices
  come in 3-byte units, which do not tile 32-bit words; bytes keep every row whole and contiguous (the row chunks
  of the decode and linear_rows slice rows), waste at most one unit per row, and are coremltools' own blob bytes.
- `lut` [groups, 2**n], in the weight's float dtype (as MLX's affine scales are): rows r*group_size ..
  (r+1)*group_size-1 read table r; one table per tensor is groups = 1 (coremltools' per-tensor and per-grouped-
  channel scalar palettes, with the grouped channels on the output axis).
- `scale` [out] or absent: a per-output-row factor (coremltools' iOS 18 per-channel scale).
- dense: w[r, c] = lut[r // group_size, idx[r, c]] * scale[r]; a conv's (or any N-d) weight is its [out, rest]
  flattening, in mlxdiff's layout.

Make one from plain arrays with `palettized(indices, lut, scale=None)` (indices: a uint array of the weight's shape;
lut: (groups, 2**n); scale: (out,)), e.g. from a Core ML blob's unpacked indices; `palettize(w, nbits, group_size)`
finds the tables by k-means (below). `decode` is the one definition of the dense weight, in MLX ops (shifts and masks
to unpack, a gather from the table); a fused kernel (gather inside the matmul) is not written yet.

k-means (`palettize`): per table, 1-D, on the float32 values of its rows, binned into a fine histogram (about 4 values
a bin, at most 65536 bins: the cost of a step is then independent of the weight's size, and a bin is far narrower
than the gaps between table values): centroids start at the quantiles of the density to the power 1/3 (the optimal
quantizer's point density), then ITERATIONS Lloyd steps (each centroid takes the bins nearest it and moves to the
exact mean of their values; an empty one stays). No randomness, and it runs on the CPU stream, whose scatter-adds
sum in order: the same weight gives the same tables and indices on any machine. The centroids are then rounded to
the weight's dtype and every value assigned to its exactly nearest rounded one. All lazy:
`loading/quantize.materialize` evaluates one layer at a time, so a model is palettized with about one layer's
float32 copies (a few) in flight.
"""

import copy
import math

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ..errors import MlxdiffError
from .quantized import UNITS, DecodingLinear, PalettizedWeight, decode, unpack  # noqa: F401 (decode, unpack: here too)

NBITS = (1, 2, 3, 4, 6, 8)
ITERATIONS = 16      # Lloyd steps (from the companded start, a few suffice: bench/palettize_quality.py)
MAX_BINS = 1 << 16   # the histogram k-means runs on: about 4 values a bin, INIT_BINS to MAX_BINS (a power of 2)
INIT_BINS = 1 << 10  # the coarser one its start is drawn from (a cube root of sparse counts would favour the tails)
TABLE_DTYPES = (mx.float16, mx.bfloat16, mx.float32)   # a checkpoint's tables and scales (float64: CPU-only in MLX)


def row_bytes(cols: int, nbits: int) -> int:
    """Bytes one packed row of `cols` indices takes."""
    per, nbytes = UNITS[nbits]
    return -(-cols // per) * nbytes


def pack(indices: mx.array, nbits: int) -> mx.array:
    """uint indices [rows, cols] (each < 2**nbits) -> uint8 [rows, row_bytes(cols, nbits)], lazily."""
    per, nbytes = UNITS[nbits]
    rows, cols = indices.shape
    idx = indices.astype(mx.uint32)
    if cols % per:
        idx = mx.concatenate([idx, mx.zeros((rows, per - cols % per), mx.uint32)], axis=1)
    shifts = mx.arange(0, nbits * per, nbits, dtype=mx.uint32)
    words = mx.sum(idx.reshape(rows, -1, per) << shifts, axis=-1)        # disjoint bits: the sum is their OR
    if nbytes == 1:
        return words.astype(mx.uint8)
    parts = (words[..., None] >> mx.arange(0, 8 * nbytes, 8, dtype=mx.uint32)) & 0xFF
    return parts.astype(mx.uint8).reshape(rows, -1)


def palettized(indices, lut, scale=None) -> PalettizedWeight:
    """A PalettizedWeight from plain arrays (numpy or MLX): `indices` uint of the weight's shape (output rows
    first), `lut` (groups, 2**nbits) whose groups divide the rows, `scale` (out,) or None. Checked in one line."""
    indices, lut = mx.array(indices), mx.array(lut)
    scale = None if scale is None else mx.array(scale)
    k = lut.shape[1] if lut.ndim == 2 else 0
    nbits = k.bit_length() - 1
    if lut.ndim != 2 or k != 1 << nbits or nbits not in NBITS or not mx.issubdtype(lut.dtype, mx.floating):
        raise MlxdiffError(f"palettized weight: lut of shape {tuple(lut.shape)} and {lut.dtype}; expected a float "
                           "table (groups, 2**nbits) with nbits one of " + ", ".join(map(str, NBITS)))
    if indices.ndim < 1 or not mx.issubdtype(indices.dtype, mx.integer):
        raise MlxdiffError(f"palettized weight: indices of shape {tuple(indices.shape)} and {indices.dtype}; "
                           "expected an integer array of the weight's shape")
    rows = indices.shape[0]
    if rows % lut.shape[0]:
        raise MlxdiffError(f"palettized weight: {lut.shape[0]} tables do not divide the {rows} output rows evenly")
    if scale is not None and tuple(scale.shape) != (rows,):
        raise MlxdiffError(f"palettized weight: scale of shape {tuple(scale.shape)}; expected ({rows},), one per "
                           "output row")
    if indices.size and (mx.min(indices).item() < 0 or mx.max(indices).item() >= k):
        raise MlxdiffError(f"palettized weight: indices outside 0..{k - 1} for a {nbits}-bit table")
    return PalettizedWeight(pack(indices.reshape(rows, -1), nbits), lut, scale, tuple(indices.shape))


# -- k-means -------------------------------------------------------------------------------------------------------

def _assign(x, centroids, nbits):
    """Index of the nearest of the sorted `centroids` [groups, k] for each value of `x` [groups, n] (int32): how many
    midpoints lie at or below it, by binary search (nbits gathers)."""
    mids = (centroids[:, :-1] + centroids[:, 1:]) / 2
    if nbits == 0:
        return mx.zeros(x.shape, mx.int32)
    idx = mx.zeros(x.shape, mx.int32)
    for s in reversed(range(nbits)):
        step = idx + (1 << s)
        idx = mx.where(mx.take_along_axis(mids, step - 1, axis=1) <= x, step, idx)
    return idx


def _histogram(x):
    """Each row of float32 `x` [groups, n] binned into `bins` equal bins between its min and max: (lo [groups, 1],
    bins per unit of value [groups, 1], bins, cumulative counts and float64 sums [groups, bins + 1], from 0)."""
    groups, n = x.shape
    bins = 1 << min(MAX_BINS.bit_length() - 1, max(INIT_BINS.bit_length() - 1, (n // 4).bit_length()))
    lo, hi = mx.min(x, axis=1, keepdims=True), mx.max(x, axis=1, keepdims=True)
    per_unit = mx.where(hi > lo, bins / mx.maximum(hi - lo, 1e-30), 0)
    slot = mx.clip(mx.floor((x - lo) * per_unit), 0, bins - 1).astype(mx.int32)
    slot = (slot + (mx.arange(groups, dtype=mx.int32) * bins)[:, None]).reshape(-1)
    counts = mx.zeros((groups * bins,), mx.float64).at[slot].add(1.0).reshape(groups, bins)
    sums = mx.zeros((groups * bins,), mx.float64).at[slot].add(x.reshape(-1).astype(mx.float64))
    zero = mx.zeros((groups, 1), mx.float64)
    return (lo, per_unit, bins, mx.concatenate([zero, mx.cumsum(counts, axis=1)], axis=1),
            mx.concatenate([zero, mx.cumsum(sums.reshape(groups, bins), axis=1)], axis=1))


def _companded_quantiles(lo, per_unit, bins, cum_counts, k):
    """The start of k-means: the (j + 1/2) / k quantiles of the values' density to the power 1/3 (a histogram of
    INIT_BINS bins, the fine one's bins summed), the point density
    of the optimal quantizer at many levels (Panter and Dite): plain quantiles crowd the middle, and Lloyd's steps
    take hundreds of iterations to move levels out to the tails."""
    groups = lo.shape[0]
    cum_counts = cum_counts[:, ::bins // INIT_BINS]
    per_unit, bins = per_unit * INIT_BINS / bins, INIT_BINS
    density = (cum_counts[:, 1:] - cum_counts[:, :-1]).astype(mx.float32) ** (1 / 3)
    density = density / mx.sum(density, axis=1, keepdims=True)
    cdf = mx.cumsum(density, axis=1)                              # at each bin's end
    target = mx.broadcast_to((mx.arange(k, dtype=mx.float32) + 0.5) / k, (groups, k))
    b = mx.minimum(_count_below(cdf, target), bins - 1)          # the bin where the cdf crosses each target
    mass = mx.take_along_axis(density, b, axis=1)
    frac = mx.clip((target - mx.take_along_axis(cdf, b, axis=1) + mass) / mx.maximum(mass, 1e-30), 0, 1)
    return lo + mx.where(per_unit > 0, (b.astype(mx.float32) + frac) / mx.where(per_unit > 0, per_unit, 1), 0)


def _count_below(sorted_rows, v):
    """How many values of each sorted row of `sorted_rows` [groups, n] are below each of `v` [groups, m] (int32),
    by binary search."""
    n = sorted_rows.shape[1]
    pos = mx.zeros(v.shape, mx.int32)
    for s in reversed(range(n.bit_length())):
        step = pos + (1 << s)
        below = mx.take_along_axis(sorted_rows, mx.minimum(step, n) - 1, axis=1) < v
        pos = mx.where((step <= n) & below, step, pos)
    return pos


def kmeans(x, nbits: int, iterations: int = ITERATIONS):
    """1-D k-means of each row of float32 `x` [groups, n] -> centroids [groups, 2**nbits], sorted, float32. Lloyd's
    steps run on a fine histogram of the values (about n / 4 bins, INIT_BINS to MAX_BINS): a centroid takes the bins whose
    centers lie nearest it, and its new value is the exact mean of their values (float64 prefix sums of the bins'
    sums), so a step costs a few operations on 2**nbits values, whatever the weight's size."""
    groups, n = x.shape
    k = 1 << nbits
    lo, per_unit, bins, cum_counts, cum_sums = _histogram(x)
    c = _companded_quantiles(lo, per_unit, bins, cum_counts, k)
    first, last = mx.zeros((groups, 1), mx.int32), mx.full((groups, 1), bins, mx.int32)
    for _ in range(iterations):
        cut = mx.clip(mx.floor(((c[:, :-1] + c[:, 1:]) / 2 - lo) * per_unit + 0.5), 0, bins).astype(mx.int32)
        bounds = mx.concatenate([first, cut, last], axis=1)
        counts = mx.take_along_axis(cum_counts, bounds[:, 1:], axis=1) - mx.take_along_axis(cum_counts, bounds[:, :-1],
                                                                                             axis=1)
        sums = mx.take_along_axis(cum_sums, bounds[:, 1:], axis=1) - mx.take_along_axis(cum_sums, bounds[:, :-1], axis=1)
        # an empty centroid stays; several in one bin can then cross, and the midpoints need them sorted
        c = mx.sort(mx.where(counts > 0, (sums / mx.maximum(counts, 1)).astype(mx.float32), c), axis=1)
    return c


def palettize(w, nbits: int, group_size: int | None = None, iterations: int = ITERATIONS, where="weight"):
    """A weight (rows first) -> PalettizedWeight: a k-means table of 2**nbits values per `group_size` output rows
    (None: one per tensor), in w's float dtype; lazy (module docstring). `where` names the weight in a refusal."""
    if nbits not in NBITS:
        raise MlxdiffError(f"{where}: {nbits}-bit palettization is not supported; use one of "
                           + ", ".join(map(str, NBITS)))
    rows = w.shape[0]
    gs = group_size or rows
    if rows % gs:
        raise MlxdiffError(f"{where}: group size {gs} does not divide its {rows} output rows; use a group size that "
                           "divides every quantized layer's rows, or one table per tensor (pN without :g)")
    dtype = w.dtype if mx.issubdtype(w.dtype, mx.floating) else mx.float32
    with mx.stream(mx.cpu):
        x = w.astype(mx.float32).reshape(rows // gs, -1)
        lut = kmeans(x, nbits, iterations).astype(dtype)
        idx = _assign(x, lut.astype(mx.float32), nbits)
        packed = pack(idx.reshape(rows, -1), nbits)
    return PalettizedWeight(packed, lut, None, tuple(w.shape))


# -- layers --------------------------------------------------------------------------------------------------------

class PalettizedLinear(DecodingLinear):
    """A linear layer whose weight stays palettized (`weight` uint8 packed indices [out, bytes per row], `lut`
    [groups, 2**nbits], maybe `scale` [out]), decoded just before its matmul, a chunk of rows at a time on the CPU
    (formats/quantized.chunked_matmul). `row_offset`: where its rows start in the weight its tables belong to (a
    row slice of a layer keeps the whole tables: linear_rows asks `rows`)."""

    def __init__(self, in_dims, out_dims, nbits, groups=1, scale=False, bias=False, dtype=mx.float32,
                 compute_dtype=None):
        super().__init__()
        if out_dims % groups:
            raise MlxdiffError(f"palettized layer: {groups} tables do not divide its {out_dims} output rows")
        self.in_dims, self.nbits, self.compute_dtype = in_dims, nbits, compute_dtype
        self.group_size, self.row_offset = out_dims // groups, 0
        self.weight = mx.zeros((out_dims, row_bytes(in_dims, nbits)), dtype=mx.uint8)
        self.lut = mx.zeros((groups, 1 << nbits), dtype=dtype)
        if scale:
            self.scale = mx.ones((out_dims,), dtype=dtype)
        if bias:
            self.bias = mx.zeros((out_dims,))
        self.freeze()

    @classmethod
    def of(cls, weight: PalettizedWeight, bias=None, compute_dtype=None) -> "PalettizedLinear":
        """The layer around a PalettizedWeight's own arrays (nothing is copied or evaluated)."""
        out_dims, in_dims = weight.shape[0], math.prod(weight.shape[1:])
        layer = cls(in_dims, out_dims, weight.nbits, weight.lut.shape[0], compute_dtype=compute_dtype)
        layer.weight, layer.lut = weight.packed, weight.lut
        if weight.scale is not None:
            layer.scale = weight.scale
        if bias is not None:
            layer.bias = bias
        return layer

    def _extra_repr(self):
        return (f"input_dims={self.in_dims}, output_dims={self.weight.shape[0]}, {self.nbits}-bit palette, "
                f"{self.lut.shape[0]} table(s) of {self.group_size} rows" + (", scale" if "scale" in self else ""))

    def decode(self, weight_rows, rows):
        scale = self.get("scale")
        return decode(weight_rows, self["lut"], None if scale is None else scale[rows], self.in_dims,
                      self.group_size, self.row_offset + (rows.start or 0))

    def dense_weight(self) -> mx.array:
        """The whole decoded weight [out, in] (for tests and tools; the layer itself decodes in chunks)."""
        return self.decode(self["weight"], slice(0, self["weight"].shape[0]))

    def rows(self, start, stop):
        """This layer restricted to output rows start:stop (linear_rows): the arrays of the rows, the whole tables."""
        view = copy.copy(self)
        for name in ("weight", "scale", "bias"):
            if name in self:
                view[name] = self[name][start:stop]
        view.row_offset = self.row_offset + start
        return view


def use_palettized_layers(model, layers: dict, compute_dtype=None) -> None:
    """Before loading: the Linear layers named in `layers` with {"palettize": nbits, "groups": tables, "scale":
    bool} (flatten_quantized's, or palettized_layers') become PalettizedLinear of those shapes, for load_weights
    to fill."""

    def swap(path, module):
        setting = layers.get(path)
        if not setting or "palettize" not in setting or not isinstance(module, nn.Linear):
            return module
        out_dims, in_dims = module.weight.shape
        check_row_bytes(path, setting, in_dims)
        return PalettizedLinear(in_dims, out_dims, setting["palettize"], setting.get("groups", 1),
                                setting.get("scale", False), "bias" in module, compute_dtype=compute_dtype)

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))


def palettized_layers(weights: dict) -> dict:
    """{layer path: {"palettize": nbits, "groups", "scale", "row_bytes"}} of the layers a flat weight dict holds
    palettized (those with `<layer>.lut`: flatten_quantized's output, or mlxdiff.convert's checkpoints), each
    layer's arrays checked from their shapes and dtypes (nothing read): a float table (groups, 2**nbits) with nbits
    one of NBITS, uint8 packed indices (rows, bytes) whose rows the tables divide, a scale (rows,). One line naming
    the tensor otherwise."""
    out = {}
    for name, lut in weights.items():
        if not name.endswith(".lut") or not hasattr(lut, "shape"):
            continue
        prefix = name[:-len(".lut")]
        k = lut.shape[1] if lut.ndim == 2 else 0
        nbits = k.bit_length() - 1
        if lut.ndim != 2 or k != 1 << nbits or nbits not in NBITS or lut.dtype not in TABLE_DTYPES:
            raise MlxdiffError(f"palettized checkpoint: {name} is a {_dtype(lut)} table of shape {tuple(lut.shape)}; "
                               "expected a float16 / bfloat16 / float32 table (groups, 2**nbits) with nbits one of "
                               + ", ".join(map(str, NBITS)) + "; the file is damaged, convert it again")
        packed = weights.get(f"{prefix}.weight")
        if packed is None or not hasattr(packed, "shape") or packed.ndim != 2 or packed.dtype != mx.uint8:
            shown = "missing" if packed is None else f"{_dtype(packed)} of shape {tuple(getattr(packed, 'shape', ()))}"
            raise MlxdiffError(f"palettized checkpoint: {prefix}.weight is {shown}; beside its table {name} it must "
                               "be the uint8 packed indices (rows, bytes per row); the file is damaged, convert it "
                               "again")
        rows = packed.shape[0]
        if rows % lut.shape[0]:
            raise MlxdiffError(f"palettized checkpoint: {name} holds {lut.shape[0]} tables, which do not divide the "
                               f"{rows} rows of {prefix}.weight; the file is damaged, convert it again")
        scale = weights.get(f"{prefix}.scale")
        if scale is not None and (not hasattr(scale, "shape") or tuple(scale.shape) != (rows,)
                                  or scale.dtype not in TABLE_DTYPES):
            raise MlxdiffError(f"palettized checkpoint: {prefix}.scale is {_dtype(scale)} of shape "
                               f"{tuple(getattr(scale, 'shape', ()))}; expected a float ({rows},), one per row of "
                               f"{prefix}.weight")
        out[prefix] = {"palettize": nbits, "groups": lut.shape[0], "scale": scale is not None,
                       "row_bytes": packed.shape[1]}
    return out


def _dtype(a) -> str:
    return str(getattr(a, "dtype", type(a).__name__)).rpartition(".")[2]


def check_row_bytes(path, setting, cols) -> None:
    """A palettized checkpoint's layer at `path`, of `cols` inputs: its packed rows hold the bytes its table's index
    width needs (a table shorter than the indices would leave indices with no entry). No-op for settings without
    the stored row width (a GGUF or Core ML weight, packed here)."""
    have = setting.get("row_bytes")
    nbits = setting["palettize"]
    if have is None or have == row_bytes(cols, nbits):
        return
    fits = [b for b in NBITS if row_bytes(cols, b) == have]
    why = (f"its indices are {fits[0]}-bit (a table of {1 << fits[0]} entries)" if fits else
           "that fits no index width")
    raise MlxdiffError(f"palettized checkpoint: {path}.lut has {1 << nbits} entries ({nbits}-bit indices, "
                       f"{row_bytes(cols, nbits)} bytes a row of {cols}) but {path}.weight packs {have} bytes a row: "
                       f"{why}; the table and its indices do not belong together, convert the file again")
