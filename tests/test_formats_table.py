"""The weight formats' table (mlxdiff/formats/table.py): which row claims a path (by suffix, then by the checked
header), that the rows of one suffix differ only in their readers, that a safetensors header is parsed once per
read, and that the readers reached through the table give what the files hold (offsets and shapes from the files'
own headers, read here with gguf-py and json, and tensors against torch's)."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mlxdiff import formats
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import safetensors as st
from mlxdiff.formats.table import COREML, FORMATS, FP8, GGUF, SAFETENSORS, WeightFormat, format_of

from .gguf_helpers import T, write_gguf

READERS = {"name", "open", "loaded_nbytes", "standins", "claims"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    g = torch.Generator().manual_seed(0)
    plain = {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g)}
    save_file(plain, root / "plain.safetensors")
    save_file(plain, root / "plain.bin")   # any other suffix is read as safetensors (the gate decides)
    fp8 = {"a.weight": torch.randn(4, 6, generator=g).to(torch.float8_e4m3fn),
           "a.scale_weight": torch.tensor(0.5), "scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn),
           "b.bias": torch.randn(7, generator=g)}
    save_file(fp8, root / "fp8.safetensors")
    rng = np.random.default_rng(1)
    gguf = {"x.weight": (T.F32, rng.standard_normal((3, 32)).astype(np.float32)),
            "y.weight": (T.F16, rng.standard_normal((2, 64)).astype(np.float16))}
    write_gguf(root / "m.gguf", gguf)
    (root / "unet.mlpackage").mkdir()
    return dict(root=root, plain=plain, fp8=fp8, gguf=gguf)


def test_each_path_is_claimed_by_its_row(files):
    root = files["root"]
    assert format_of(root / "plain.safetensors") is SAFETENSORS
    assert format_of(root / "plain.bin") is SAFETENSORS
    assert format_of(root / "fp8.safetensors") is FP8
    assert format_of(root / "fp8.safetensors", header=False) is SAFETENSORS   # by the path alone: nothing read
    assert format_of(root / "m.gguf") is GGUF
    assert format_of(root / "unet.mlpackage") is COREML
    assert format_of(root / "absent.gguf", header=False) is GGUF   # a path-only claim reads nothing
    assert formats.is_gguf(root / "m.gguf") and not formats.is_gguf(root / "fp8.safetensors")
    assert formats.is_coreml(root / "unet.mlpackage") and not formats.is_coreml(root / "m.gguf")
    assert formats.WEIGHT_SUFFIXES == (".safetensors", ".gguf")
    assert formats.PACKAGE_WHATS == ("transformer file",)


def test_rows_of_one_suffix_differ_only_in_their_readers():
    """What format_of(path, header=False) relies on: every field but the readers and the claim is the suffix's."""
    assert len({f.name for f in FORMATS}) == len(FORMATS)
    for fmt in FORMATS:
        for other in FORMATS:
            if other.suffix == fmt.suffix:
                for key in WeightFormat.__dataclass_fields__.keys() - READERS:
                    assert getattr(fmt, key) == getattr(other, key), (fmt.name, other.name, key)
    claimed_first = [f for f in FORMATS if f.claims is not None]
    for fmt in claimed_first:   # a claiming row comes before its suffix's plain row
        plain = next(f for f in FORMATS if f.suffix == fmt.suffix and f.claims is None)
        assert FORMATS.index(fmt) < FORMATS.index(plain)


def test_a_safetensors_header_is_parsed_once_per_read(files, monkeypatch):
    calls = []
    real = st._read_header
    monkeypatch.setattr(st, "_read_header", lambda path: calls.append(path) or real(path))
    for name in ("plain.safetensors", "fp8.safetensors"):
        for read in (formats.open_weights, formats.loaded_nbytes, formats.tensor_shapes, formats.tensor_nbytes,
                     formats.tensor_ranges):
            calls.clear()
            read(files["root"] / name)
            assert len(calls) == 1, (name, read.__name__)


def _safetensors_header(path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0], tuple(v["shape"]))
            for k, v in header.items()}


def test_safetensors_readers_give_the_files_tensors(files):
    root = files["root"]
    for name, tensors in (("plain.safetensors", files["plain"]), ("fp8.safetensors", files["fp8"])):
        path = root / name
        header = _safetensors_header(path)
        assert formats.tensor_ranges(path) == {k: (off, n) for k, (off, n, _) in header.items()}
        assert {k: v.shape for k, v in formats.tensor_shapes(path).items()} == {k: s for k, (_, _, s) in
                                                                                 header.items()}
        assert formats.tensor_nbytes(path) == {k: n for k, (_, n, _) in header.items()}
    opened = formats.open_weights(root / "plain.safetensors", names={"a.weight"})
    assert list(opened) == ["a.weight"]
    np.testing.assert_array_equal(np.array(opened["a.weight"]), files["plain"]["a.weight"].numpy())
    assert formats.loaded_nbytes(root / "plain.safetensors") == sum(t.numel() * 4 for t in files["plain"].values())
    # fp8: the marker and the scale consumed, the weight kept at 8 bits with its scale (decoded: torch's, times it)
    opened = formats.open_weights(root / "fp8.safetensors")
    assert set(opened) == {"a.weight", "b.bias"}
    weight = opened["a.weight"]
    expected = files["fp8"]["a.weight"].to(torch.float32).numpy() * 0.5
    decoded = np.array(formats.fp8.decode(weight.codes, weight.scale))
    np.testing.assert_array_equal(decoded, expected)
    assert formats.loaded_nbytes(root / "fp8.safetensors") == 4 * 6 + 4 * 4 + 7 * 4   # codes, row scales, bias


def test_gguf_readers_give_the_files_tensors(files):
    from gguf import GGUFReader
    path = files["root"] / "m.gguf"
    reader = GGUFReader(str(path))
    assert formats.tensor_ranges(path) == {t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    assert {k: v.shape for k, v in formats.tensor_shapes(path).items()} == \
        {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    opened = formats.open_weights(path)
    for name, (_, array) in files["gguf"].items():
        np.testing.assert_array_equal(np.array(opened[name]), array)
    standins = formats.open_weights(path, standins=True)
    assert {k: v.shape for k, v in standins.items()} == {k: v.shape for k, v in opened.items()}
    assert formats.loaded_nbytes(path) == 3 * 32 * 4 + 2 * 64 * 2


def test_a_core_ml_package_is_named_by_its_targets_and_read_whole(files):
    path = files["root"] / "unet.mlpackage"
    for read in (lambda: formats.open_weights(path), lambda: formats.loaded_nbytes(path)):
        with pytest.raises(MlxdiffError, match="named after the traced module"):
            read()
    with pytest.raises(MlxdiffError, match="not read by byte ranges"):
        formats.tensor_ranges(path)
    with pytest.raises(MlxdiffError, match="not streamed block by block"):
        formats.open_weights(path, standins=True, targets={})
