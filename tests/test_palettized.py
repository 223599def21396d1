"""Palettized weights (issue 26, part 1; formats/palettized.py): n-bit indices packed per row, a table per tensor or
per group of output rows, maybe a per-row scale; decoded per layer before its matmul; made by k-means with
quantize="pN[:gG]" and saved by mlxdiff.convert.

The references are independent of the code under test: numpy's little-endian packbits for the bit order, numpy's
lut[group][idx] * scale for the decode, a brute-force nearest-centroid search for the assignment, MLX's own affine
quantization for the error comparison, and a plain matmul with the decoded weight for the layers and the models.
"""

import json

import numpy as np
import pytest

import mlxdiff
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from helpers import max_rel_err
from mlxdiff.convert import convert
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import palettized as P
from mlxdiff.formats import quantized as Q
from ldm_helpers import sd15_components
from quantized_helpers import _built, _densify, resident_after_build

NBITS = (1, 2, 3, 4, 6, 8)


def _laplace(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).laplace(size=shape).astype(dtype) * 0.02


# -- the form ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbits", NBITS)
def test_pack_round_trip_and_bit_order(nbits):
    """pack/unpack are inverse for every width (rows not a whole number of units included), and a packed row is the
    row's indices as one little-endian bit string, padded to whole units (numpy's packbits, bitorder little)."""
    rng = np.random.default_rng(nbits)
    per, nbytes = P.UNITS[nbits]
    for cols in (1, per - 1 or 1, per, 3 * per + 1, 40):
        idx = rng.integers(0, 1 << nbits, (5, cols)).astype(np.uint32)
        packed = P.pack(mx.array(idx), nbits)
        assert packed.dtype == mx.uint8 and packed.shape == (5, -(-cols // per) * nbytes)
        assert np.array_equal(np.array(P.unpack(packed, nbits, cols)), idx)
        for r in range(5):
            bits = ((idx[r][:, None] >> np.arange(nbits)) & 1).astype(np.uint8).reshape(-1)
            bits = np.concatenate([bits, np.zeros(packed.shape[1] * 8 - bits.size, np.uint8)])
            assert np.array_equal(np.array(packed[r]), np.packbits(bits, bitorder="little"))


def test_a_row_of_whole_units_packs_as_coremltools_packs():
    """coremltools packs a tensor's indices as one bit string (optimize/_utils.pack_elements_into_bits); a row whose
    indices fill whole units is packed to the same bytes, so a Core ML blob's rows are slices of it."""
    from coremltools.optimize._utils import pack_elements_into_bits
    rng = np.random.default_rng(3)
    for nbits in NBITS:
        idx = rng.integers(0, 1 << nbits, (3, 48)).astype(np.uint8)
        assert np.array_equal(pack_elements_into_bits(idx.reshape(-1), nbits).reshape(3, -1),
                              np.array(P.pack(mx.array(idx), nbits)))


def _numpy_dense(idx, lut, scale):
    rows = idx.shape[0]
    group = np.arange(rows) // (rows // lut.shape[0])
    w = lut[group[:, None], idx.reshape(rows, -1)].reshape(idx.shape)
    return w if scale is None else w * scale.reshape(-1, *([1] * (idx.ndim - 1)))


@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("groups,scaled", [(1, False), (3, False), (3, True)])
def test_decode_is_the_table_lookup(nbits, dtype, groups, scaled):
    """Every path to the dense weight (the form's dequantize, the layer's decode, row slices of both, a split and
    a join) equals numpy's lut[group][idx] (* scale) bit for bit."""
    rng = np.random.default_rng(100 + nbits)
    idx = rng.integers(0, 1 << nbits, (24, 37)).astype(np.uint16)
    lut = rng.standard_normal((groups, 1 << nbits)).astype(dtype)
    scale = rng.uniform(0.5, 2, 24).astype(dtype) if scaled else None
    want = _numpy_dense(idx, lut, scale)
    pw = P.palettized(idx, lut, scale)
    assert pw.nbits == nbits and pw.group_size == 24 // groups and pw.shape == (24, 37)
    got = np.array(pw.dequantize())
    assert got.dtype == dtype and np.array_equal(got, want)
    layer = P.PalettizedLinear.of(pw)
    assert np.array_equal(np.array(layer.dense_weight()), want)
    view = Q.linear_rows(layer, 8, 20)     # crosses a group boundary: its rows keep their own tables
    assert np.array_equal(np.array(view.dense_weight()), want[8:20])
    parts = Q.split_rows(pw, 3)
    assert all(isinstance(p, Q.PalettizedWeight) for p in parts)
    assert np.array_equal(np.concatenate([np.array(p.dequantize()) for p in parts]), want)
    joined = Q.concat_rows(parts[::-1])
    assert np.array_equal(np.array(joined.dequantize()), np.concatenate([want[16:], want[8:16], want[:8]]))


def test_conv_shaped_indices_decode_as_rows():
    """An N-d weight (a conv's [out, kh, kw, in]) is its [out, rest] rows."""
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 64, (8, 3, 3, 5)).astype(np.uint8)
    lut = rng.standard_normal((2, 64)).astype(np.float32)
    pw = P.palettized(idx, lut)
    assert pw.dequantize().shape == (8, 3, 3, 5)
    assert np.array_equal(np.array(pw.dequantize()), _numpy_dense(idx, lut, None))


@pytest.mark.parametrize("indices,lut,scale,match", [
    (np.zeros((4, 8), np.uint8), np.zeros((1, 32), np.float32), None, "nbits one of"),
    (np.zeros((4, 8), np.uint8), np.zeros((1, 16), np.int32), None, "float table"),
    (np.zeros((4, 8), np.float32), np.zeros((1, 16), np.float32), None, "integer array"),
    (np.zeros((6, 8), np.uint8), np.zeros((4, 16), np.float32), None, "4 tables do not divide the 6"),
    (np.zeros((4, 8), np.uint8), np.zeros((1, 16), np.float32), np.ones(3, np.float32), "one per output row"),
    (np.full((4, 8), 16, np.uint8), np.zeros((1, 16), np.float32), None, "outside 0..15"),
])
def test_bad_palettes_are_one_line(indices, lut, scale, match):
    with pytest.raises(MlxdiffError, match=match) as e:
        P.palettized(indices, lut, scale)
    assert "\n" not in str(e.value)


# -- k-means -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbits,group_size", [(2, None), (4, None), (6, 16), (8, None)])
def test_kmeans_is_deterministic_and_assigns_the_nearest(nbits, group_size):
    """The same weight gives the same indices and tables twice; the tables are sorted and in the weight's dtype;
    every weight decodes to its nearest table value (a brute-force search over the table)."""
    w = mx.array(_laplace((64, 96), seed=nbits))
    a, b = P.palettize(w, nbits, group_size), P.palettize(w, nbits, group_size)
    mx.eval(a.packed, a.lut, b.packed, b.lut)
    assert np.array_equal(np.array(a.packed), np.array(b.packed)) and np.array_equal(np.array(a.lut), np.array(b.lut))
    lut = np.array(a.lut)
    assert a.lut.dtype == mx.float32 and lut.shape == (64 // (group_size or 64), 1 << nbits)
    assert np.all(np.diff(lut, axis=1) >= 0)
    wn = np.array(w)
    rows_lut = np.repeat(lut, group_size or 64, axis=0)                       # [rows, k]
    nearest = np.abs(wn[:, :, None] - rows_lut[:, None, :]).min(axis=2)
    assert np.array_equal(np.abs(wn - np.array(a.dequantize())), nearest)


@pytest.mark.parametrize("nbits,affine_bits", [(4, 3), (6, 5)])
def test_kmeans_error_below_affine_at_equal_bits_per_weight(nbits, affine_bits):
    """On a Laplace-distributed float16 weight (peaked, heavy-tailed: most trained weights look so), pN with one
    table per tensor (N bits per weight plus the table) reconstructs with less mean squared error than MLX's
    affine (N-1) bits with a float16 scale and bias per 32 weights (N bits per weight), counted from the bytes
    both hold (the table adds under 0.1%). (At the same index bits, affine N bits g64 spends half a bit more per weight and wins on such iid
    weights: bench/palettize_quality.py.)"""
    w = mx.array(_laplace((256, 1024), seed=3, dtype=np.float16))
    n = w.size
    pw = P.palettize(w, nbits)
    q = mx.quantize(w, group_size=32, bits=affine_bits)
    mx.eval(pw.packed, pw.lut, *q)
    pal_bits = pw.nbytes * 8 / n
    aff_bits = sum(a.nbytes for a in q) * 8 / n
    assert abs(aff_bits - nbits) < 1e-9 and pal_bits <= aff_bits * 1.001     # the table: under 0.1% more

    def mse(d):
        return float(mx.mean((d.astype(mx.float32) - w.astype(mx.float32)) ** 2))
    pal = mse(pw.dequantize())
    aff = mse(mx.dequantize(*q, group_size=32, bits=affine_bits))
    assert pal < 0.6 * aff, (pal, aff)


# -- layers --------------------------------------------------------------------------------------------------------

def test_palettized_linear_is_the_matmul_with_its_decoded_weight(monkeypatch):
    """A PalettizedLinear (grouped tables, per-row scales, a bias) multiplies as x @ W.T + b with W its decoded
    weight, also when the CPU decodes it in several row chunks (chunks smaller than a group and across groups), and
    a row slice of it (linear_rows) gives those columns of the output."""
    monkeypatch.setattr(Q, "CHUNK_WEIGHTS", 1)
    monkeypatch.setattr(Q, "MIN_ROWS", 12)        # 12-row chunks of 8-row groups
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 16, (40, 33))
    lut = rng.standard_normal((5, 16)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, 40).astype(np.float32)
    bias = mx.array(rng.standard_normal(40).astype(np.float32))
    layer = P.PalettizedLinear.of(P.palettized(idx, lut, scale), bias)
    x = mx.array(rng.standard_normal((2, 3, 33)).astype(np.float32))
    dense = _numpy_dense(idx, lut, scale)
    want = np.array(x) @ dense.T + np.array(bias)
    got = np.array(layer(x))
    assert max_rel_err(got, want) <= 1e-5
    assert max_rel_err(np.array(Q.linear_rows(layer, 5, 29)(x)), want[..., 5:29]) <= 1e-5
    assert Q.linear_dims(layer) == (33, 40)


# -- a tiny SD 1.5: palettized while loading, converted, loaded back --------------------------------------------------

@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    from diffusers import StableDiffusionPipeline
    folder = tmp_path_factory.mktemp("sd15_pal")
    StableDiffusionPipeline(**sd15_components()).save_pretrained(str(folder))
    return folder



QUANTIZE = {"unet": "p4", "text_encoder": "p6:g4"}


def test_tiny_sd15_palettized_runs_as_its_decoded_weights_and_converts(sd15, tmp_path):
    """quantize={"unet": "p4", "text_encoder": "p6:g4"} makes the models' Linear layers PalettizedLinear; the UNet
    and the text encoder compute what the same models with the decoded dense weights compute (float32, 1e-5
    relative); mlxdiff.convert saves them palettized, loading the result gives the same arrays bit for bit, and the
    pipeline draws the same image from both."""
    pipe = mlxdiff.load(str(sd15), quantize=QUANTIZE)
    unet = _built(pipe, "unet")
    layers = [m for _, m in unet.named_modules() if isinstance(m, P.PalettizedLinear)]
    assert layers and not any(isinstance(m, nn.Linear) for _, m in unet.named_modules())
    assert all(m.nbits == 4 and m.lut.shape[0] == 1 for m in layers)
    rng = np.random.default_rng(1)
    sample = mx.array(rng.standard_normal((2, 4, 12, 10)).astype(np.float32))
    context = mx.array(rng.standard_normal((2, 7, 20)).astype(np.float32))
    t = mx.array([999.0, 17.0])
    held = {"unet": dict(tree_flatten(unet.parameters()))}
    got = unet(sample, t, context)
    assert max_rel_err(np.array(got), np.array(_densify(unet)(sample, t, context))) <= 1e-5

    encoder = _built(pipe, "text_encoder")
    enc_layers = [m for _, m in encoder.named_modules() if isinstance(m, P.PalettizedLinear)]
    assert enc_layers and all(m.nbits == 6 and m.group_size == 4 for m in enc_layers)
    held["text_encoder"] = dict(tree_flatten(encoder.parameters()))
    ids = mx.array(rng.integers(0, 49408, (1, 77)))
    got = encoder(ids)
    want = _densify(encoder)(ids)
    for a, b in ((got.last_hidden_state, want.last_hidden_state), (got.pooler_output, want.pooler_output)):
        assert max_rel_err(np.array(a), np.array(b)) <= 1e-5

    noise = np.random.default_rng(2).standard_normal((1, 4, 12, 10)).astype(np.float32)
    kw = dict(width=40, height=48, steps=2, latents=noise, progress_bar=False)
    before = pipe.generate("a red fox", **kw)
    dest = convert(str(sd15), tmp_path / "pal", quantize=QUANTIZE, progress=lambda *_: None)
    assert json.loads((dest / "unet" / "config.json").read_text())["quantization"] == {
        "mode": "palettize", "bits": 4, "group_size": None}
    after = mlxdiff.load(str(dest))
    for name in ("unet", "text_encoder"):
        loaded = dict(tree_flatten(_built(after, name).parameters()))
        assert loaded.keys() == held[name].keys()
        for k, v in held[name].items():
            assert loaded[k].dtype == v.dtype and np.array_equal(np.array(loaded[k]), np.array(v)), k
    image = after.generate("a red fox", **kw)
    assert np.array_equal(np.asarray(before.image), np.asarray(image.image))


def test_cli_settings():
    """--quantize takes palettized settings beside affine bits, checked by the one check; refusals are one line."""
    from mlxdiff.arguments import QuantizeSetting
    from mlxdiff.cli import parse_quantize
    assert parse_quantize("unet=p6:g16,text_encoder=8,vae=p4") == {
        "unet": QuantizeSetting(6, 16, "palettize"), "text_encoder": QuantizeSetting(8, 64),
        "vae": QuantizeSetting(4, None, "palettize")}
    assert parse_quantize("p8").as_dict() == {"mode": "palettize", "bits": 8, "group_size": None}
    for text, match in (("unet=p5", "5-bit palettization"), ("unet=p6:g0", "at least 1"),
                        ("unet=p6:16", "expected bits"), ("unet=q6", "expected bits")):
        with pytest.raises(MlxdiffError, match=match) as e:
            parse_quantize(text)
        assert "\n" not in str(e.value)


def test_group_size_must_divide_the_rows(sd15):
    with pytest.raises(MlxdiffError, match=r"quantize=p4:g7: layer .*group size 7 does not divide") as e:
        _built(mlxdiff.load(str(sd15), quantize={"unet": "p4:g7"}), "unet")
    assert "\n" not in str(e.value)


# -- resident bytes --------------------------------------------------------------------------------------------------

def test_resident_bytes_are_indices_and_tables(tmp_path):
    """A CLIP text encoder palettized while loading (p4, a table per 32 rows) holds, as MLX's active memory after
    the load, at most its packed indices plus tables plus the rest of its parameters as stored, plus 2%: the bytes
    derived from the layers' shapes."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel
    from mlxdiff.loading.quantize import setting
    from mlxdiff.loading.spec import ComponentSpec
    from mlxdiff.models import clip
    config = CLIPTextConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=4, max_position_embeddings=77, bos_token_id=0,
                            eos_token_id=2, pad_token_id=1)
    torch.manual_seed(0)
    CLIPTextModel(config).save_pretrained(str(tmp_path), safe_serialization=True)
    spec = ComponentSpec("text_encoder", clip, json.loads((tmp_path / "config.json").read_text()),
                         [tmp_path / "model.safetensors"], quantize=setting("p4:g32"))
    model = spec.build()     # lazy: its shapes only
    palettized = {path: m for path, m in model.named_modules() if isinstance(m, P.PalettizedLinear)}
    assert len(palettized) == 4 * 6
    expected = sum(m.weight.shape[0] * (P.row_bytes(m.in_dims, 4) + 4) + m.weight.shape[0] // 32 * 16 * 4
                   for m in palettized.values())                                 # indices, bias, tables
    expected += sum(v.nbytes for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[0] not in palettized)
    del model, palettized
    model, resident, _ = resident_after_build(spec)
    print(f"resident {resident} bytes, indices + tables + the rest {expected}")
    assert resident <= 1.02 * expected
