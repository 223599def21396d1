"""Non-finite numbers in a model's small tensors (issue 30): a NaN or an infinity in a norm weight, a bias, a
BatchNorm statistic (FLUX.2's VAE `bn`), a float8 scale (ComfyUI's scaled-fp8 `scale_weight`, comfy_quant's
`weight_scale`) or a small float8 layer's codes is refused when the model is built (loading/build.check_finite,
formats/fp8.load), in one line naming the file and the tensor, instead of an all-black image with exit 0; a float
weight that the float16 compute dtype would make infinite says so. The embedded default model
(weights/klein-shapes) is copied and one tensor changed per case; each case also runs as `mlxdiff.generate` in a
forked child (tests/adversarial.py): exit 2, one line, no image.
"""

import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from adversarial import refused, run_cases  # noqa: E402
from helpers import computing_in  # noqa: E402

from mlxdiff import default_model  # noqa: E402
from mlxdiff.errors import MlxdiffError  # noqa: E402
import mlx.core as mx  # noqa: E402

CHEAP = ["--prompt", "a red circle", "--steps", "1", "--width", "16", "--height", "16", "--no-progress"]
VAE = "vae/diffusion_pytorch_model.safetensors"
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
TEXT = "text_encoder/model.safetensors"


def _edit(folder, file, key, fn):
    """The tensor `key` of `folder/file` replaced by fn(float32 copy), saved back in its dtype."""
    from safetensors.torch import load_file, save_file
    path = folder / file
    tensors = load_file(str(path))
    dtype = tensors[key].dtype
    value = tensors[key].float().clone()
    tensors[key] = fn(value).to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _set(value, index=0):
    def put(t):
        t.view(-1)[index] = value
        return t
    return put


# name -> (file, key, change, compute dtype, what the line must say)
CASES = {
    "VAE bn running_var inf": (VAE, "bn.running_var", _set(float("inf")), "float32", "holds NaN or infinite"),
    "VAE bn running_mean NaN": (VAE, "bn.running_mean", _set(float("nan"), 3), "float32", "holds NaN or infinite"),
    "VAE decoder norm NaN": (VAE, "decoder.conv_norm_out.weight", _set(float("nan")), "float32",
                             "holds NaN or infinite"),
    "transformer norm NaN": (TRANSFORMER, "transformer_blocks.0.attn.norm_q.weight", _set(float("nan")), "float32",
                             "holds NaN or infinite"),
    "transformer weight -inf": (TRANSFORMER, "single_transformer_blocks.1.attn.to_out.weight",
                                _set(float("-inf"), 7), "float32", "holds NaN or infinite"),
    "text encoder norm NaN": (TEXT, "model.layers.0.input_layernorm.weight", _set(float("nan")), "float32",
                              "holds NaN or infinite"),
    "VAE norm beyond float16": (VAE, "decoder.conv_norm_out.weight", _set(1e6), "float16",
                                "beyond float16's range"),
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """name -> a copy of the default model with that case's tensor changed."""
    root = tmp_path_factory.mktemp("nonfinite")
    out = {}
    for i, (name, (file, key, fn, _, _)) in enumerate(CASES.items()):
        folder = root / f"model-{i}"
        shutil.copytree(default_model.FOLDER, folder)
        _edit(folder, file, key, fn)
        out[name] = folder
    return root, out


def _component(file):
    return file.split("/")[0]


@pytest.mark.parametrize("name", list(CASES))
def test_built_model_refuses_nonfinite_small_tensors(broken, name):
    """The component's spec.build (every format goes through loading/build.build) refuses, naming the file and the
    tensor."""
    import mlxdiff
    _, folders = broken
    file, key, _, dtype, needle = CASES[name]
    pipe = mlxdiff.load(str(folders[name]), dtype=dtype)
    spec = pipe.components[_component(file)]
    with pytest.raises(MlxdiffError) as e:
        with computing_in(getattr(mx, dtype)):
            spec.build()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{folders[name] / file}: tensor {key!r}"), message
    assert needle in message, message


def test_generate_refuses_in_one_line(broken):
    """The same through the CLI: exit 2, one `mlxdiff: error:` line naming the file and the tensor, no image; the
    untouched default model still draws."""
    root, folders = broken
    cases = [{"cli": "mlxdiff.generate", "argv": ["--model", str(folders[name]), *CHEAP, "--dtype", CASES[name][3],
                                                  "--output", str(root / f"{i}.png")]}
             for i, name in enumerate(CASES)]
    cases.append({"cli": "mlxdiff.generate", "argv": ["--model", str(default_model.FOLDER), *CHEAP,
                                                      "--output", str(root / "good.png")]})
    outcomes = run_cases(cases, root)
    for i, (name, outcome) in enumerate(zip(CASES, outcomes)):
        file, key, _, _, needle = CASES[name]
        assert refused(outcome), (name, outcome.describe())
        line = outcome.stderr.strip()
        assert line.startswith(f"mlxdiff: error: {folders[name] / file}: tensor {key!r}"), line
        assert needle in line, line
        assert not (root / f"{i}.png").exists()
    assert outcomes[-1].rc == 0 and (root / "good.png").exists(), outcomes[-1].describe()


def test_stored_values_checked_before_building(broken):
    """loading/build.check_stored_values reads only the small tensors of the files and names the stored key, before
    any model is built; the untouched model's files pass."""
    from mlxdiff.loading.build import check_stored_values
    _, folders = broken
    check_stored_values([default_model.FOLDER / f for f in (VAE, TRANSFORMER, TEXT)])
    path = folders["VAE bn running_var inf"] / VAE
    with pytest.raises(MlxdiffError, match=r"diffusion_pytorch_model.safetensors: tensor 'bn.running_var' holds NaN"):
        check_stored_values([path])
    check_stored_values([path], prefix="decoder.")   # only the tensors under the prefix


# -- float8 files ----------------------------------------------------------------------------------------------

def _fp8_file(path, form, bad=None):
    """A small ComfyUI float8 file: two linear layers' weights float8_e4m3fn with float32 scales (scaled fp8's
    `scale_weight` + marker, or comfy_quant's `weight_scale` + JSON), a bf16 norm; `bad`: (tensor, value) put in."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    tensors, layers = {}, {}
    for layer in ("a.proj", "b.proj"):
        w = torch.randn(16, 32, generator=g)
        scale = w.abs().amax() / 448.0
        tensors[f"{layer}.weight"] = (w / scale).to(torch.float8_e4m3fn)
        if form == "scaled_fp8":
            tensors[f"{layer}.scale_weight"] = scale.reshape(()).float()
        else:
            tensors[f"{layer}.weight_scale"] = scale.reshape(()).float()
            tensors[f"{layer}.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
            layers[layer] = {"format": "float8_e4m3fn"}
    tensors["norm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    if form == "scaled_fp8":
        tensors["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    if bad:
        key, value = bad
        if tensors[key].dtype == torch.float8_e4m3fn:   # a code: 0x7F is e4m3fn's NaN
            codes = tensors[key].view(torch.uint8).clone()
            codes.view(-1)[5] = value
            tensors[key] = codes.view(torch.float8_e4m3fn)
        else:
            tensors[key] = torch.full_like(tensors[key], value)
    metadata = {"_quantization_metadata": json.dumps({"layers": layers})} if layers else None
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("form, bad, needle", [
    ("scaled_fp8", ("a.proj.scale_weight", float("nan")), "'a.proj.scale_weight' (a float8 scale) holds NaN"),
    ("scaled_fp8", ("b.proj.scale_weight", float("inf")), "'b.proj.scale_weight' (a float8 scale) holds NaN"),
    ("comfy_quant", ("b.proj.weight_scale", float("-inf")), "'b.proj.weight_scale' (a float8 scale) holds NaN"),
])
def test_fp8_scales_are_checked_where_read(tmp_path, form, bad, needle):
    """A float8 file's scales are read whole and checked finite by its reader (open_weights), naming the scale;
    the same file without the bad value reads."""
    from mlxdiff.formats import open_weights
    good = _fp8_file(tmp_path / "good.safetensors", form)
    assert set(open_weights(good)) == {"a.proj.weight", "b.proj.weight", "norm.weight"}
    path = _fp8_file(tmp_path / "bad.safetensors", form, bad)
    with pytest.raises(MlxdiffError) as e:
        open_weights(path)
    assert str(e.value).startswith(f"{path}: tensor ") and needle in str(e.value), str(e.value)


def test_fp8_nan_codes_in_small_layers(tmp_path):
    """A small float8 layer (kept at 8 bits, an Fp8Linear) whose codes hold e4m3fn's NaN is refused at build,
    naming the parameter; the good file builds, with Fp8Linear layers."""
    import mlx.nn as nn
    from mlxdiff.formats import open_weights
    from mlxdiff.formats.fp8 import Fp8Linear
    from mlxdiff.loading import build as build_module

    class Tiny(nn.Module):
        def __init__(self, args):
            super().__init__()
            self.a = {"proj": nn.Linear(32, 16, bias=False)}
            self.b = {"proj": nn.Linear(32, 16, bias=False)}
            self.norm = nn.RMSNorm(32)

        @staticmethod
        def sanitize(weights):
            return weights

    class Args:
        @classmethod
        def from_dict(cls, config):
            return cls()

    arch = type("arch", (), {"Model": Tiny, "ModelArgs": Args})
    good = _fp8_file(tmp_path / "good.safetensors", "scaled_fp8")
    model = build_module.build(arch, {}, open_weights(good), str(good))
    assert isinstance(model.a["proj"], Fp8Linear)
    bad = _fp8_file(tmp_path / "bad.safetensors", "scaled_fp8", ("b.proj.weight", 0x7F))
    with pytest.raises(MlxdiffError, match=r"bad.safetensors: tensor 'b.proj.weight' holds NaN or infinite"):
        build_module.build(arch, {}, open_weights(bad), str(bad))
