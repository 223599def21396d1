"""GGUF reader: every supported type against gguf-py's dequantize, quantized matmuls against float64, the
quantized-layer plumbing, and hostile files (each a clean MlxdiffError; the seeded fuzz run is in
tests/test_reader_fuzz.py)."""

import math
import re
import struct
import time

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gq

from gguf_helpers import QUANTIZABLE, T, header_fields, patched, random_blocks, realistic_weights, write_gguf
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import gguf as gguf_module
from mlxdiff.formats.gguf import check_gguf, load_gguf
from mlxdiff.formats.quantized import (QuantizedTensor, RawBlocks, concat_rows, flatten_quantized,
                                      quantized_predicate, split_rows)

EXACT = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q3_K, T.Q4_K, T.Q5_K)
QUANTIZED = EXACT + (T.Q6_K, T.Q2_K)
F32_EPS = 2.0 ** -23


def _tensors(qtype, rng, real=False):
    """Odd shapes: 7 rows (not a multiple of 64), a 1-D tensor and a 3-D tensor, rows of 512 / 256 weights."""
    def make(shape):
        rows = math.prod(shape[:-1])
        if real:
            raw = gq.quantize(realistic_weights(rows, shape[-1], seed=int(rng.integers(1 << 30))), qtype)
        else:
            raw = random_blocks(qtype, rows, shape[-1], rng)
        return raw.reshape(*shape[:-1], -1)
    return {"a.weight": (qtype, make((7, 512))), "b.bias": (qtype, make((256,))),
            "c.weight": (qtype, make((2, 3, 256)))}


def _reference(qtype, raw):
    return gq.dequantize(raw, qtype).astype(np.float64)


def _assert_clean(err, path):
    message = str(err.value)
    assert str(path) in message and "\n" not in message, message


# ---------------------------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_quantized_types_match_gguf_py(tmp_path, monkeypatch, qtype):
    monkeypatch.setattr(gguf_module, "CHUNK_WEIGHTS", 1024)   # 2-row chunks: the 7-row tensor takes 4
    rng = np.random.default_rng(int(qtype))
    sources = [_tensors(qtype, rng)] + ([_tensors(qtype, rng, real=True)] if qtype in QUANTIZABLE else [])
    for i, tensors in enumerate(sources):
        path = write_gguf(tmp_path / f"{qtype.name}_{i}.gguf", tensors)
        loaded = load_gguf(path, mx.float32, layout="affine")
        assert set(loaded) == set(tensors)
        for name, (_, raw) in tensors.items():
            ref = _reference(qtype, raw)
            ours = loaded[name]
            if ref.ndim == 1:   # quantized vectors come back dequantized
                assert isinstance(ours, mx.array) and ours.dtype == mx.float32
                deq = np.array(ours, np.float64)
            else:
                assert isinstance(ours, QuantizedTensor) and ours.weight.dtype == mx.uint32
                assert ours.scales.dtype == ours.biases.dtype == mx.float32
                assert ours.shape == ref.shape and ours.source_type == qtype.name
                deq = np.array(ours.dequantize(), np.float64)
            assert deq.shape == ref.shape
            err = np.abs(deq - ref)
            if qtype in EXACT:
                assert err.max() <= F32_EPS * np.abs(ref).max(), (name, err.max())
            elif qtype == T.Q6_K:
                _check_q6_k(raw.reshape(-1, raw.shape[-1]), ref.reshape(-1, ref.shape[-1]),
                            deq.reshape(-1, deq.shape[-1]))
            else:   # Q2_K, requantized by mx.quantize (4-bit min/max per 64): within half a step of its grid
                _check_requantized(ours, ref, deq)


def _check_q6_k(raw, ref, deq):
    """Near-exact Q6_K: in each group of 32 the sub-block of 16 with the larger |scale| is exact, the other is
    within half of the group's step d*sc_dom/4 (a full step where the two scales are equal and opposite)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 210)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float64).reshape(rows, -1, 8, 2)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float64)          # [rows, nb, 1]
    first = np.abs(sc[..., 0]) >= np.abs(sc[..., 1])
    dom = np.where(first, sc[..., 0], sc[..., 1])
    step = np.abs(d * dom / 4)[..., None, None]                                 # [rows, nb, 8, 1, 1]
    err = np.abs(deq - ref).reshape(rows, -1, 8, 2, 16)
    tol = F32_EPS * np.abs(ref).max()
    dominant_err = np.where(first[..., None], err[..., 0, :], err[..., 1, :])
    other_err = np.where(first[..., None], err[..., 1, :], err[..., 0, :])
    assert dominant_err.max() <= tol
    opposite = (sc[..., 0] == -sc[..., 1])[..., None]
    assert np.all(other_err <= np.where(opposite, 1.0, 0.5) * step[..., 0, :] + tol)


def _check_requantized(ours, ref, deq):
    """Q2_K: exactly what mx.quantize makes of gguf-py's float32 weights (so our Q2_K decoding is exact)."""
    if ref.ndim == 1:
        return   # a dequantized vector: checked through the 2-D tensors of the same file
    rows = ref.reshape(-1, ref.shape[-1]).astype(np.float32)
    expected = mx.quantize(mx.array(rows), group_size=ours.group_size, bits=ours.bits)
    for got, want in zip((ours.weight, ours.scales, ours.biases), expected):
        assert np.array_equal(np.array(got).reshape(np.array(want).shape), np.array(want))
    assert np.sqrt(((deq - ref) ** 2).mean()) <= 0.2 * np.sqrt((ref ** 2).mean())   # a sane 4-bit grid


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_quantized_matmul_matches_float64(tmp_path, qtype):
    rng = np.random.default_rng(100 + int(qtype))
    raw = random_blocks(qtype, 40, 768, rng)
    path = write_gguf(tmp_path / "m.gguf", {"w.weight": (qtype, raw)})
    q = load_gguf(path, mx.float32, layout="affine")["w.weight"]
    x = rng.standard_normal((5, 768)).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), q.weight, q.scales, q.biases, transpose=True, group_size=q.group_size,
                            bits=q.bits)
    # exact types: against the file's own weights; the others: against the weights they were converted to (their
    # distance to the file is bounded in test_quantized_types_match_gguf_py)
    weights = _reference(qtype, raw) if qtype in EXACT else np.array(q.dequantize(), np.float64)
    ref = x.astype(np.float64) @ weights.T
    rel = np.abs(np.array(y, np.float64) - ref).max() / np.abs(ref).max()
    assert rel <= 1e-5, rel


def test_plain_types_kept_as_stored(tmp_path):
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((5, 6)).astype(np.float32)
    f16 = rng.standard_normal((3, 1, 7)).astype(np.float16)
    bf16_bits = (rng.standard_normal((4, 9)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    vec = rng.standard_normal(11).astype(np.float32)
    path = write_gguf(tmp_path / "plain.gguf", {"f32.weight": (T.F32, f32), "f16.weight": (T.F16, f16),
                                                 "bf16.weight": (T.BF16, bf16_bits.view(np.uint8)),
                                                 "vec": (T.F32, vec)})
    for dtype in (mx.float32, mx.bfloat16):
        out = load_gguf(path, dtype)
        assert out["f32.weight"].dtype == mx.float32 and np.array_equal(np.array(out["f32.weight"]), f32)
        assert out["f16.weight"].dtype == mx.float16 and np.array_equal(np.array(out["f16.weight"]), f16)
        assert out["vec"].shape == (11,) and np.array_equal(np.array(out["vec"]), vec)
        bf16 = out["bf16.weight"]
        assert bf16.dtype == mx.bfloat16 and bf16.shape == (4, 9)
        assert np.array_equal(np.array(mx.view(bf16, mx.uint16)), bf16_bits)


@pytest.mark.parametrize("dtype, unit_roundoff", [(mx.float16, 2.0 ** -11), (mx.bfloat16, 2.0 ** -8)],
                         ids=["float16", "bfloat16"])
def test_16_bit_scales(tmp_path, dtype, unit_roundoff):
    """Scales and biases follow the compute dtype; their rounding is the only error they add: per weight at most
    one rounding of the scale (times the code) plus one of the bias."""
    rng = np.random.default_rng(7)
    tensors = {f"{t.name}.weight": (t, random_blocks(t, 3, 256, rng)) for t in QUANTIZED}
    path = write_gguf(tmp_path / "s.gguf", tensors)
    exact, half = load_gguf(path, mx.float32, layout="affine"), load_gguf(path, dtype, layout="affine")
    for name, q32 in exact.items():
        q16 = half[name]
        assert q16.scales.dtype == q16.biases.dtype == dtype
        assert np.array_equal(np.array(q16.weight), np.array(q32.weight))
        stored = mx.dequantize(q16.weight, q16.scales.astype(mx.float32), q16.biases.astype(mx.float32),
                               group_size=q16.group_size, bits=q16.bits)
        g = q32.group_size
        codes = np.array(mx.dequantize(q32.weight, mx.ones_like(q32.scales), mx.zeros_like(q32.biases),
                                       group_size=g, bits=q32.bits), np.float64)
        scale = np.repeat(np.abs(np.array(q32.scales, np.float64)), g, axis=-1)
        bias = np.repeat(np.abs(np.array(q32.biases, np.float64)), g, axis=-1)
        ref = np.array(q32.dequantize(), np.float64)
        bound = unit_roundoff * (scale * codes + bias) + 4 * F32_EPS * np.abs(ref).max()
        assert np.all(np.abs(np.array(stored, np.float64) - ref) <= bound), name


def test_float16_overflow_keeps_float32_scales(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_module, "CHUNK_WEIGHTS", 64)   # one row per chunk: the overflow is in the 2nd
    raw = random_blocks(T.Q8_0, 2, 64, np.random.default_rng(3))
    raw[1, 0:2] = np.array([1000.0], np.float16).view(np.uint8)   # bias -128 d overflows float16
    path = write_gguf(tmp_path / "o.gguf", {"w.weight": (T.Q8_0, raw)})
    q = load_gguf(path, mx.float16)["w.weight"]
    assert q.scales.dtype == mx.float32
    deq = np.array(q.dequantize(), np.float64)
    assert np.abs(deq - _reference(T.Q8_0, raw)).max() == 0


def test_conversion_writes_in_place(tmp_path, monkeypatch):
    """A tensor converted in many slabs peaks at its outputs plus about one slab's transient buffers: each slab is
    written into the outputs in place (a chunk-then-concatenate conversion holds the tensor twice)."""
    monkeypatch.setattr(gguf_module, "CHUNK_WEIGHTS", 1 << 14)   # 256 slabs
    raw = random_blocks(T.Q4_K, 2048, 2048, np.random.default_rng(0))
    path = write_gguf(tmp_path / "big.gguf", {"a.weight": (T.Q4_K, raw)})
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    qt = load_gguf(path, mx.float32, layout="affine")["a.weight"]
    peak = mx.get_peak_memory() - base
    kept = qt.weight.nbytes + qt.scales.nbytes + qt.biases.nbytes
    assert peak <= 1.1 * kept, (peak, kept)
    ref = gq.dequantize(raw, T.Q4_K)
    assert np.abs(np.array(qt.dequantize()) - ref).max() <= F32_EPS * np.abs(ref).max()


def test_non_finite_scales_are_an_error(tmp_path):
    raw = random_blocks(T.Q4_K, 2, 256, np.random.default_rng(4))
    raw[1, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    path = write_gguf(tmp_path / "inf.gguf", {"blk.w.weight": (T.Q4_K, raw)})
    with pytest.raises(MlxdiffError, match="blk.w.weight") as err:
        load_gguf(path, mx.float32)
    _assert_clean(err, path)


def test_unsupported_types_are_named(tmp_path):
    rng = np.random.default_rng(5)
    mxfp4 = rng.integers(0, 256, size=(2, 2 * 17), dtype=np.uint8)
    path = write_gguf(tmp_path / "u.gguf", {"ok.weight": (T.F32, np.ones((2, 2), np.float32)),
                                            "experts.weight": (T.MXFP4, mxfp4)})
    with pytest.raises(MlxdiffError, match=r"'experts.weight' has GGUF type MXFP4") as err:
        load_gguf(path)
    _assert_clean(err, path)
    path = write_gguf(tmp_path / "i8.gguf", {"ids": (T.I8, np.arange(6, dtype=np.int8))})
    with pytest.raises(MlxdiffError, match=r"'ids' has GGUF type I8"):
        load_gguf(path)


# ---------------------------------------------------------------------------------------------------------------
# Quantized layers: split, join, nn.quantize


@pytest.mark.parametrize("layout", ["affine", "raw"])
def test_split_rows_keeps_quantized_rows(tmp_path, layout):
    rng = np.random.default_rng(6)
    raw = random_blocks(T.Q4_K, 3 * 24, 512, rng)
    path = write_gguf(tmp_path / "qkv.gguf", {"attn.qkv.weight": (T.Q4_K, raw)})
    qkv = load_gguf(path, mx.float32, layout=layout)["attn.qkv.weight"]
    ref = _reference(T.Q4_K, raw)
    parts = split_rows(qkv, 3)
    assert [p.shape for p in parts] == [(24, 512)] * 3
    for i, p in enumerate(parts):
        if layout == "affine":
            assert isinstance(p, QuantizedTensor) and p.weight.dtype == mx.uint32
        else:
            assert isinstance(p, RawBlocks) and p.blocks.dtype == mx.uint8 and p.nbytes == raw.nbytes // 3
        assert np.array_equal(np.array(p.dequantize(), np.float64), ref[24 * i:24 * (i + 1)])
    swapped = concat_rows([parts[2], parts[0], parts[1]])
    assert np.array_equal(np.array(swapped.dequantize(), np.float64), np.concatenate([ref[48:], ref[:48]]))
    dense = mx.arange(12.0).reshape(6, 2)
    assert [tuple(p.shape) for p in split_rows(dense, 2)] == [(3, 2), (3, 2)]
    with pytest.raises(MlxdiffError):
        split_rows(qkv, 5)


def test_quantized_layers_load_through_nn_quantize(tmp_path):
    rng = np.random.default_rng(8)
    tensors = {"proj.weight": (T.Q5_K, random_blocks(T.Q5_K, 12, 256, rng)),
               "proj.bias": (T.F32, rng.standard_normal(12).astype(np.float32)),
               "head.weight": (T.Q8_0, random_blocks(T.Q8_0, 5, 96, rng)),
               "norm.weight": (T.F32, rng.standard_normal(12).astype(np.float32))}
    path = write_gguf(tmp_path / "model.gguf", tensors)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(256, 12)
            self.head = nn.Linear(96, 5, bias=False)
            self.norm = nn.RMSNorm(12)

    model = Tiny()
    flat, layers = flatten_quantized(load_gguf(path, mx.float32, layout="affine"))
    assert layers == {"proj": {"bits": 5, "group_size": 32}, "head": {"bits": 8, "group_size": 32}}
    nn.quantize(model, class_predicate=quantized_predicate(layers))
    assert isinstance(model.proj, nn.QuantizedLinear) and isinstance(model.head, nn.QuantizedLinear)
    model.load_weights(list(flat.items()), strict=True)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    w = _reference(T.Q5_K, tensors["proj.weight"][1])
    ref = x.astype(np.float64) @ w.T + tensors["proj.bias"][1]
    out = np.array(model.proj(mx.array(x)), np.float64)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-5
    with pytest.raises(MlxdiffError, match="not a layer weight"):
        flatten_quantized({"odd": load_gguf(path, mx.float32)["head.weight"]})


# ---------------------------------------------------------------------------------------------------------------
# Header


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    """A small valid file: several value types (arrays included) and tensors of several types."""
    rng = np.random.default_rng(9)
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    write_gguf(path, {"t.f32": (T.F32, rng.standard_normal((4, 8)).astype(np.float32)),
                      "t.q8.weight": (T.Q8_0, gq.quantize(realistic_weights(2, 64), T.Q8_0)),
                      "t.q4k.weight": (T.Q4_K, random_blocks(T.Q4_K, 2, 256, rng)),
                      "t.f16": (T.F16, rng.standard_normal(16).astype(np.float16))},
               metadata={"general.name": "tiny", "test.u32": 7, "test.ints": [1, 2, 3],
                         "test.strs": ["a", "bc"], "test.bytes": [True, False], "test.nested": [[1, 2], [3, 4, 5]]})
    return path


def test_header_agrees_with_gguf_py(valid_file):
    header = check_gguf(valid_file)
    reader = GGUFReader(valid_file)
    assert header.version == 3 and header.alignment == 32 and header.data_start == reader.data_offset
    ours = [(t.name, t.type_name, t.shape, t.offset, t.nbytes) for t in header.tensors]
    theirs = [(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.data_offset,
               t.n_bytes) for t in reader.tensors]
    assert ours == theirs
    def flat(value):   # gguf-py flattens nested arrays
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, list):
            return [x for v in value for x in (flat(v) if isinstance(v, (list, np.ndarray)) else [v])]
        return value

    assert [k for k in reader.fields if not k.startswith("GGUF.")] == list(header.metadata)
    for key, value in header.metadata.items():
        assert flat(value) == reader.fields[key].contents(), key
    assert header.metadata["test.nested"][1].tolist() == [3, 4, 5]


@pytest.mark.parametrize("alignment", [1, 64])
def test_custom_alignment(tmp_path, alignment):
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = random_blocks(T.Q5_0, 2, 64, np.random.default_rng(2))
    path = write_gguf(tmp_path / "a.gguf", {"h": (T.F16, data[0].astype(np.float16)), "x": (T.F32, data),
                                            "q.weight": (T.Q5_0, raw)}, alignment=alignment)
    header = check_gguf(path)
    assert header.alignment == alignment and all(t.offset % alignment == 0 for t in header.tensors)
    out = load_gguf(path)
    assert np.array_equal(np.array(out["x"]), data)   # unaligned float views when alignment is 1
    assert np.array_equal(np.array(out["q.weight"].dequantize(), np.float64), _reference(T.Q5_0, raw))


def _hostile_cases(data: bytes) -> dict:
    f = header_fields(data)
    kv = {e["key"]: e for e in f["kvs"]}
    t0, t1 = f["tensors"][0], f["tensors"][1]
    first_offset = struct.unpack_from("<Q", data, t1["offset"])[0]
    data_start = -(-f["header_end"] // 32) * 32
    ints = kv["test.ints"]
    cases = {
        "empty": b"",
        "truncated header": data[:f["header_end"] - 5],
        "truncated data": data[:len(data) - 40],
        "wrong magic": b"GGML" + data[4:],
        "version 1": patched(data, 4, "I", 1),
        "version 4": patched(data, 4, "I", 4),
        "big-endian": patched(data, 4, "I", 3 << 24),
        "tensor count 2^40": patched(data, 8, "Q", 1 << 40),
        "kv count 2^40": patched(data, 16, "Q", 1 << 40),
        "kv count 2^64-1": patched(data, 16, "Q", (1 << 64) - 1),
        "key length 2^62": patched(data, f["kvs"][1]["key_len"], "Q", 1 << 62),
        "string length 2^62": patched(data, kv["general.name"]["value"], "Q", 1 << 62),
        "unknown value type": patched(data, kv["test.u32"]["type"], "I", 13),
        "string read as bool": patched(data, kv["general.name"]["type"], "I", 7),
        # the gguf-py hang: a uint8 array whose length runs far past the file
        "uint8 array length 2^40": patched(patched(data, ints["item_type"], "I", 0), ints["length"], "Q", 1 << 40),
        "array of arrays": patched(data, ints["item_type"], "I", 9),
        "array of unknown type": patched(data, ints["item_type"], "I", 77),
        "nested array length 2^40": patched(data, kv["test.nested"]["value"] + 12 + 4, "Q", 1 << 40),
        "n_dims 0": patched(data, t0["n_dims"], "I", 0),
        "n_dims 5": patched(data, t0["n_dims"], "I", 5),
        "n_dims 2^31": patched(data, t0["n_dims"], "I", 1 << 31),
        "dim 0": patched(data, t0["dims"][0], "Q", 0),
        "dim 2^31": patched(data, t0["dims"][0], "Q", 1 << 31),
        "dims 2^30 x 2^30": patched(patched(data, t0["dims"][0], "Q", 1 << 30), t0["dims"][1], "Q", 1 << 30),
        "dims wrap u64": patched(patched(data, t0["dims"][0], "Q", (1 << 64) - 8), t0["dims"][1], "Q",
                                 (1 << 64) - 4),
        "unknown type 4 (Q4_2)": patched(data, t0["type"], "I", 4),
        "unknown type 99": patched(data, t0["type"], "I", 99),
        "row not a block multiple": patched(data, f["tensors"][2]["dims"][0], "Q", 255),
        "offset past EOF": patched(data, t1["offset"], "Q", len(data)),
        "offset wraps to the header": patched(data, t1["offset"], "Q", (1 << 64) - data_start),
        "misaligned offset": patched(data, t1["offset"], "Q", first_offset + 1),
        "overlapping tensors": patched(data, t1["offset"], "Q", 0),
        "tensor name not UTF-8": patched(data, t0["name_len"] + 8, "B", 0xFF),
        # renames to another entry's name of the same length
        "duplicate tensor name": patched(data, f["tensors"][3]["name_len"] + 8, "5s", b"t.f32"),
        "duplicate key": patched(data, ints["key_len"] + 8, "9s", b"test.strs"),
    }
    return cases


# what each hostile case's message must say (the check that caught it)
EXPECTED = {
    "empty": "too short", "truncated header": "truncated", "truncated data": "runs past the end",
    "wrong magic": "magic", "version 1": "version 1", "version 4": "version 4", "big-endian": "big-endian",
    "tensor count 2^40": "tensor count", "kv count 2^40": "key/value count", "kv count 2^64-1": "key/value count",
    "key length 2^62": "key length", "string length 2^62": "string value of key 'general.name'",
    "unknown value type": "unknown value type 13", "string read as bool": "key length",
    "uint8 array length 2^40": "declares 1099511627776 items", "nested array length 2^40": "declares",
    "array of arrays": "test.ints", "array of unknown type": "unknown type 77",
    "nested too deep": "nested deeper", "alignment 0": "alignment 0", "alignment 3": "alignment 3",
    "alignment as uint8": "general.alignment must be a uint32",
    "n_dims 0": "n_dims 0", "n_dims 5": "n_dims 5", "n_dims 2^31": "n_dims 2147483648", "dim 0": "dims [0",
    "dim 2^31": "dims [2147483648", "dims 2^30 x 2^30": "runs past the end", "dims wrap u64": "dims [1844",
    "unknown type 4 (Q4_2)": "unknown type id 4", "unknown type 99": "unknown type id 99",
    "row not a block multiple": "not a multiple of the block size", "offset past EOF": "runs past the end",
    "offset wraps to the header": "runs past the end", "misaligned offset": "not a multiple of the alignment",
    "overlapping tensors": "overlap", "tensor name not UTF-8": "not UTF-8",
    "duplicate tensor name": "duplicate tensor name 't.f32'", "duplicate key": "duplicate metadata key 'test.strs'",
}


def test_hostile_files_are_clean_errors(tmp_path, valid_file):
    data = valid_file.read_bytes()
    cases = _hostile_cases(data)
    align_file = write_gguf(tmp_path / "align.gguf", {"x": (T.F32, np.ones((2, 8), np.float32))}, alignment=32)
    align_bytes = align_file.read_bytes()
    align = next(e for e in header_fields(align_bytes)["kvs"] if e["key"] == "general.alignment")
    cases["alignment 0"] = patched(align_bytes, align["value"], "I", 0)
    cases["alignment 3"] = patched(align_bytes, align["value"], "I", 3)
    cases["alignment as uint8"] = patched(align_bytes, align["type"], "I", 0)
    deep = write_gguf(tmp_path / "deep.gguf", {"x": (T.F32, np.ones(2, np.float32))}, metadata={"d": [[[[[1]]]]]})
    cases["nested too deep"] = deep.read_bytes()
    assert set(cases) == set(EXPECTED)
    for name, content in cases.items():
        path = tmp_path / (name.replace(" ", "_").replace("^", "") + ".gguf")
        path.write_bytes(content)
        # a hostile count must be refused up front, not walked: at most a second of this process's CPU time (what
        # the refusal itself costs, whatever else shares the cores) and a generous wall-clock bound against a wait
        cpu, wall = time.process_time(), time.perf_counter()
        with pytest.raises(MlxdiffError, match=re.escape(EXPECTED[name])) as err:
            load_gguf(path, mx.float32)
        assert time.process_time() - cpu < 1.0 and time.perf_counter() - wall < 60.0, name
        _assert_clean(err, path)


# The seeded GGUF mutants (no crash, no hang, each refused in one line or read exactly as gguf-py reads it) run in
# tests/test_reader_fuzz.py, through bench/fuzz_readers.py.


# ---------------------------------------------------------------------------------------------------------------
# The raw layout: the file's blocks, decoded per layer


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_raw_layout_is_exact_at_the_file_size(tmp_path, qtype):
    """Every quantized type kept as its blocks: resident bytes equal the file's tensor bytes, the decode equals
    gguf-py's float32 dequantize bit for bit, and RawLinear's product is within float32 rounding of float64."""
    from mlxdiff.formats.gguf import RawLinear, use_raw_layers
    rng = np.random.default_rng(300 + int(qtype))
    raw = random_blocks(qtype, 40, 768, rng)
    path = write_gguf(tmp_path / "r.gguf", {"w.weight": (qtype, raw)})
    q = load_gguf(path, mx.float32, layout="raw")["w.weight"]
    assert isinstance(q, RawBlocks) and q.nbytes == raw.nbytes and q.shape == (40, 768)
    ref = gq.dequantize(raw, qtype).astype(np.float32)
    assert np.array_equal(np.array(q.dequantize()), ref)

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(768, 40, bias=False)

    model = One()
    flat, layers = flatten_quantized({"w.weight": q})
    assert layers == {"w": {"raw": qtype.name}}
    use_raw_layers(model, layers)
    assert isinstance(model.w, RawLinear)
    model.load_weights(list(flat.items()), strict=True)
    x = rng.standard_normal((5, 768)).astype(np.float32)
    want = x.astype(np.float64) @ ref.astype(np.float64).T
    assert np.abs(np.array(model.w(mx.array(x)), np.float64) - want).max() / np.abs(want).max() <= 1e-5


def test_default_layout_per_compute_dtype(tmp_path):
    """float32 compute (the CPU default): every quantized type raw; 16-bit compute: affine where that form is exact
    at about the file's size, raw for Q2_K, Q3_K and Q6_K."""
    rng = np.random.default_rng(9)
    tensors = {f"{t.name}.weight": (t, random_blocks(t, 4, 256, rng)) for t in QUANTIZED}
    path = write_gguf(tmp_path / "d.gguf", tensors)
    assert all(isinstance(v, RawBlocks) for v in load_gguf(path, mx.float32).values())
    half = load_gguf(path, mx.bfloat16)
    for t in QUANTIZED:
        assert isinstance(half[f"{t.name}.weight"], RawBlocks if t.name in ("Q2_K", "Q3_K", "Q6_K")
                          else QuantizedTensor), t.name
    with pytest.raises(MlxdiffError, match="layout"):
        load_gguf(path, mx.float32, layout="packed")
