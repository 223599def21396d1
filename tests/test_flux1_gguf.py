"""A FLUX.1 transformer GGUF (BFL names, as city96's FLUX.1 files) read with its weights kept quantized, against a
float64 diffusers reference built from gguf-py's own dequantization of the same file: Q4_K_M's mix, and Q8_0 and
Q4_0 throughout, in both of mlxdiff's layouts (MLX affine, the file's raw blocks). The single blocks' linear1 is
split into q, k, v and the MLP while still quantized."""

import dataclasses
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from helpers import max_rel_err, randomize_
from mlxdiff.formats.gguf import RawLinear
from mlxdiff.loading import sources
from mlxdiff.models import flux1
from flux1_helpers import GGUF_CONFIG as CONFIG, diffusers_converter, gguf_inputs as inputs
from gguf_helpers import SCALE, dequantized, torch_state, write_city96_gguf
from twins import flux1_to_bfl

MIXES = ("Q4_K_M", "Q8_0", "Q4_0")


def torch_forward(model, x):
    import torch
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v).to(torch.float64) for k, v in x.items()},
                     return_dict=False)[0].numpy()


def write_gguf(path, tensors, mix):
    """Q4_K_M: city96's mix (tests/test_gguf_models.py); Q8_0 / Q4_0: every 2-D tensor outside the kept embedders
    and final layer in that type, the rest F32."""
    if mix == "Q4_K_M":
        return write_city96_gguf(path, tensors, "flux2", "flux")     # its keep-list names FLUX.1's embedders too
    from gguf import GGUFWriter
    from gguf_helpers import encode
    qtype = {"Q8_0": T.Q8_0, "Q4_0": T.Q4_0}[mix]
    writer, types = GGUFWriter(str(path), "flux"), {}
    for name, value in tensors.items():
        kept = value.ndim != 2 or name.startswith(("img_in.", "txt_in.", "vector_in.", "final_layer."))
        types[name] = T.F32 if kept else qtype
        if kept:
            writer.add_tensor(name, np.asarray(value, np.float32))
        else:
            writer.add_tensor(name, encode(np.asarray(value, np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


@pytest.fixture(scope="module", params=MIXES)
def gguf_file(request, tmp_path_factory):
    import torch
    from diffusers import FluxTransformer2DModel
    root = tmp_path_factory.mktemp(f"flux1_gguf_{request.param}")
    torch.manual_seed(11)
    model = randomize_(FluxTransformer2DModel(**CONFIG), seed=11, scale=SCALE).eval()
    model.save_pretrained(str(root / "folder"))
    original = {k: v.numpy() for k, v in flux1_to_bfl(torch_state(model), CONFIG).items()}
    path = root / f"flux1-tiny-{request.param}.gguf"
    types = write_gguf(path, original, request.param)
    # the reference: gguf-py's dequantization, through diffusers' own FLUX.1 converter, in float64
    reference = FluxTransformer2DModel(**CONFIG)
    converted = diffusers_converter(256)({k: torch.from_numpy(v) for k, v in dequantized(path).items()})
    reference.load_state_dict(converted)
    return request.param, path, types, reference.double().eval(), model.double(), root / "folder"


@pytest.mark.parametrize("layout", ["affine", "raw"])
def test_gguf_parity_against_float64(gguf_file, layout):
    mix, path, types, reference, original, folder = gguf_file
    x = inputs(seed=1)
    ref = torch_forward(reference, x)
    spec = dataclasses.replace(sources.transformer_from_file(path, flux1), gguf_layout=layout)
    saved = json.loads((folder / "config.json").read_text())
    for key, value in spec.config.items():      # the config read off the GGUF's shapes is the twin's
        assert saved[key] == (list(value) if isinstance(value, tuple) else value), key
    model = spec.build()
    kind = nn.QuantizedLinear if layout == "affine" else RawLinear
    quantized = [n for n, t in types.items() if t not in (T.F32, T.F16, T.BF16)]
    # a quantized qkv makes three layers, a quantized linear1 four (q, k, v, the MLP)
    expected = sum(3 if ".qkv." in n else 4 if ".linear1." in n else 1 for n in quantized)
    assert sum(isinstance(m, kind) for _, m in model.named_modules()) == expected
    ours = np.array(model(**{k: mx.array(v) for k, v in x.items()}).astype(mx.float32), np.float64)
    err = max_rel_err(ours, ref)
    moved = max_rel_err(torch_forward(original, x), ref)
    print(f"{mix} ({layout}): max_rel_err vs float64 {err:.2e}; the quantization itself moves it {moved:.2e}")
    assert err <= 1e-4
    assert moved > 100 * max(err, 1e-6)   # the file's values, not the twin's, are what agree
