"""Weights kept quantized below the models, in three forms, and how a layer multiplies through them:

- QuantizedTensor: an MLX affine triplet (weight codes, scales, biases), the arrays of an nn.QuantizedLinear;
- RawBlocks: a file's own blocks (GGUF's Q2_K, Q3_K, Q6_K, which have no exact affine form at their size), held at
  the file's size and decoded to float one layer at a time just before its matmul (formats/gguf.py RawLinear);
- Float8Weight: a safetensors file's float8 e4m3fn weight (ComfyUI's scaled fp8 and comfy_quant layouts, or plain
  fp8) with its scale, held at 8 bits and decoded the same way (formats/fp8.py Fp8Linear);
- PalettizedWeight: n-bit indices into a lookup table per tensor or per group of output rows (Core ML's
  palettization), held packed and decoded the same way (formats/palettized.py PalettizedLinear).

Key maps split and join both along their rows (a fused qkv into q, k, v) without decoding. `flatten_quantized`
turns them into layer arrays and says which layers to make quantized before strict loading; `chunked_matmul` is
the per-layer decode-then-matmul that DequantizedLinear and RawLinear share.
"""

import copy
import functools
import math
from dataclasses import dataclass
from typing import Callable

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxdiffError
from .. import pacing
from ..policy import cuda_kernels

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
        w = affine_dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)
        return w.astype(dtype) if dtype is not None else w

    def arrays(self, prefix) -> dict:
        """{prefix.weight, prefix.scales, prefix.biases}: the parameters of the quantized layer at `prefix`."""
        return {f"{prefix}.weight": self.weight, f"{prefix}.scales": self.scales, f"{prefix}.biases": self.biases}


@dataclass
class RawBlocks:
    """A weight kept as the file's quantized blocks: `blocks` uint8 [rows, bytes per row], of GGUF type
    `type_name`; `shape` is the logical PyTorch shape; `decode(blocks, type_name)` -> float32 rows (the reader's
    own exact decoder, formats/gguf.decode_rows)."""
    blocks: mx.array
    type_name: str
    shape: tuple
    decode: Callable

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self, dtype=None) -> mx.array:
        w = self.decode(self.blocks, self.type_name).reshape(self.shape)
        return w.astype(dtype) if dtype is not None else w


@dataclass
class Float8Weight:
    """A float8 e4m3fn weight: `codes` uint8 [rows, cols] (the file's bytes), `scale` float32 [rows] (one per row:
    ComfyUI's per-tensor scale repeated, or a per-channel one); w = float32(code) * scale (formats/fp8.decode)."""
    codes: mx.array
    scale: mx.array

    @property
    def shape(self):
        return tuple(self.codes.shape)

    @property
    def ndim(self):
        return self.codes.ndim

    @property
    def dtype(self):
        """bfloat16, which holds every float8 e4m3fn value exactly: for code that only asks an array's float type
        (e.g. clip.identity_projection, an identity matrix in the token embedding's dtype)."""
        return mx.bfloat16

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def dequantize(self, dtype=None) -> mx.array:
        w = mx.from_fp8(self.codes, dtype=mx.float32) * self.scale[:, None]
        return w.astype(dtype) if dtype is not None else w


# -- palettized rows: the bit layout (formats/palettized.py makes and packs them; decoding lives with the type) ------

UNITS = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1), 6: (4, 3), 8: (1, 1)}   # nbits: (indices, bytes) per unit


def unpack(packed: mx.array, nbits: int, cols: int) -> mx.array:
    """Inverse of pack: uint8 [rows, row bytes] -> uint32 indices [rows, cols]."""
    per, nbytes = UNITS[nbits]
    rows = packed.shape[0]
    if nbits == 8:
        return packed.astype(mx.uint32)
    units = packed.reshape(rows, -1, nbytes).astype(mx.uint32)
    words = units[..., 0]
    for j in range(1, nbytes):
        words = words | (units[..., j] << (8 * j))
    shifts = mx.arange(0, nbits * per, nbits, dtype=mx.uint32)
    idx = ((words[..., None] >> shifts) & ((1 << nbits) - 1)).reshape(rows, -1)
    return idx if idx.shape[1] == cols else idx[:, :cols]


def decode(packed, lut, scale, cols: int, group_size: int, first_row: int = 0) -> mx.array:
    """The dense rows [rows, cols] (lut's dtype) of packed rows whose first is row `first_row` of the weight (its
    group's table); `scale`: those rows' scales, or None. On CUDA one kernel (below) does it; these MLX ops are the
    reference path and every other backend's."""
    if cuda_kernels() and packed.shape[0] and lut.dtype in (mx.bfloat16, mx.float16, mx.float32):
        return _decode_on_cuda(packed, lut, scale, cols, group_size, first_row)
    idx = unpack(packed, lut.shape[1].bit_length() - 1, cols)
    if lut.shape[0] == 1:
        w = mx.take(lut[0], idx)
    else:
        rows = packed.shape[0]
        group = mx.arange(first_row, first_row + rows, dtype=mx.uint32) // group_size
        w = mx.take(lut.reshape(-1), idx + (group * lut.shape[1])[:, None])
    return w if scale is None else w * scale[:, None].astype(w.dtype)


# One thread per packed unit (UNITS: PER indices in NBYTES bytes), each index looked up in its row's table and times
# the row's scale in float, rounded once to T (the product of two T values is exact in float, so this equals MLX's
# multiply in T). Replaces unpack's eight-odd ops and their [rows, cols] uint32 transients with one pass that
# writes only the output (timing: bench/RESULTS.md, "Palettized weights").
_DECODE_SOURCE = """
    // dims: rows, cols, bytes per row, group size, first row (runtime, so one kernel serves every layer shape)
    const long rows = dims[0], cols = dims[1], row_bytes = dims[2], group_size = dims[3], first_row = dims[4];
    const long units_per_row = (cols + PER - 1) / PER;
    const long unit = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= rows * units_per_row) return;
    const long row = unit / units_per_row;
    const long first_col = (unit % units_per_row) * PER;
    const uint8_t* src = packed + row * row_bytes + (unit % units_per_row) * NBYTES;
    uint32_t word = 0;
    for (int j = 0; j < NBYTES; j++) word |= static_cast<uint32_t>(src[j]) << (8 * j);
    const T* table = lut + (ONE_TABLE ? 0 : (first_row + row) / group_size) * (1 << NBITS);
    const float row_scale = HAS_SCALE ? static_cast<float>(scale[row]) : 1.0f;
    T* dst = out + row * cols + first_col;
    for (int j = 0; j < PER && first_col + j < cols; j++) {
        const T v = table[(word >> (j * NBITS)) & ((1u << NBITS) - 1u)];
        dst[j] = HAS_SCALE ? static_cast<T>(static_cast<float>(v) * row_scale) : v;
    }
"""


@functools.cache
def _decode_kernel():
    return mx.fast.cuda_kernel(name="mlxdiff_palettized_decode",
                               input_names=["packed", "lut", "scale", "dims"], output_names=["out"],
                               source=_DECODE_SOURCE)


@functools.lru_cache(maxsize=1024)
def _dims_array(*dims):
    """The kernel's dims input, made once per layer shape (not a new device array per call)."""
    return mx.array(dims, mx.int32)


def _decode_on_cuda(packed, lut, scale, cols, group_size, first_row):
    nbits = lut.shape[1].bit_length() - 1
    per, nbytes = UNITS[nbits]
    rows = packed.shape[0]
    dims = _dims_array(rows, cols, packed.shape[1], group_size, first_row)
    return _decode_kernel()(
        inputs=[packed, lut, lut if scale is None else scale.astype(lut.dtype), dims],
        template=[("T", lut.dtype), ("NBITS", nbits), ("PER", per), ("NBYTES", nbytes),
                  ("ONE_TABLE", lut.shape[0] == 1), ("HAS_SCALE", scale is not None)],
        grid=(rows * -(-cols // per), 1, 1), threadgroup=(256, 1, 1), output_shapes=[(rows, cols)],
        output_dtypes=[lut.dtype])[0]


# -- affine dequantize on CUDA ----------------------------------------------------------------------------------------
#
# Why: MLX 0.32.4's CUDA dequantize runs one thread per byte (two 4-bit values, a 4-byte store each) and moves about
# 1.1 TB/s on the H200; FLUX.2-dev's dequantize-then-matmul strategy pays it on every layer of every step. Here one
# thread takes a whole packed unit (8 values of 4 or 5 bits, 16 of 2, 4 of 6 or 8) and writes them with 16-byte
# stores: about twice as fast (bench/RESULTS.md, "Speed, second round"). Each value is computed as MLX's kernel
# computes it, `scale * T(q) + bias` in the scales' type T, so the output is the same bit for bit (checked on the
# GPU for every bit width, dtype and group size: bench/step_kernels_gpu.py exact).

AFFINE_UNITS = {2: (16, 4), 3: (8, 3), 4: (8, 4), 5: (8, 5), 6: (4, 3), 8: (4, 4)}   # bits: (values, bytes) per unit

_AFFINE_SOURCE = """
    // dims: rows, columns (values per row), bytes per packed row, group size (runtime: one kernel per form)
    const long rows = dims[0], cols = dims[1], row_bytes = dims[2], group_size = dims[3];
    const long units_per_row = cols / PER;
    const long unit = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= rows * units_per_row) return;
    const long row = unit / units_per_row;
    const long first_col = (unit % units_per_row) * PER;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(packed) + row * row_bytes + (unit % units_per_row) * NBYTES;
    uint64_t word = 0;
    if (NBYTES == 4) {
        word = *reinterpret_cast<const uint32_t*>(src);
    } else {
        for (int j = 0; j < NBYTES; j++) word |= static_cast<uint64_t>(src[j]) << (8 * j);
    }
    const long g = row * (cols / group_size) + first_col / group_size;
    const T s = scales[g];
    const T b = biases[g];
    constexpr int CHUNK = 16 / sizeof(T);          // values per 16-byte store
    constexpr int STORES = (PER * sizeof(T)) / 16;
    T* dst = out + row * cols + first_col;
    if (STORES > 0) {
        for (int c = 0; c < STORES; c++) {
            uint4 packed_out;
            T* v = reinterpret_cast<T*>(&packed_out);
            for (int j = 0; j < CHUNK; j++) {
                const int i = c * CHUNK + j;
                v[j] = s * static_cast<T>(static_cast<uint32_t>((word >> (i * BITS)) & ((1u << BITS) - 1u))) + b;
            }
            *reinterpret_cast<uint4*>(dst + c * CHUNK) = packed_out;
        }
    } else {
        for (int i = 0; i < PER; i++)
            dst[i] = s * static_cast<T>(static_cast<uint32_t>((word >> (i * BITS)) & ((1u << BITS) - 1u))) + b;
    }
"""


@functools.cache
def _affine_kernel():
    return mx.fast.cuda_kernel(name="mlxdiff_affine_dequantize",
                               input_names=["packed", "scales", "biases", "dims"], output_names=["out"],
                               source=_AFFINE_SOURCE)


def affine_dequantize(weight, scales, biases, group_size: int, bits: int) -> mx.array:
    """mx.dequantize(weight, scales, biases, group_size, bits) of a 2-D affine weight. On CUDA one kernel (above)
    does it, equal bit for bit; MLX's own op is the reference path and every other backend's."""
    per, nbytes = AFFINE_UNITS.get(bits, (0, 0))
    if not (per and cuda_kernels() and weight.ndim == 2 and biases is not None and weight.shape[0]
            and scales.dtype in (mx.bfloat16, mx.float16, mx.float32) and group_size % per == 0):
        return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    rows = weight.shape[0]
    cols = weight.shape[1] * 32 // bits
    return _affine_kernel()(
        inputs=[weight, scales, biases.astype(scales.dtype), _dims_array(rows, cols, weight.shape[1] * 4, group_size)],
        template=[("T", scales.dtype), ("BITS", bits), ("PER", per), ("NBYTES", nbytes)],
        grid=(rows * (cols // per), 1, 1), threadgroup=(256, 1, 1), output_shapes=[(rows, cols)],
        output_dtypes=[scales.dtype])[0]


@dataclass
class PalettizedWeight:
    """A palettized weight (formats/palettized.py says the layout): `packed` uint8 [out, bytes per row], each row's
    n-bit indices; `lut` [groups, 2**nbits], rows r*group_size .. (r+1)*group_size-1 reading table r; `scale`
    [out] or None; `shape` the logical PyTorch shape. w[r] = lut[r // group_size][idx[r]] (* scale[r])."""
    packed: mx.array
    lut: mx.array
    scale: mx.array | None
    shape: tuple

    @property
    def nbits(self) -> int:
        return self.lut.shape[1].bit_length() - 1

    @property
    def group_size(self) -> int:
        return self.shape[0] // self.lut.shape[0]

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.lut.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def dequantize(self, dtype=None) -> mx.array:
        w = decode(self.packed, self.lut, self.scale, math.prod(self.shape[1:]), self.group_size).reshape(self.shape)
        return w.astype(dtype) if dtype is not None else w

    def arrays(self, prefix) -> dict:
        """{prefix.weight: packed, prefix.lut[, prefix.scale]}: the parameters of the PalettizedLinear at `prefix`."""
        out = {f"{prefix}.weight": self.packed, f"{prefix}.lut": self.lut}
        if self.scale is not None:
            out[f"{prefix}.scale"] = self.scale
        return out

    def rows(self, start, stop) -> "PalettizedWeight":
        """Rows start:stop, still palettized: the tables of the groups they cover (whole groups, or any rows of a
        tensor with one table)."""
        gs = self.group_size
        if self.lut.shape[0] == 1:
            lut = self.lut
        elif start % gs == 0 and stop % gs == 0:
            lut = self.lut[start // gs: stop // gs]
        else:
            raise MlxdiffError(f"cannot take rows {start}:{stop} of a palettized weight of shape {self.shape}: they "
                               f"cut a group of {gs} rows that share a table")
        return PalettizedWeight(self.packed[start:stop], lut, None if self.scale is None else self.scale[start:stop],
                                (stop - start, *self.shape[1:]))


FORMS = (QuantizedTensor, RawBlocks, Float8Weight, PalettizedWeight)


def split_rows(tensor, n: int) -> list:
    """Split a weight into `n` equal parts along its rows (axis 0), e.g. a fused qkv into q, k, v.

    Quantized forms are split while still quantized (rows of weight, scales and biases, or of blocks); an array
    with mx.split.
    """
    if isinstance(tensor, PalettizedWeight):
        if tensor.shape[0] % n:
            raise MlxdiffError(f"cannot split a palettized weight of shape {tensor.shape} into {n} equal row blocks")
        step = tensor.shape[0] // n
        return [tensor.rows(i * step, (i + 1) * step) for i in range(n)]
    if isinstance(tensor, Float8Weight):
        if tensor.shape[0] % n:
            raise MlxdiffError(f"cannot split a float8 weight of shape {tensor.shape} into {n} equal row blocks")
        return [Float8Weight(c, s) for c, s in zip(mx.split(tensor.codes, n), mx.split(tensor.scale, n))]
    if isinstance(tensor, RawBlocks):
        rows = tensor.shape[0]
        if rows % n:
            raise MlxdiffError(f"cannot split a quantized weight of shape {tensor.shape} into {n} equal row blocks")
        return [RawBlocks(b, tensor.type_name, (rows // n, *tensor.shape[1:]), tensor.decode)
                for b in mx.split(tensor.blocks, n)]
    if not isinstance(tensor, QuantizedTensor):
        return mx.split(tensor, n, axis=0)
    rows = tensor.weight.shape[0]
    if tensor.weight.ndim < 2 or rows % n:
        raise MlxdiffError(f"cannot split a quantized weight of shape {tensor.shape} into {n} equal row blocks")
    return [QuantizedTensor(w, s, b, tensor.bits, tensor.group_size, tensor.source_type)
            for w, s, b in zip(*(mx.split(a, n, axis=0) for a in (tensor.weight, tensor.scales, tensor.biases)))]


def concat_rows(parts: list):
    """Inverse of split_rows (e.g. to reorder row blocks). Quantized parts must share their form and settings."""
    if all(isinstance(p, Float8Weight) for p in parts):
        return Float8Weight(mx.concatenate([p.codes for p in parts]), mx.concatenate([p.scale for p in parts]))
    if all(isinstance(p, PalettizedWeight) for p in parts) and len({(p.nbits, p.shape[1:]) for p in parts}) == 1:
        return _concat_palettized(parts)
    if all(isinstance(p, RawBlocks) for p in parts) and len({p.type_name for p in parts}) == 1:
        return RawBlocks(mx.concatenate([p.blocks for p in parts]), parts[0].type_name,
                         (sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].decode)
    if not all(isinstance(p, QuantizedTensor) for p in parts):
        return mx.concatenate([p.dequantize() if isinstance(p, FORMS) else p for p in parts],
                              axis=0)
    settings = {(p.bits, p.group_size) for p in parts}
    if len(settings) != 1:
        raise MlxdiffError(f"cannot join quantized weights with different settings {sorted(settings)}")
    return QuantizedTensor(*(mx.concatenate([getattr(p, a) for p in parts], axis=0)
                             for a in ("weight", "scales", "biases")), parts[0].bits, parts[0].group_size,
                           parts[0].source_type)


def _concat_palettized(parts):
    """Palettized parts joined along their rows: tables repeated to the parts' common group size (the gcd of theirs),
    scales of ones for a part without."""
    gs = math.gcd(*(p.group_size for p in parts))
    luts = [mx.repeat(p.lut, p.group_size // gs, axis=0) if p.group_size != gs else p.lut for p in parts]
    scaled = any(p.scale is not None for p in parts)
    scale = mx.concatenate([p.scale if p.scale is not None else mx.ones((p.shape[0],), p.lut.dtype)
                            for p in parts]) if scaled else None
    return PalettizedWeight(mx.concatenate([p.packed for p in parts]), mx.concatenate(luts), scale,
                            (sum(p.shape[0] for p in parts), *parts[0].shape[1:]))


def flatten_quantized(weights: dict):
    """{name: array | QuantizedTensor | RawBlocks | Float8Weight} -> (flat {name: array}, {layer path: setting}).

    A quantized "<layer>.weight" becomes "<layer>.weight" / ".scales" / ".biases" with setting {"bits",
    "group_size"} (use `nn.quantize(model, class_predicate=quantized_predicate(layers))` before `load_weights`),
    or, for RawBlocks, "<layer>.weight" = the blocks with setting {"raw": GGUF type} (formats/gguf.use_raw_layers),
    or, for Float8Weight, "<layer>.weight" = the codes and "<layer>.weight_scale" = the row scales with setting
    {"fp8": "float8_e4m3fn"} (formats/fp8.use_fp8_layers), or, for PalettizedWeight, "<layer>.weight" = the packed
    indices, "<layer>.lut" and maybe "<layer>.scale" with setting {"palettize": nbits, "groups", "scale"}
    (formats/palettized.use_palettized_layers).
    """
    flat, layers = {}, {}
    for name, value in weights.items():
        if not isinstance(value, FORMS):
            flat[name] = value
            continue
        if not name.endswith(".weight"):
            raise MlxdiffError(f"quantized tensor {name!r} is not a layer weight (no '.weight' suffix); only "
                               "Linear and Embedding weights can stay quantized")
        prefix = name[: -len(".weight")]
        if isinstance(value, Float8Weight):
            flat[name], flat[f"{prefix}.weight_scale"] = value.codes, value.scale
            layers[prefix] = {"fp8": "float8_e4m3fn"}
        elif isinstance(value, RawBlocks):
            flat[name] = value.blocks
            layers[prefix] = {"raw": value.type_name}
        elif isinstance(value, PalettizedWeight):
            flat.update(value.arrays(prefix))
            layers[prefix] = {"palettize": value.nbits, "groups": value.lut.shape[0], "scale": value.scale is not None}
        else:
            flat.update(value.arrays(prefix))
            layers[prefix] = value.quantization
    return flat, layers


def quantized_predicate(layers: dict):
    """class_predicate for nn.quantize: per-layer {"bits", "group_size"} for the layers stored in affine form."""
    def predicate(path, module):
        setting = layers.get(path, False)
        if not hasattr(module, "to_quantized") or not setting or {"raw", "fp8", "palettize"} & set(setting):
            return False
        return setting
    return predicate


# -- a linear layer of any form: its widths, a slice of its output rows --------------------------------------------

def linear_dims(module):
    """(input width, output width) of a linear layer of any kind mlxdiff builds (plain, quantized, dequantizing,
    GGUF-raw, fp8, palettized, or a wrapper around one such as lora/layers.py's LoRALinear), or None if it is not one."""
    base = module.get("base")
    if isinstance(base, nn.Module):                         # a wrapper (LoRALinear): its base layer's
        return linear_dims(base)
    if isinstance(module, nn.Conv2d):                       # a convolution, quantized ones included (their codes
        return None                                         # are 2-D rows too: loading/quantize.QuantizedConv2d)
    if isinstance(module, nn.Linear):
        out_dims, in_dims = module["weight"].shape
        return in_dims, out_dims
    if not isinstance(module.get("weight"), mx.array) or module["weight"].ndim != 2:
        return None
    if hasattr(module, "bits") and "scales" in module:     # nn.QuantizedLinear, DequantizedLinear
        return module["weight"].shape[1] * 32 // module.bits, module["weight"].shape[0]
    in_dims = getattr(module, "in_dims", None)     # RawLinear (GGUF blocks), Fp8Linear, PalettizedLinear
    return (in_dims, module["weight"].shape[0]) if isinstance(in_dims, int) else None


def linear_rows(layer, start, stop):
    """The same linear layer (plain, quantized, dequantizing, GGUF-raw or fp8) restricted to output rows
    start:stop: every array of it sliced along its first axis (rows of weight, scales, biases, bias); nothing is
    copied. A layer that knows its own rows (a LoRA around a base, mlxdiff/lora/layers.py) is asked for them."""
    if hasattr(layer, "rows"):
        return layer.rows(start, stop)
    view = copy.copy(layer)
    for name, value in layer.items():
        if isinstance(value, mx.array):
            view[name] = value[start:stop]
    return view


# -- decode-then-matmul, one layer at a time ---------------------------------------------------------------------

CHUNK_WEIGHTS = 1 << 20   # weights a layer decodes at a time on the CPU (whole rows) ...
MIN_ROWS = 256            # ... but at least this many rows: thinner output tiles make the matmul slow


def chunk_rows() -> bool:
    """Row chunks on the CPU only: there mx.dequantize's transient is 2-5x its output and chunks cost no speed; on
    CUDA the transient is the output alone and chunks cost speed and memory (figures: bench/RESULTS.md), so a GPU
    decodes whole layers (still after their input, mx.depends)."""
    return mx.default_device() == mx.cpu


def chunked_matmul(x, rows: int, in_dims: int, weight_rows: Callable, dtype):
    """x @ W.T where W's rows come from `weight_rows(start, stop, after)` (a float weight slice, made to depend on
    `after` so that MLX decodes it only once the input, or the previous chunk's product, exists; lazily it would
    decode every layer's weights first and hold them all). On the CPU in chunks of whole rows: CHUNK_WEIGHTS'
    worth, at least MIN_ROWS and at least as many rows as the input has tokens, so the transient is a few chunks.
    On a GPU whole layers, each paced (mlxdiff/pacing.py): at most the policy's in_flight decoded weights alive."""
    on_cpu = chunk_rows()
    step = max(MIN_ROWS, CHUNK_WEIGHTS // in_dims, x.size // max(in_dims, 1)) if on_cpu else rows
    parts, after = [], x
    for r in range(0, rows, step):
        after = mx.matmul(x, weight_rows(r, min(r + step, rows), after).astype(dtype).T)
        parts.append(after)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    if not on_cpu:
        pacing.pace(y)
    return y


class DecodingLinear(nn.Module):
    """A linear layer whose weight stays in a file's compact form (GGUF blocks, float8 codes and scales: every
    array with the output rows first) and is decoded to float just before its matmul, by `chunked_matmul`.
    A subclass holds its arrays and says how a slice of rows decodes: `decode(weight_rows, rows)`, where `rows`
    (a slice) picks the same rows of its other arrays. As they all have the output rows first, a row slice of the
    layer is a layer (linear_rows)."""

    decodes_per_call = True   # memory.compile_blocks_for: paced per layer, not compiled whole

    def decode(self, weight_rows, rows) -> mx.array:
        raise NotImplementedError

    def __call__(self, x):
        dtype = self.compute_dtype or x.dtype
        x = x.astype(dtype)
        weight = self["weight"]
        y = chunked_matmul(x, weight.shape[0], self.in_dims,
                           lambda r0, r1, after: self.decode(mx.depends(weight[r0:r1], after), slice(r0, r1)), dtype)
        return y + self["bias"] if "bias" in self else y


class DecodingEmbedding(nn.Module):
    """An embedding whose table stays in a file's compact form: only the looked-up rows are decoded
    (`decode(weight_rows, ids)`, as DecodingLinear's with the ids picking the rows), so the table keeps its size."""

    def decode(self, weight_rows, rows) -> mx.array:
        raise NotImplementedError

    def __call__(self, ids):
        flat = ids.reshape(-1)
        rows = self.decode(self["weight"][flat], flat).reshape(*ids.shape, self.dims)
        return rows.astype(self.compute_dtype) if self.compute_dtype is not None else rows

