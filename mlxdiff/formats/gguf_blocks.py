"""GGUF tensor types: each type's blocks decoded with MLX ops, onto MLX's affine quantization (`mx.dequantize`:
w = scale * code + bias per group) or to float32, exactly as gguf-py's quants.py:

| GGUF  | MLX        | scale        | bias        | how                                                        |
|-------|------------|--------------|-------------|------------------------------------------------------------|
| Q4_0  | 4-bit g32  | d            | -8 d        | exact (the file's codes)                                   |
| Q4_1  | 4-bit g32  | d            | m           | exact                                                      |
| Q5_0  | 5-bit g32  | d            | -16 d       | exact                                                      |
| Q5_1  | 5-bit g32  | d            | m           | exact                                                      |
| Q8_0  | 8-bit g32  | d            | -128 d      | exact, code = q + 128                                      |
| Q4_K  | 4-bit g32  | d * sc_j     | -dmin * m_j | exact in float32 (11-bit x 6-bit products)                 |
| Q5_K  | 5-bit g32  | d * sc_j     | -dmin * m_j | exact in float32                                           |
| Q3_K  | 8-bit g128 | -d           | 128 d       | exact, code = 128 - (sc_j - 32)(q - 4), in [0, 252]        |
| Q6_K  | 8-bit g32  | d * sc_dom/4 | -128 scale  | near-exact (below)                                         |
| Q2_K  | 4-bit g64  | requantized  |             | mx.quantize of the float32 weights, chunk by chunk         |
| F32, F16, BF16 | kept as stored (bf16 stays bf16)                                                  |
Any other type is refused with one error naming the tensor and its type, before anything is converted.

Why each type gets its form (the error and bytes-per-weight figures behind the Q3_K, Q6_K and Q2_K choices, and
what 16-bit scales cost): bench/RESULTS.md, "GGUF: the form of each type". Scales and biases are float32 when the
compute dtype is float32 (the CPU default: every exact type is then exact bit for bit against gguf-py), else the
compute dtype's 16-bit type (scale_dtype).
"""

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from .gguf_header import BLOCKS

# ---------------------------------------------------------------------------------------------------------------
# Block decoders: blocks [R, nb, block bytes] uint8 -> (codes uint8 [R, nb, block], scales, biases float32
# [R, nb, groups per block]). Layouts: gguf-py's quants.py.


def _f16(blocks, offset):
    """The float16 field at `offset` of every block, as float32 [R, nb]."""
    return mx.view(blocks[..., offset:offset + 2], mx.float16)[..., 0].astype(mx.float32)


def _nibbles(qs):
    """[..., n] bytes -> [..., 2n]: all low nibbles, then all high nibbles (the ggml order)."""
    return mx.concatenate([qs & 15, qs >> 4], axis=-1)


def _fields(x, width, count):
    """[..., n] bytes -> [..., count * n]: bit field k (of `width` bits) of every byte, field-major."""
    shifts = mx.arange(0, width * count, width, dtype=mx.uint8)[:, None]
    return ((x[..., None, :] >> shifts) & ((1 << width) - 1)).reshape(*x.shape[:-1], count * x.shape[-1])


def _bits_of_bytes(x):
    """[..., n] bytes -> [..., 8n]: bit j of byte k is element 8k + j (a little-endian bit mask)."""
    return ((x[..., :, None] >> mx.arange(8, dtype=mx.uint8)) & 1).reshape(*x.shape[:-1], 8 * x.shape[-1])


def _k_scales(s):
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit (scale, min) pairs."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = mx.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mins = mx.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(mx.float32), mins.astype(mx.float32)


def _q4_0(b):
    d = _f16(b, 0)[..., None]
    return _nibbles(b[..., 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[..., 4:20]), _f16(b, 0)[..., None], _f16(b, 2)[..., None]


def _q5_0(b):
    d = _f16(b, 0)[..., None]
    return _nibbles(b[..., 6:22]) | (_bits_of_bytes(b[..., 2:6]) << 4), d, -16 * d


def _q5_1(b):
    codes = _nibbles(b[..., 8:24]) | (_bits_of_bytes(b[..., 4:8]) << 4)
    return codes, _f16(b, 0)[..., None], _f16(b, 2)[..., None]


def _q8_0(b):
    d = _f16(b, 0)[..., None]
    return b[..., 2:34] ^ 0x80, d, -128 * d   # int8 q + 128 is its byte with the sign bit flipped


def _q4_k_like(b, high_bits):
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mins = _k_scales(b[..., 4:16])
    qs = b[..., -128:]
    codes = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 256)
    if high_bits is not None:
        codes = codes | (_fields(high_bits, 1, 8) << 4)
    return codes, d * sc, -(dmin * mins)


def _q4_k(b):
    return _q4_k_like(b, None)


def _q5_k(b):
    return _q4_k_like(b, b[..., 16:48])


def _q3_k(b):
    lead = b.shape[:-1]
    low2 = _fields(b[..., 32:96].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    q = low2.astype(mx.int16) + 4 * _fields(b[..., 0:32], 1, 8).astype(mx.int16) - 4           # -4..3
    s = b[..., 96:108]
    sc = (_fields(s[..., 0:8], 4, 2) | (_fields(s[..., 8:12], 2, 4) << 4)).astype(mx.int16) - 32  # -32..31
    # w = d * p with p = (sc - 32)(q - 4) in [-124, 128]; as scale -d, code 128 - p in [0, 252], bias 128 d
    # (a power-of-two multiple: exact in float16 too)
    codes = (128 - sc[..., None] * q.reshape(*lead, 16, 16)).astype(mx.uint8).reshape(*lead, 256)
    d = _f16(b, 108)[..., None]
    return codes, mx.repeat(-d, 2, axis=-1), mx.repeat(128 * d, 2, axis=-1)


def _q6_k(b):
    """Near-exact: per group of 32 (two sub-blocks of 16), scale = d * sc_dom / 4 with sc_dom the sub-scale of
    larger magnitude; that sub-block's codes are 4 (q - 32) + 128 exactly, the other's are rounded."""
    lead = b.shape[:-1]
    low4 = _nibbles(b[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 256)
    high2 = _fields(b[..., 128:192].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    q = ((low4 | (high2 << 4)).astype(mx.int32) - 32).reshape(*lead, 8, 2, 16)
    sc = mx.view(b[..., 192:208], mx.int8).astype(mx.int32).reshape(*lead, 8, 2)
    first_dominates = mx.abs(sc[..., 0]) >= mx.abs(sc[..., 1])
    dom = mx.where(first_dominates, sc[..., 0], sc[..., 1])
    ratio = (4 * sc[..., None] * q).astype(mx.float32) / mx.where(dom == 0, 1, dom)[..., None, None]
    codes = mx.clip(mx.round(ratio) + 128, 0, 255).astype(mx.uint8).reshape(*lead, 256)
    scale = _f16(b, 208)[..., None] * dom.astype(mx.float32) / 4
    return codes, scale, -128 * scale


def _q2_k_float(b):
    """Q2_K weights in float32 [R, nb, 256], computed as gguf-py does."""
    lead = b.shape[:-1]
    s = b[..., 0:16]
    q = _fields(b[..., 16:80].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 16, 16).astype(mx.float32)
    dl = _f16(b, 80)[..., None] * (s & 15).astype(mx.float32)
    ml = _f16(b, 82)[..., None] * (s >> 4).astype(mx.float32)
    return (dl[..., None] * q - ml[..., None]).reshape(*lead, 256)


def _q6_k_float(b):
    """Q6_K weights in float32 [R, nb, 256], exactly as gguf-py: d * sc * (q - 32) per sub-block of 16."""
    lead = b.shape[:-1]
    low4 = _nibbles(b[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 256)
    high2 = _fields(b[..., 128:192].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    q = ((low4 | (high2 << 4)).astype(mx.int32) - 32).reshape(*lead, 16, 16)
    sc = mx.view(b[..., 192:208], mx.int8).astype(mx.float32)
    d = _f16(b, 208)[..., None]
    return ((d * sc)[..., None] * q.astype(mx.float32)).reshape(*lead, 256)


def _affine_float(decode):
    """An affine decoder as a float one: codes * scale + bias per group."""
    def to_float(b):
        codes, scales, biases = decode(b)
        groups = scales.shape[-1]
        c = codes.astype(mx.float32).reshape(*codes.shape[:-1], groups, -1)
        return (c * scales[..., None] + biases[..., None]).reshape(codes.shape)
    return to_float


# GGUF type -> (decoder, bits, group size)
AFFINE = {"Q4_0": (_q4_0, 4, 32), "Q4_1": (_q4_1, 4, 32), "Q5_0": (_q5_0, 5, 32), "Q5_1": (_q5_1, 5, 32),
          "Q8_0": (_q8_0, 8, 32), "Q4_K": (_q4_k, 4, 32), "Q5_K": (_q5_k, 5, 32), "Q3_K": (_q3_k, 8, 128),
          "Q6_K": (_q6_k, 8, 32)}
# GGUF type -> (float32 decoder, bits, group size) of the requantization
REQUANTIZED = {"Q2_K": (_q2_k_float, 4, 64)}
# GGUF type -> float32 decoder of its blocks: the raw layout, decoded one layer at a time before its matmul
FLOAT = {**{name: _affine_float(decode) for name, (decode, _, _) in AFFINE.items()},
         "Q6_K": _q6_k_float, "Q2_K": _q2_k_float}
# The layout of quantized tensors ("auto" unless the spec says otherwise; MLXDIFF_GGUF_LAYOUT through the policy):
# - "raw": the file's blocks, decoded per layer before the matmul: exact, at the file's size, for every type;
# - "affine": MLX affine triplets, which Metal's and CUDA's quantized kernels read (Q6_K near-exact, Q2_K
#   requantized, Q3_K exact only at 8.5 bits per weight);
# - "auto": raw under float32 compute (float32 scales would cost 1.5 bits per weight); otherwise affine with 16-bit
#   scales, except RAW_BY_DEFAULT, whose affine forms are not exact at about their size.
RAW_BY_DEFAULT = ("Q2_K", "Q3_K", "Q6_K")
LAYOUTS = ("auto", "affine", "raw")
PLAIN_NUMPY = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}   # numpy has no bfloat16: its bits, then mx.view
PLAIN = tuple(PLAIN_NUMPY)
SUPPORTED = (*PLAIN, *AFFINE, *REQUANTIZED)


def pack_codes(codes, bits):
    """[..., K] integer codes (K % 32 == 0) -> [..., K * bits / 32] uint32: MLX's LSB-first bit stream per row."""
    *lead, k = codes.shape
    if 32 % bits == 0:
        per_word = 32 // bits
        c = codes.reshape(*lead, k // per_word, per_word).astype(mx.uint32)
        return (c << mx.arange(0, 32, bits, dtype=mx.uint32)).sum(axis=-1)   # disjoint bit fields: sum == or
    c = codes.reshape(*lead, k // 32, 32).astype(mx.uint32)
    words = []
    for w in range(bits):   # 32 codes fill `bits` words; code i covers stream bits [bits*i, bits*(i+1))
        word = None
        for i in range(32):
            shift = bits * i - 32 * w
            if -bits < shift < 32:
                part = c[..., i] << shift if shift >= 0 else c[..., i] >> -shift
                word = part if word is None else word | part
        words.append(word)
    return mx.stack(words, axis=-1).reshape(*lead, k * bits // 32)


def scale_dtype(compute_dtype) -> mx.Dtype:
    """float32 scales for float32 compute (exact); otherwise the compute dtype's own 16-bit type."""
    return compute_dtype if compute_dtype in (mx.float16, mx.bfloat16) else mx.float32


def convert_slab(raw, type_name):
    """raw uint8 [blocks, block bytes] -> (packed uint32, scales float32, biases float32), each flat in block
    order: a row-major tensor's blocks run along its rows, so a slab of blocks is a flat piece of each output."""
    blocks = raw[:, None, :]
    if type_name in REQUANTIZED:
        decode, bits, group = REQUANTIZED[type_name]
        w, s, b = mx.quantize(decode(blocks).reshape(-1, group), group_size=group, bits=bits)
        return w.reshape(-1), s.reshape(-1), b.reshape(-1)
    decode, bits, _ = AFFINE[type_name]
    codes, scales, biases = decode(blocks)
    return pack_codes(codes.reshape(raw.shape[0], -1), bits).reshape(-1), scales.reshape(-1), biases.reshape(-1)


def decode_rows(blocks, type_name) -> mx.array:
    """uint8 blocks [rows, bytes per row] of a GGUF type -> float32 weights [rows, row length], exactly as gguf-py."""
    block, block_bytes = BLOCKS[type_name]
    rows = blocks.shape[0]
    return FLOAT[type_name](blocks.reshape(rows, -1, block_bytes)).reshape(rows, -1)
