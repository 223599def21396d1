"""Footprint features: quantize-while-loading (memory equals the quantized bytes; streamed), mlxdiff checkpoints
(convert round trip), memory limits, and their bad input."""

import numpy as np
import pytest

import mlxdiff
import mlx.core as mx
import mlx.nn as nn
from mlxdiff.convert import convert
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading import sources
from mlxdiff.loading.quantize import materialize
from mlxdiff.models import mmdit


@pytest.fixture(scope="module")
def mid_transformer(tmp_path_factory):
    """An SD3 transformer big enough for memory figures to mean something (~53 M parameters, bf16)."""
    import torch
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=4, attention_head_dim=64,
                                  num_attention_heads=8, joint_attention_dim=256, caption_projection_dim=512,
                                  pooled_projection_dim=128, out_channels=16, pos_embed_max_size=16,
                                  dual_attention_layers=(0,), qk_norm="rms_norm").to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("mid_transformer")
    model.save_pretrained(str(folder))
    return folder


def _spec(folder, quantize=None):
    import json
    config = json.loads((folder / "config.json").read_text())
    return sources.ComponentSpec("transformer", mmdit, config, sources.st.safetensors_files(folder),
                                 quantize=quantize)


def _header_estimate(spec, bits, group=64):
    """Quantized bytes from the safetensors header alone: 2-D Linear weights outside the model's full-precision
    rule become bits/8 bytes per weight plus a bf16 scale and bias per group; everything else stays bf16."""
    from mlxdiff.formats.safetensors import check_safetensors
    total = 0
    for f in spec.files:
        for name, (_, shape) in check_safetensors(f).items():
            n = int(np.prod(shape))
            layer = name.rsplit(".", 1)[0]
            if (len(shape) == 2 and name.endswith(".weight") and not mmdit.FULL_PRECISION.fullmatch(layer)
                    and shape[-1] % group == 0):
                total += n * bits // 8 + n // group * 4
            else:
                total += n * 2
    return total


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_load_memory_equals_quantized_bytes(mid_transformer, bits):
    mx.clear_cache()
    base = mx.get_active_memory()
    spec = _spec(mid_transformer, {"bits": bits, "group_size": 64})
    model = spec.build()
    materialize(model)
    held = mx.get_active_memory() - base
    expected = _header_estimate(spec, bits)   # from the file header and the quantization rule, not from the model
    assert abs(held - expected) <= 0.05 * expected, (held, expected)
    assert abs(spec.loaded_nbytes() - expected) <= 0.05 * expected, (spec.loaded_nbytes(), expected)
    assert held < (bits / 16 + 0.1) * spec.nbytes()  # close to bits/16 of the bf16 size
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    model.clear()


def test_quantize_while_loading_streams(mid_transformer):
    """Peak during load <= quantized size + 1.5 x the largest layer: the bf16 model never exists at once."""
    from mlxdiff.formats.safetensors import check_safetensors, ITEMSIZE
    spec = _spec(mid_transformer, {"bits": 4, "group_size": 64})
    largest = max(ITEMSIZE[d] * int(np.prod(s)) for f in spec.files for d, s in check_safetensors(f).values())
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    model = spec.build()
    materialize(model)
    peak = mx.get_peak_memory() - base
    assert peak <= spec.loaded_nbytes() + 1.5 * largest, (peak, spec.loaded_nbytes(), largest)
    assert peak < 0.5 * spec.nbytes()
    model.clear()


def test_convert_round_trip(sd3_tiny, tmp_path):
    folder, _ = sd3_tiny
    noise = np.random.default_rng(0).standard_normal((1, 16, 20, 12)).astype(np.float32)
    kw = dict(width=24, height=40, steps=2, guidance=3.0, latents=noise, progress_bar=False)
    in_memory = mlxdiff.load(str(folder), quantize={"transformer": 8, "text_encoder_3": 4}).generate("a cat", **kw)
    dest = convert(str(folder), tmp_path / "converted", quantize={"transformer": 8, "text_encoder_3": 4},
                   progress=lambda *_: None)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    reloaded = mlxdiff.load(str(dest)).generate("a cat", **kw)
    assert np.array_equal(in_memory.latents, reloaded.latents)
    assert np.array_equal(np.asarray(in_memory.image), np.asarray(reloaded.image))
    with pytest.raises(MlxdiffError, match="already exists"):
        convert(str(folder), dest, progress=lambda *_: None)


def test_memory_limit_refuses_before_loading(sd3_tiny):
    folder, _ = sd3_tiny
    with pytest.raises(MlxdiffError, match="quantize it|no quantization"):   # 0.5 MB: smaller than the tiny T5
        mlxdiff.load(str(folder), memory_limit=0.0005).generate("a cat", width=24, height=40, steps=1,
                                                                 progress_bar=False)


def test_bad_quantize_and_limit_input(sd3_tiny):
    folder, _ = sd3_tiny
    with pytest.raises(MlxdiffError, match="unknown component 'unet'"):
        mlxdiff.load(str(folder), quantize={"unet": 4})
    with pytest.raises(MlxdiffError, match="7-bit"):
        mlxdiff.load(str(folder), quantize=7)
    with pytest.raises(MlxdiffError, match="positive"):
        mlxdiff.load(str(folder), memory_limit=0)
