"""The safetensors gate: every corrupt file is refused with MlxdiffError before mx.load sees it."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.safetensors import check_safetensors, load_safetensors, load_folder


def _write(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.safetensors"
    save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float16)}, str(path))
    return path


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_good_file_loads_lazily_and_exactly(good):
    arrays = load_safetensors(good)
    assert np.array_equal(np.array(arrays["a"]), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert check_safetensors(good) == {"a": ("F32", (3, 4)), "b": ("F16", (5,))}


def _mutants(good, tmp_path):
    header, data = _header(good)
    a0, a1 = header["a"]["data_offsets"]
    cases = {}
    cases["truncated"] = good.read_bytes()[:-3]
    cases["trailing bytes"] = good.read_bytes() + b"\0" * 8
    cases["short file"] = b"\x01\x02"
    cases["header too long"] = struct.pack("<Q", 2 ** 62) + b"{}"
    cases["not json"] = struct.pack("<Q", 4) + b"{{{{"
    mutants = {
        "shifted offsets": ("a", "data_offsets", [a0 + 8, a1 + 8]),
        "reversed offsets": ("a", "data_offsets", [a1, a0]),
        "impossible shape": ("a", "shape", [2 ** 32, 2 ** 32]),
        "shape too small": ("a", "shape", [2, 4]),
        "negative dim": ("a", "shape", [-1, 4]),
        "unknown dtype": ("a", "dtype", "F99"),
        "float64": ("a", "dtype", "F64"),
    }
    for label, (key, field, value) in mutants.items():
        h = json.loads(json.dumps(header))
        h[key][field] = value
        cases[label] = h
    h = json.loads(json.dumps(header))
    h["b"]["data_offsets"] = h["a"]["data_offsets"][:]  # b aliases a's bytes
    h["b"]["shape"], h["b"]["dtype"] = [12], "F32"
    cases["overlapping"] = h
    out = {}
    for label, case in cases.items():
        path = tmp_path / f"{label.replace(' ', '_')}.safetensors"
        if isinstance(case, bytes):
            path.write_bytes(case)
        else:
            _write(path, case, data)
        out[label] = path
    return out


def test_corrupt_files_are_refused(good, tmp_path):
    for label, path in _mutants(good, tmp_path).items():
        with pytest.raises(MlxdiffError) as e:
            load_safetensors(path)
        assert str(path) in str(e.value), label
        assert "\n" not in str(e.value), label


def test_random_header_mutations_never_load_silently_wrong(good, tmp_path):
    """Flip header bytes many times: each result is a clean MlxdiffError or exactly the original tensors."""
    raw = bytearray(good.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    rng = np.random.default_rng(0)
    reference = {k: np.array(v) for k, v in load_safetensors(good).items()}
    path = tmp_path / "m.safetensors"
    accepted = 0
    for _ in range(300):
        m = bytearray(raw)
        for pos in rng.integers(0, 8 + n, size=rng.integers(1, 4)):
            m[pos] = int(rng.integers(0, 256))
        path.write_bytes(bytes(m))
        try:
            arrays = load_safetensors(path)
        except MlxdiffError:
            continue
        accepted += 1
        # accepted mutants may only differ in harmless ways (e.g. whitespace); never in names, shapes or values
        got = {k: np.array(v) for k, v in arrays.items()}
        assert got.keys() == reference.keys()
        for k in got:
            assert got[k].dtype == reference[k].dtype and np.array_equal(got[k], reference[k])
    assert accepted < 300


def test_sharded_index(tmp_path):
    save_file({"x": np.ones((2, 3), np.float32)}, str(tmp_path / "m-00001-of-00002.safetensors"))
    save_file({"y": np.zeros((4,), np.float32)}, str(tmp_path / "m-00002-of-00002.safetensors"))
    index = {"weight_map": {"x": "m-00001-of-00002.safetensors", "y": "m-00002-of-00002.safetensors"}}
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(index))
    weights = load_folder(tmp_path)
    assert sorted(weights) == ["x", "y"] and weights["x"].shape == (2, 3)
    (tmp_path / "m-00002-of-00002.safetensors").unlink()
    with pytest.raises(MlxdiffError, match="missing"):
        load_folder(tmp_path)
