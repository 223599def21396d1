"""Core ML packages (formats/coreml.py): packages made here by coremltools (ct.convert of traced torch modules, then
palettize_weights in every form it makes), read by mlxdiff without coremltools, compared with coremltools' own
decompression (decompress_weights) bit for bit; a tiny diffusers UNet from a palettized package against diffusers on
the decompressed weights; bad packages refused in one line."""

import json
import shutil
import struct
import warnings

import numpy as np
import pytest

import mlxdiff  # noqa: F401
import mlx.core as mx

from coreml_helpers import UNET, convert_small, palettized_unet, small_inputs, small_model, tiny_unet
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import coreml

import coremltools as ct              # the dev extra installs it (and scikit-learn, its k-means): no skip
import sklearn  # noqa: F401
import torch
from coremltools.optimize.coreml import (OpLinearQuantizerConfig, OpPalettizerConfig, OptimizationConfig,  # noqa: E402
                                         decompress_weights, get_weights_metadata, linear_quantize_weights,
                                         palettize_weights)

warnings.filterwarnings("ignore")

NBITS = (1, 2, 3, 4, 6, 8)
# (name, deployment target, palettizer options): every form coremltools 9 makes
CASES = ([(f"ios16-{n}bit", None, dict(nbits=n)) for n in (1, 2, 4, 6, 8)]           # iOS 16: no 3-bit tables
         + [(f"tensor-{n}bit", "iOS18", dict(nbits=n)) for n in NBITS]
         + [(f"grouped-{n}bit", "iOS18", dict(nbits=n, granularity="per_grouped_channel", group_size=4))
            for n in NBITS]
         + [("grouped-axis1", "iOS18", dict(nbits=3, granularity="per_grouped_channel", group_size=2, channel_axis=1)),
            ("scale-ios18", "iOS18", dict(nbits=4, enable_per_channel_scale=True)),
            ("scale-grouped", "iOS18", dict(nbits=6, granularity="per_grouped_channel", group_size=4,
                                            enable_per_channel_scale=True)),
            ("scale-ios26", "iOS26", dict(nbits=4, enable_per_channel_scale=True)),
            ("vector", "iOS18", dict(nbits=2, cluster_dim=2)),
            ("uniform", "iOS18", dict(nbits=4, mode="uniform"))])
ROW_TABLES = {name for name, _, o in CASES if "channel_axis" not in o and "cluster_dim" not in o
              and "enable_per_channel_scale" not in o}


@pytest.fixture(scope="module")
def small():
    model = small_model()
    return model, {target: convert_small(model, target) for target in (None, "iOS18", "iOS26")}


def _reference(mlmodel) -> dict:
    """coremltools' own decompression: {const name: numpy}."""
    return {k: v.val for k, v in get_weights_metadata(decompress_weights(mlmodel), weight_threshold=0).items()}


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype == np.float16 else a


def _assert_exact(ours: dict, ref: dict):
    assert ours, "no weights read"
    for name, value in ours.items():
        dense = value.dense() if isinstance(value, coreml.LutWeight) else value
        assert name in ref, name
        assert dense.dtype == ref[name].dtype and dense.shape == ref[name].shape, name
        assert np.array_equal(_bits(dense), _bits(ref[name])), f"{name} differs from decompress_weights"
    # every float weight coremltools decompresses is one we read
    floats = {k for k, v in ref.items() if v.dtype in (np.float16, np.float32) and v.ndim}
    assert floats == set(ours)


@pytest.mark.parametrize("name,target,options", CASES, ids=[c[0] for c in CASES])
def test_palettized_equals_decompress_weights(small, tmp_path, name, target, options):
    _, converted = small
    config = OpPalettizerConfig(weight_threshold=0, **{"mode": "kmeans", **options})
    mlmodel = palettize_weights(converted[target], OptimizationConfig(global_config=config))
    mlmodel.save(str(tmp_path / "m.mlpackage"))
    ours = coreml.read(tmp_path / "m.mlpackage")
    luts = [v for v in ours.values() if isinstance(v, coreml.LutWeight)]
    assert len(luts) == 3 and all(v.nbits == options["nbits"] for v in luts)
    _assert_exact(ours, _reference(mlmodel))
    # formats/palettized's form where the tables are per rows: its decode is the same weight, bit for bit
    for v in luts:
        p = v.palettized()
        assert (p is not None) == (name in ROW_TABLES), name
        if p is not None:
            assert np.array_equal(_bits(np.array(p.dequantize())).reshape(v.shape), _bits(v.dense()))


def test_joint_int8_tables(small, tmp_path):
    """Palettized then its tables linearly quantized to int8 (joint compression): shift_scale feeding the lut."""
    _, converted = small
    pal = palettize_weights(converted["iOS18"], OptimizationConfig(
        global_config=OpPalettizerConfig(mode="kmeans", nbits=4, weight_threshold=0)))
    joint = linear_quantize_weights(pal, OptimizationConfig(global_config=OpLinearQuantizerConfig(
        mode="linear_symmetric", dtype="int8", granularity="per_tensor", weight_threshold=0)), joint_compression=True)
    joint.save(str(tmp_path / "j.mlpackage"))
    _assert_exact(coreml.read(tmp_path / "j.mlpackage"), _reference(joint))


def test_small_model_outputs(small, tmp_path):
    """The package's weights (palettized, grouped; decoded by formats/palettized in MLX) give the torch module's
    outputs on coremltools' decompressed weights."""
    model, converted = small
    mlmodel = palettize_weights(converted["iOS18"], OptimizationConfig(global_config=OpPalettizerConfig(
        mode="kmeans", nbits=6, granularity="per_grouped_channel", group_size=4, weight_threshold=0)))
    mlmodel.save(str(tmp_path / "m.mlpackage"))
    targets = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = coreml.read_diffusers(tmp_path / "m.mlpackage", targets)
    ref = _reference(mlmodel)
    x, y = small_inputs()

    def f32(v):
        if isinstance(v, coreml.LutWeight):
            p = v.palettized(conv_nhwc=True)
            return np.array(p.dequantize()).astype(np.float32).reshape(p.shape)
        return v.astype(np.float32)
    w = {k: f32(v) for k, v in ours.items()}
    h = mx.maximum(mx.array(x.numpy()) @ mx.array(w["a.weight"]).T + mx.array(w["a.bias"]), 0)
    out1 = h @ mx.array(w["b.weight"]).T
    out2 = mx.conv2d(mx.array(y.numpy()).transpose(0, 2, 3, 1), mx.array(w["conv.weight"]), padding=1) \
        + mx.array(w["conv.bias"])

    reference = type(model)().eval()
    by_name = {coreml._base(k)[:-len("_weight")]: v for k, v in ref.items() if coreml._base(k).endswith("_weight")}
    with torch.no_grad():
        for layer in ("a", "b", "conv"):
            getattr(reference, layer).weight.copy_(torch.from_numpy(by_name[layer].astype(np.float32)))
        reference.a.bias.copy_(model.a.bias.half().float())
        reference.conv.bias.copy_(model.conv.bias.half().float())
        e1, e2 = reference(x, y)
    assert max_rel_err(np.array(out1), e1.numpy()) < 1e-4
    assert max_rel_err(np.array(out2).transpose(0, 3, 1, 2), e2.numpy()) < 1e-4


# -- a tiny diffusers UNet --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def unet_package(tmp_path_factory):
    unet = tiny_unet()
    mlmodel = palettized_unet(unet, nbits=6, weight_threshold=0)
    path = tmp_path_factory.mktemp("coreml") / "unet.mlpackage"
    mlmodel.save(str(path))
    return unet, path, _reference(mlmodel)


def test_unet_names_and_outputs(unet_package):
    from diffusers import UNet2DConditionModel
    from mlxdiff.models import unet as unet_mod

    unet, path, ref = unet_package
    sd = unet.state_dict()
    ours = coreml.read_diffusers(path, {k: tuple(v.shape) for k, v in sd.items()}, prefix="unet_")
    assert set(ours) == set(sd)
    palettized = [k for k, v in ours.items() if isinstance(v, coreml.LutWeight)]
    assert len(palettized) > 20 and all(k.endswith(".weight") for k in palettized)
    dense = {k: (v.dense() if isinstance(v, coreml.LutWeight) else v) for k, v in ours.items()}
    for k, v in dense.items():
        if k not in palettized:   # a float weight the converter kept: the module's own, in float16
            assert np.array_equal(_bits(v), _bits(sd[k].numpy().astype(np.float16))), k
    # the palettized weights are decompress_weights' under the traced names
    for k in palettized:
        const = ours[k].name
        assert np.array_equal(_bits(dense[k]), _bits(ref[const])), k

    reference = UNet2DConditionModel(**UNET).eval()
    reference.load_state_dict({k: torch.from_numpy(ref[ours[k].name].astype(np.float32)) if k in palettized
                               else torch.from_numpy(v.astype(np.float32)) for k, v in dense.items()})
    model = unet_mod.Model(unet_mod.ModelArgs.from_dict(dict(reference.config)))
    weights = {k: mx.array(v.astype(np.float32)) for k, v in dense.items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)

    rng = np.random.default_rng(2)
    sample = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    context = rng.standard_normal((1, 5, 20)).astype(np.float32)
    t = np.array([321.0], np.float32)
    with torch.no_grad():
        expected = reference(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context)).sample.numpy()
    got = np.array(model(mx.array(sample), mx.array(t), mx.array(context), None))
    assert max_rel_err(got, expected) < 1e-4


def test_unet_wrong_names_refused(unet_package):
    unet, path, _ = unet_package
    targets = {k: tuple(v.shape) for k, v in unet.state_dict().items()}
    with pytest.raises(MlxdiffError, match="not found by name"):
        coreml.read_diffusers(path, targets, prefix="")        # the wrapper's prefix missing: no names match
    bad = dict(targets)
    bad["conv_in.weight"] = (16, 4, 5, 5)
    with pytest.raises(MlxdiffError, match="conv_in.weight expects"):
        coreml.read_diffusers(path, bad, prefix="unet_")


# -- refusals -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def package(small, tmp_path_factory):
    _, converted = small
    mlmodel = palettize_weights(converted["iOS18"], OptimizationConfig(global_config=OpPalettizerConfig(
        mode="kmeans", nbits=4, weight_threshold=0)))
    path = tmp_path_factory.mktemp("coreml_bad") / "good.mlpackage"
    mlmodel.save(str(path))
    return path


def _copy(package, tmp_path):
    dst = tmp_path / "copy.mlpackage"
    shutil.copytree(package, dst)
    return dst, dst / "Data" / "com.apple.CoreML" / "weights" / "weight.bin", \
        dst / "Data" / "com.apple.CoreML" / "model.mlmodel"


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value) and "Traceback" not in str(excinfo.value)
    return str(excinfo.value)


def _read_all(path):
    return coreml.decode_all(coreml.read(path))


def test_refuse_not_a_package(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"nothing")
    with pytest.raises(MlxdiffError) as e:
        coreml.read(f)
    assert "not a Core ML package" in _one_line(e)
    with pytest.raises(MlxdiffError, match="no such Core ML package"):
        coreml.read(tmp_path / "missing.mlpackage")
    (tmp_path / "c.mlmodelc").mkdir()
    (tmp_path / "c.mlmodelc" / "model.mil").write_text("program(1.0)")
    with pytest.raises(MlxdiffError, match="compiled Core ML model"):
        coreml.read(tmp_path / "c.mlmodelc")


def test_refuse_truncated_blob(package, tmp_path):
    pkg, blob, _ = _copy(package, tmp_path)
    data = blob.read_bytes()
    blob.write_bytes(data[:len(data) - 100])
    with pytest.raises(MlxdiffError) as e:
        _read_all(pkg)
    msg = _one_line(e)
    assert str(blob) in msg and "truncated" in msg and ("runs past" in msg or "outside" in msg)
    blob.write_bytes(data[:40])
    with pytest.raises(MlxdiffError, match="shorter than its 64-byte header"):
        _read_all(pkg)


def test_refuse_bad_blob_metadata(package, tmp_path):
    pkg, blob, _ = _copy(package, tmp_path)
    data = bytearray(blob.read_bytes())
    struct.pack_into("<I", data, 64, 0x12345678)          # the first blob's sentinel
    blob.write_bytes(bytes(data))
    with pytest.raises(MlxdiffError) as e:
        _read_all(pkg)
    assert "no blob metadata at offset 64" in _one_line(e)
    data = bytearray(package.joinpath("Data/com.apple.CoreML/weights/weight.bin").read_bytes())
    struct.pack_into("<Q", data, 64 + 16, len(data) * 4)  # its data offset, out of range
    blob.write_bytes(bytes(data))
    with pytest.raises(MlxdiffError, match="runs past the weight file"):
        _read_all(pkg)


def test_refuse_offset_out_of_range(package, tmp_path):
    pkg, blob, model = _copy(package, tmp_path)
    spec = ct.utils.load_spec(str(package))
    f = spec.mlProgram.functions["main"]
    for op in f.block_specializations[f.opset].operations:
        if op.type == "constexpr_lut_to_dense":
            op.inputs["indices"].arguments[0].value.blobFileValue.offset = 1 << 40
            break
    model.write_bytes(spec.SerializeToString())
    with pytest.raises(MlxdiffError) as e:
        _read_all(pkg)
    assert "outside the weight file" in _one_line(e)


# (what one flipped or overwritten byte of model.mlmodel made of a const's val in the fuzzer's runs (seed 7, 300
# mutants of the small base before it was deterministic; "type": seed 2's #894 of 1000 on the UNet): coremltools'
# loader refuses each; the expected words of our one line)
MALFORMED_CONSTS = {"docstring": "docString", "no value": "has no value", "count": "has 1 elements, its type says 2",
                    "rank": "gives rank 1 for 0 dimensions", "type": "has a value of no type"}


@pytest.mark.parametrize("edit", list(MALFORMED_CONSTS))
def test_refuse_malformed_const(package, tmp_path, edit):
    """A const's val whose immediateValue became a docString (field 3 -> 1) or is gone, an immediate of fewer
    elements than its type's shape (a conv's dilations [1, 1] -> [147]), a weight's type whose dimensions are gone
    but not its rank, or a val without a type: refused in one line naming the file (and the const where it is
    known), as coremltools' loader refuses it."""
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
    from coremltools.proto import MIL_pb2
    pkg, _, model = _copy(package, tmp_path)
    spec = ct.utils.load_spec(str(package))
    f = spec.mlProgram.functions["main"]
    consts = [op for op in f.block_specializations[f.opset].operations if op.type == "const"]
    if edit == "count":
        const = next(op for op in consts if len(op.attributes["val"].immediateValue.tensor.ints.values) == 2)
        del const.attributes["val"].immediateValue.tensor.ints.values[1:]
    elif edit == "rank":
        const = next(op for op in consts if op.attributes["val"].HasField("immediateValue")    # the conv's bias
                     and op.attributes["val"].type.tensorType.dataType == MIL_pb2.FLOAT16
                     and op.attributes["val"].type.tensorType.rank == 1)
        del const.attributes["val"].type.tensorType.dimensions[:]
    else:                # a string const (a conv's pad_type): not a weight, yet a value coremltools loads
        const = next(op for op in consts if op.attributes["val"].type.tensorType.dataType == MIL_pb2.STRING)
        val = const.attributes["val"]
        if edit == "type":
            val.ClearField("type")
        else:
            if edit == "docstring":
                val.docString = val.immediateValue.SerializeToString().decode("latin-1")
            val.ClearField("immediateValue")
    model.write_bytes(spec.SerializeToString())
    with pytest.raises(MlxdiffError) as e:
        coreml.read(pkg)
    msg = _one_line(e)
    assert str(model) in msg and MALFORMED_CONSTS[edit] in msg
    if edit != "rank":
        assert const.outputs[0].name in msg
    mlmodel = ct.models.MLModel(str(pkg), skip_model_load=True)
    with pytest.raises(Exception):      # the reference: coremltools' program loader refuses it too
        milproto_load(mlmodel.get_spec(), spec.specificationVersion, mlmodel.weights_dir)


def test_refuse_garbled_program(package, tmp_path):
    pkg, _, model = _copy(package, tmp_path)
    data = model.read_bytes()
    model.write_bytes(data[:len(data) // 2])
    with pytest.raises(MlxdiffError) as e:
        coreml.read(pkg)
    assert str(model) in _one_line(e)
    model.write_bytes(bytes([0x0A, 0x05]) + b"abc")       # a field running past the message
    with pytest.raises(MlxdiffError) as e:
        coreml.read(pkg)
    _one_line(e)
    model.write_bytes(b"\x08\x09")                         # a Model without an ML program
    with pytest.raises(MlxdiffError, match="not an ML program"):
        coreml.read(pkg)


def test_refuse_unknown_op(small, tmp_path):
    """Sparse weights (constexpr_sparse_to_dense) are not read: one line naming the op."""
    _, converted = small
    from coremltools.optimize.coreml import OpThresholdPrunerConfig, prune_weights
    pruned = prune_weights(converted["iOS18"], OptimizationConfig(global_config=OpThresholdPrunerConfig(
        threshold=0.2, minimum_sparsity_percentile=0.0, weight_threshold=0)))
    pruned.save(str(tmp_path / "p.mlpackage"))
    with pytest.raises(MlxdiffError) as e:
        coreml.read(tmp_path / "p.mlpackage")
    assert "constexpr_sparse_to_dense" in _one_line(e) and "does not read" in str(e.value)


def test_unpack_bits_order():
    """Core ML's bit order (MIL.proto's constexpr_lut_to_dense example): 2-bit i0..i4 = 0, 3, 2, 1, 3 in bytes
    0b01_10_11_00, 0bxxxxxx_11."""
    got = coreml.unpack_bits(np.array([0b01101100, 0b00000011], np.uint8), 2, 5)
    assert got.tolist() == [0, 3, 2, 1, 3]
    # 3-bit values straddling bytes: 5, 6, 7 -> bits 101 110 111 (LSB first) = 0b1_110_101, 0b11
    assert coreml.unpack_bits(np.array([0b11110101, 0b00000001], np.uint8), 3, 3).tolist() == [5, 6, 7]


def test_manifest_names_the_model(package, tmp_path):
    """The root item comes from Manifest.json (another path than the usual one is followed)."""
    pkg, _, model = _copy(package, tmp_path)
    manifest = json.loads((pkg / "Manifest.json").read_text())
    root = manifest["rootModelIdentifier"]
    assert manifest["itemInfoEntries"][root]["path"] == "com.apple.CoreML/model.mlmodel"
    assert set(coreml.read(pkg)) == set(coreml.read(package))


def test_packages_same_with_passes_checked_once(tmp_path):
    """coreml_helpers has coremltools check its program once after its graph passes instead of after each (the
    tests' conversions ran a third faster): a model converted, then palettized (a second pass pipeline), is the
    same bytes either way, so the tests' packages are what coremltools writes."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
    from coreml_helpers import save_package
    once = PassPipelineManager.apply_pipeline
    assert getattr(once, "checked_once", False), "coreml_helpers' pass pipeline is not installed"
    palettizing = OptimizationConfig(global_config=OpPalettizerConfig(mode="uniform", nbits=4, weight_threshold=0))

    def build(tag):
        mlmodel = convert_small(small_model())
        return [save_package(m, tmp_path / f"{tag}_{i}.mlpackage")
                for i, m in enumerate((mlmodel, palettize_weights(mlmodel, palettizing)))]

    checked_once = build("once")
    PassPipelineManager.apply_pipeline = staticmethod(once.each_pass)
    try:
        checked_each = build("each")
    finally:
        PassPipelineManager.apply_pipeline = staticmethod(once)
    for a, b in zip(checked_once, checked_each):
        files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
        for name in files:
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"{a.name}: {name} differs"
