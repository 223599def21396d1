"""What every family's files tests check, shared by tests/test_krea2_files.py, tests/test_flux3_single_files.py and
tests/test_qwenimage21_files.py (no test module imports another): a transformer file in ComfyUI's layout (names
under `model.diffusion_model.`, and its fp8_e4m3fn variant: the blocks' 2-D weights cast to float8, unscaled, as
ComfyUI's `*_fp8_e4m3fn.safetensors` are), the weights a loaded pipeline's component holds (float8 layers decoded),
a run streamed under --memory-limit against the resident one, convert's round trip and the CLI against the API."""

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

import mlxdiff
import mlx.core as mx
from mlx.utils import tree_flatten

from mlxdiff.convert import convert
from mlxdiff.formats import fp8
from mlxdiff.generate import main
from mlxdiff.memory import GB

PREFIX = "model.diffusion_model."
STREAMED = "blocks streamed from the file"


def comfy_files(state: dict, folder, stem, quantized) -> tuple:
    """`state` (the file's own names, float32 torch tensors) written as ComfyUI's `<stem>.safetensors` (under
    PREFIX) and `<stem>_fp8_e4m3fn.safetensors` (the 2-D weights whose name `quantized` takes cast to float8
    e4m3fn, no scale). Returns (the two paths, {name: float32 decoded} of the fp8 file, the fp8 names)."""
    plain, cast = folder / f"{stem}.safetensors", folder / f"{stem}_fp8_e4m3fn.safetensors"
    save_file({PREFIX + k: v.contiguous() for k, v in state.items()}, str(plain))
    tensors, decoded, names = {}, {}, []
    for name, value in state.items():
        if value.ndim == 2 and name.endswith(".weight") and quantized(name):
            value = value.to(torch.float8_e4m3fn)
            names.append(name)
        tensors[PREFIX + name], decoded[name] = value.contiguous(), value.float()
    save_file(tensors, str(cast))
    return (plain, cast), decoded, names


def weights(pipe, name="transformer") -> tuple:
    """({parameter: float32 numpy} of `pipe`'s built component, each Fp8Linear's weight decoded (codes x scale),
    the names of its Fp8Linear layers)."""
    with pipe.use(pipe.components[name]) as model:
        layers = {path for path, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}
        params = dict(tree_flatten(model.parameters()))
        out = {}
        for key, value in params.items():
            layer, leaf = key.rsplit(".", 1)
            if layer in layers and leaf == "weight_scale":
                continue
            if layer in layers and leaf == "weight":
                value = fp8.decode(value, params[layer + ".weight_scale"])
            out[key] = np.array(value.astype(mx.float32))
    return out, layers


def assert_same_weights(got: dict, want: dict, what):
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:6])
    differ = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not differ, (what, differ[:6])


def streamed_run(folder, prompt, run, need_bytes, share=0.7, **load):
    """mlxdiff's run of `prompt` from `folder` resident and under a memory limit of `share` x the transformer's
    `need_bytes` (its blocks streamed from the file: the load's note says so); returns (resident, streamed)."""
    resident = mlxdiff.load(str(folder), dtype="float32", **load).generate(prompt, **run)
    assert not any(STREAMED in n for n in resident.notes), resident.notes
    streamed = mlxdiff.load(str(folder), dtype="float32", memory_limit=share * need_bytes / GB, **load).generate(
        prompt, **run)
    assert any(STREAMED in n and n.startswith("transformer") for n in streamed.notes), streamed.notes
    return resident, streamed


def assert_identical(a, b, what):
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)), what
    assert np.array_equal(np.asarray(a.latents), np.asarray(b.latents)), what


def converted_run(folder, dest, prompt, run, **kw):
    """mlxdiff.convert of `folder` to `dest` (`kw`: quantize=, transformer=) loaded back: its run of `prompt`."""
    out = convert(str(folder), dest, progress=lambda *_: None, **kw)
    assert (out / "model_index.json").is_file()
    return mlxdiff.load(str(out)).generate(prompt, **run)


def cli_image(args, out) -> np.ndarray:
    """`mlxdiff.generate` (the CLI's main) with `args`, its PNG at `out`: the image as RGB(A) numpy."""
    assert main([*map(str, args), "--output", str(out), "--no-progress"]) == 0
    return np.asarray(Image.open(out))
