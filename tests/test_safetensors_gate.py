"""The safetensors gate: every corrupt file is refused with MlxdiffError before mx.load sees it, and a shard
index names files inside its folder only. (tests/test_reader_fuzz.py runs the seeded mutants.)"""

import builtins
import io
import json
import os
import struct
from pathlib import Path

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.safetensors import check_safetensors, load_folder, load_safetensors, safetensors_files


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


def test_negative_zero_in_a_header_is_refused_as_safetensors_refuses_it(tmp_path):
    """`-0` is 0 to Python's json but not an unsigned integer to safetensors' own parser (a seeded fuzzer mutant
    of a zero-size tensor's shape, bench/fuzz_readers.py --format safetensors --seed 11, #1231)."""
    import safetensors
    save_file({"e": np.zeros((0, 4), np.float32), "a": np.ones(3, np.float32)}, str(tmp_path / "z.safetensors"))
    raw = (tmp_path / "z.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8:8 + n].decode()
    assert '"shape":[0,4]' in text
    text = text.replace('"shape":[0,4]', '"shape":[-0,4]')
    mutant = tmp_path / "negative-zero.safetensors"
    mutant.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + n:])
    with pytest.raises(safetensors.SafetensorError, match="-0"):     # the reference
        safetensors.deserialize(mutant.read_bytes())
    with pytest.raises(MlxdiffError, match="negative"):
        load_safetensors(mutant)


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


# ---------------------------------------------------------------------------------------------------------------
# Issue 13: what an outside tester found (each a traceback or a silent wrong load before), then the shard index


def _refused(path, match):
    with pytest.raises(MlxdiffError, match=match) as e:
        load_safetensors(path)
    message = str(e.value)
    assert str(path) in message and "\n" not in message, message
    return message


def _raw_file(path, header_text: bytes, data=b""):
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + data)
    return path


@pytest.mark.parametrize("where", ["metadata", "shape", "root"])
def test_deep_nesting_is_refused(tmp_path, where):
    deep = b"[" * 100_000 + b"]" * 100_000
    text = {"metadata": b'{"__metadata__": {"k": ' + deep + b"}}",
            "shape": b'{"a": {"dtype": "U8", "shape": ' + deep + b', "data_offsets": [0, 0]}}',
            "root": b'{"a": ' * 1000 + b"1" + b"}" * 1000}[where]
    _refused(_raw_file(tmp_path / "deep.safetensors", text), "nested too deeply")


@pytest.mark.parametrize("digits", [25, 4301, 100_000])
def test_huge_integer_literal_is_refused(tmp_path, digits):
    text = b'{"a": {"dtype": "U8", "shape": [' + b"9" * digits + b'], "data_offsets": [0, 0]}}'
    _refused(_raw_file(tmp_path / "huge.safetensors", text), f"a {digits}-digit integer")


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, 4, None, True])
def test_dtype_that_is_not_a_string_is_refused(tmp_path, dtype):
    path = _write(tmp_path / "dtype.safetensors", {"a": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}},
                  b"\0" * 4)
    _refused(path, "dtype that is not a string")


@pytest.mark.parametrize("field, value, match", [
    ("shape", [1.0], "not an integer"), ("shape", ["1"], "invalid shape"), ("shape", [True], "invalid shape"),
    ("shape", {"0": 1}, "invalid shape"), ("shape", [1] * 9, "invalid shape"),
    ("data_offsets", [0.0, 4], "not an integer"), ("data_offsets", ["0", 4], "invalid data offsets"),
    ("data_offsets", [0, 4, 4], "invalid data offsets"), ("data_offsets", None, "invalid data offsets")])
def test_field_types_are_checked_before_use(tmp_path, field, value, match):
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    header["a"][field] = value
    _refused(_write(tmp_path / "field.safetensors", header, b"\0" * 4), match)


@pytest.mark.parametrize("meta", [{"k": 1}, {"k": None}, {"k": {"a": "b"}}, ["k", "v"], "kv"])
def test_metadata_must_map_strings_to_strings(tmp_path, meta):
    path = _write(tmp_path / "meta.safetensors", {"__metadata__": meta, "a": {"dtype": "U8", "shape": [1],
                                                                              "data_offsets": [0, 1]}}, b"\0")
    _refused(path, "__metadata__ must map strings to strings")


@pytest.mark.parametrize("shape", [[0, 2 ** 32 + 5], [0, 2 ** 31], [2 ** 31, 0], [0, 2 ** 64 - 1]])
def test_zero_element_tensor_with_a_wrapping_dimension_is_refused(tmp_path, shape):
    """mx.load reads dims as int32: [0, 2**32 + 5] came back as (0, 5), [0, 2**31] as (0, -2147483648)."""
    path = _write(tmp_path / "wrap.safetensors", {"a": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}}, b"")
    _refused(path, "invalid shape")


def test_largest_dimension_mlx_holds_loads(tmp_path):
    path = _write(tmp_path / "ok.safetensors", {"a": {"dtype": "U8", "shape": [0, 2 ** 31 - 1],
                                                      "data_offsets": [0, 0]}}, b"")
    assert load_safetensors(path)["a"].shape == (0, 2 ** 31 - 1)


@pytest.mark.parametrize("dtype, torch_dtype", [("F8_E8M0", "float8_e8m0fnu"), ("F8_E4M3", "float8_e4m3fn")])
def test_float8_types_are_decoded_exactly(tmp_path, dtype, torch_dtype):
    """Every one of the 256 codes, against torch's decoding (F8_E8M0 came back as its raw exponent codes)."""
    torch = pytest.importorskip("torch")
    codes = bytes(range(256))
    path = _write(tmp_path / "f8.safetensors", {"a": {"dtype": dtype, "shape": [16, 16], "data_offsets": [0, 256]}},
                  codes)
    got = load_safetensors(path)["a"]
    assert got.dtype == mx.bfloat16 and got.shape == (16, 16)
    ours = np.array(got.astype(mx.float32)).ravel()
    want = torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(getattr(torch, torch_dtype)).float().numpy()
    assert np.array_equal(ours, want, equal_nan=True)
    number = ~np.isnan(want)
    assert np.array_equal(np.signbit(ours[number]), np.signbit(want[number]))   # -0 stays -0


def test_what_mlx_reads_must_match_the_checked_header(good, monkeypatch):
    """mx.load parses the header a second time (nlohmann-json): a disagreement is refused, never returned."""
    real = mx.load
    monkeypatch.setattr(mx, "load", lambda p: {**real(p), "stray": mx.zeros(1)})
    _refused(good, "MLX read the header differently")
    monkeypatch.setattr(mx, "load", lambda p: {k: v.reshape(-1) for k, v in real(p).items()})
    _refused(good, "MLX read tensor 'a' as")


def _shards(tmp_path, weight_map, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    save_file({"x": np.ones((2, 3), np.float32)}, str(folder / "m-1.safetensors"))
    index = folder / "m.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 24}, "weight_map": weight_map}))
    return folder, index


def _index_refused(folder, index, match, *parts):
    with pytest.raises(MlxdiffError, match=match) as e:
        safetensors_files(folder)
    message = str(e.value)
    assert str(index) in message and "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message


@pytest.mark.parametrize("weight_map, match", [
    (["m-1.safetensors"], "no weight_map"), ({}, "no weight_map"), ("m-1.safetensors", "no weight_map"),
    ({"x": 1}, "not a file name"), ({"x": None}, "not a file name"), ({"x": ["m-1.safetensors"]}, "not a file name"),
    ({"x": "m-1.bin"}, "not a relative .safetensors path"), ({"x": "/abs/m-1.safetensors"}, "not a relative"),
    ({"x": "m\0.safetensors"}, "not a relative")])
def test_index_weight_map_is_validated(tmp_path, weight_map, match):
    folder, index = _shards(tmp_path, weight_map)
    _index_refused(folder, index, match)


def test_index_that_is_not_json_or_nests_too_deep(tmp_path):
    folder, index = _shards(tmp_path, {"x": "m-1.safetensors"})
    index.write_text('{"weight_map": ' + "[" * 5000 + "]" * 5000 + "}")
    _index_refused(folder, index, "nested too deeply")
    index.write_text('{"metadata": {"total_size": ' + "9" * 5000 + "}}")
    _index_refused(folder, index, "5000-digit integer")
    index.write_bytes(b'{"weight_map": {"x": "\xff.safetensors"}}')
    _index_refused(folder, index, "not UTF-8")


def test_index_path_escaping_the_folder_is_refused(tmp_path):
    """`../outside.safetensors` was loaded from outside the model folder."""
    folder, index = _shards(tmp_path, {"x": "m-1.safetensors", "y": "../outside.safetensors"})
    save_file({"y": np.zeros(4, np.float32)}, str(tmp_path / "outside.safetensors"))
    _index_refused(folder, index, "points outside", "'y'", "'../outside.safetensors'")
    with pytest.raises(MlxdiffError, match="points outside"):
        load_folder(folder)
    index.write_text(json.dumps({"weight_map": {"x": "m-1.safetensors", "y": "a/../../outside.safetensors"}}))
    _index_refused(folder, index, "points outside", "'a/../../outside.safetensors'")
    index.write_text(json.dumps({"weight_map": {"x": "a/../m-1.safetensors", "y": "./m-1.safetensors"}}))
    assert safetensors_files(folder) == [folder / "m-1.safetensors"]   # one file, however it is spelled
    save_file({"y": np.zeros(4, np.float32)}, str(folder / "..y.safetensors"))   # a name, not a parent
    index.write_text(json.dumps({"weight_map": {"x": "m-1.safetensors", "y": "..y.safetensors"}}))
    assert sorted(load_folder(folder)) == ["x", "y"]


def test_index_symlink_escape_is_refused(tmp_path):
    """A path inside the folder that a symlink (a file's or a directory's) takes outside it."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({"y": np.zeros(4, np.float32)}, str(outside / "y.safetensors"))
    folder, index = _shards(tmp_path, {"x": "m-1.safetensors", "y": "sub/y.safetensors"})
    (folder / "sub").symlink_to(outside, target_is_directory=True)
    _index_refused(folder, index, "points outside", "'sub/y.safetensors'")
    index.write_text(json.dumps({"weight_map": {"x": "m-1.safetensors", "y": "y.safetensors"}}))
    (folder / "y.safetensors").symlink_to(outside / "y.safetensors")
    _index_refused(folder, index, "points outside", "'y.safetensors'")


def test_index_into_a_hugging_face_cache_snapshot_loads(tmp_path):
    """A cache snapshot's files are symlinks to ../../blobs/<hash> (outside the component folder, by design)."""
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    folder = repo / "snapshots" / "0123abcd" / "transformer"
    folder.mkdir(parents=True)
    save_file({"x": np.ones((2, 3), np.float32)}, str(repo / "blobs" / "3f2a"))
    (folder / "m-1.safetensors").symlink_to("../../../blobs/3f2a")
    (folder / "m.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "m-1.safetensors"}}))
    assert sorted(load_folder(folder)) == ["x"]


def test_index_escape_is_refused_before_anything_is_opened(tmp_path, monkeypatch):
    """`../../../etc/passwd` was opened (and failed as a safetensors file) before being refused: now no path an
    index names is opened, or even stat-ed, before every entry has passed."""
    folder, index = _shards(tmp_path, {"x": "m-1.safetensors", "y": "../../../etc/passwd"})
    opened = []
    real_open = io.open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    monkeypatch.setattr(mx, "load", lambda p: pytest.fail(f"mx.load({p}) called"))
    _index_refused(folder, index, "not a relative .safetensors path", "'../../../etc/passwd'")
    with pytest.raises(MlxdiffError):
        load_folder(folder)
    index.write_text(json.dumps({"weight_map": {"x": "m-1.safetensors", "y": "../../../etc/passwd.safetensors"}}))
    _index_refused(folder, index, "points outside")
    assert all(Path(p) == index for p in opened), opened


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file")
