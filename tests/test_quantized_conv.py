"""Quantized convolutions (loading/quantize.QuantizedConv2d, PalettizedConv2d): the SD UNet's and VAE's 3x3 and 1x1
convolutions kept affine-quantized or palettized over their kernel's rows (out, kh*kw*in), decoded once per call.

References: mx.conv2d with the layer's decoded kernel (its own dense_weight, which is MLX's mx.dequantize or the
palettized decode over the rows, reshaped OHWI); for the UNet, the same UNet with every quantized layer replaced by a
plain layer holding its decoded weight.
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
from mlxdiff.formats import palettized as P
from mlxdiff.loading.quantize import MIN_CONV_CHANNELS, PalettizedConv2d, QuantizedConv2d
from mlxdiff.models.vae import Conv2d
from ldm_helpers import sd15_components
from quantized_helpers import QUANTIZED, _built, _densify, resident_after_build


def _conv(cin=32, cout=48, k=3, stride=1, padding=1, seed=0):
    mx.random.seed(seed)
    return Conv2d(cin, cout, k, stride=stride, padding=padding)


@pytest.mark.parametrize("make", ["affine4", "affine8", "p4", "p6:g16"])
@pytest.mark.parametrize("k,stride,padding", [(3, 1, 1), (3, 2, 1), (1, 1, 0)])
def test_conv_is_conv2d_with_its_decoded_kernel(make, k, stride, padding):
    """A quantized convolution equals mx.conv2d with its decoded kernel (float32, 1e-5 relative), banded or not;
    its kernel decodes to the rows of the quantization of the flattened kernel."""
    conv = _conv(k=k, stride=stride, padding=padding)
    rows = conv.weight.reshape(48, -1)
    if make.startswith("affine"):
        bits = int(make[6:])
        layer = QuantizedConv2d(conv, bits, 32)
        want_rows = mx.dequantize(*mx.quantize(rows, 32, bits), group_size=32, bits=bits)
    else:
        nbits, _, g = make[1:].partition(":g")
        pal = P.palettize(rows, int(nbits), int(g) if g else None)
        layer = PalettizedConv2d(conv, pal)
        want_rows = pal.dequantize()
    assert np.array_equal(np.array(layer.dense_weight()), np.array(want_rows.reshape(conv.weight.shape)))
    x = mx.random.normal((2, 13, 9, 32), key=mx.random.key(1))
    ref = mx.conv2d(x, layer.dense_weight(), stride=stride, padding=padding) + conv.bias
    assert max_rel_err(np.array(layer(x)), np.array(ref)) <= 1e-5
    layer.band_bytes = 4000                    # row bands: the same sums
    assert max_rel_err(np.array(layer(x)), np.array(ref)) <= 1e-5


def test_which_convolutions_are_quantized():
    """Convolutions whose flattened width the affine group does not divide, or with fewer than MIN_CONV_CHANNELS
    input or output channels (the image / latent ones), stay as they are; palettized ones need no width."""
    from mlxdiff.loading.quantize import conv_quantizable
    assert conv_quantizable(_conv(32, 48), 32) and not conv_quantizable(_conv(32, 48), 64)   # 288 columns
    assert conv_quantizable(_conv(32, 48), None, "palettize")
    assert not conv_quantizable(_conv(4, 320), None, "palettize")
    assert not conv_quantizable(_conv(320, 4), 64) and MIN_CONV_CHANNELS == 16
    assert not conv_quantizable(QuantizedConv2d(_conv(32, 48), 4, 32), 32)


# -- a tiny SD 1.5 pipeline ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """The tiny SD 1.5 pipeline of test_sd_pipeline with a UNet of 32 and 64 channels, so that an affine group of 32
    divides its convolutions' widths (288, 576, 32, 64)."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from helpers import randomize_
    parts = sd15_components()
    torch.manual_seed(0)
    parts["unet"] = UNet2DConditionModel(
        sample_size=12, in_channels=4, out_channels=4, block_out_channels=(32, 64), norm_num_groups=8,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=20, attention_head_dim=4)
    randomize_(parts["unet"], seed=10, scale=0.15)
    parts["unet"].eval()
    folder = tmp_path_factory.mktemp("sd15_qconv")
    StableDiffusionPipeline(**parts).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("quantize,kind", [("p4", PalettizedConv2d), ({"bits": 4, "group_size": 32}, QuantizedConv2d)])
def test_tiny_sd15_unet_runs_as_its_decoded_weights_and_converts(sd15, tmp_path, quantize, kind):
    """quantize={"unet": p4 | 4 bits (group 32)} makes every UNet convolution but conv_in and conv_out quantized;
    the UNet computes what the same UNet with the decoded dense weights computes (float32, 1e-5 relative);
    mlxdiff.convert saves it so, and loading the result gives the same arrays bit for bit, and the same image."""
    pipe = mlxdiff.load(str(sd15), quantize={"unet": quantize})
    unet = _built(pipe, "unet")
    convs = {p: m for p, m in unet.named_modules() if isinstance(m, nn.Conv2d)}
    assert not isinstance(convs.pop("conv_in"), QUANTIZED) and not isinstance(convs.pop("conv_out"), QUANTIZED)
    assert len(convs) > 10 and all(isinstance(m, kind) for m in convs.values()), \
        [p for p, m in convs.items() if not isinstance(m, kind)]
    rng = np.random.default_rng(1)
    sample = mx.array(rng.standard_normal((2, 4, 12, 10)).astype(np.float32))
    context = mx.array(rng.standard_normal((2, 7, 20)).astype(np.float32))
    t = mx.array([999.0, 17.0])
    held = dict(tree_flatten(unet.parameters()))
    got = unet(sample, t, context)
    assert max_rel_err(np.array(got), np.array(_densify(unet)(sample, t, context))) <= 1e-5

    noise = np.random.default_rng(2).standard_normal((1, 4, 12, 10)).astype(np.float32)
    kw = dict(width=40, height=48, steps=2, latents=noise, progress_bar=False)
    before = pipe.generate("a red fox", **kw)
    dest = convert(str(sd15), tmp_path / "q", quantize={"unet": quantize}, progress=lambda *_: None)
    assert "quantization" in json.loads((dest / "unet" / "config.json").read_text())
    after = mlxdiff.load(str(dest))
    reloaded = _built(after, "unet")
    assert all(isinstance(m, kind) for p, m in reloaded.named_modules() if p in convs)
    loaded = dict(tree_flatten(reloaded.parameters()))
    assert loaded.keys() == held.keys()
    for k, v in held.items():
        assert loaded[k].dtype == v.dtype and np.array_equal(np.array(loaded[k]), np.array(v)), k
    image = after.generate("a red fox", **kw)
    assert np.array_equal(np.asarray(before.image), np.asarray(image.image))


def test_vae_convolutions_quantized_but_the_image_and_latent_ones(sd15):
    """vae=8 (group 32: the tiny VAE's 8-16 channels) and vae=p8: the VAE decodes as the VAE on its decoded weights;
    its conv_in / conv_out / quant_conv / post_quant_conv (3, 4 or 8 channels) stay full precision."""
    for quantize in ({"bits": 8, "group_size": 32}, "p8"):
        vae = _built(mlxdiff.load(str(sd15), quantize={"vae": quantize}), "vae")
        kept = [p for p, m in vae.named_modules() if isinstance(m, nn.Conv2d) and not isinstance(m, QUANTIZED)]
        assert all(p.rsplit(".", 1)[-1] in ("conv_in", "conv_out", "quant_conv", "post_quant_conv")
                   or min(m.weight.shape[0], m.weight.shape[-1]) < MIN_CONV_CHANNELS
                   or m.weight[0].size % 32 for p, m in vae.named_modules() if p in kept)
        if quantize == "p8":
            assert any(isinstance(m, PalettizedConv2d) for _, m in vae.named_modules())
        z = mx.array(np.random.default_rng(3).standard_normal((1, 4, 6, 5)).astype(np.float32))
        got = vae.decode(z)
        want = _densify(vae).decode(z)
        assert max_rel_err(np.array(got), np.array(want)) <= 1e-5


# -- resident bytes --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantize", ["p4", {"bits": 4, "group_size": 32}])
def test_resident_bytes_are_codes_and_tables(sd15, quantize):
    """A UNet quantized while loading holds, as MLX's active memory after the load, at most its quantized layers'
    codes / indices plus scales / tables plus its other parameters as stored, plus 2%: bytes from shapes; plus the
    fixed overhead (about 50 kB, measured here) that the same UNet loaded unquantized holds beyond its parameters."""

    def resident(spec):
        model, held, _ = resident_after_build(spec)
        return held, model

    plain, model = resident(mlxdiff.load(str(sd15)).components["unet"])
    overhead = plain - sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    del model
    pipe = mlxdiff.load(str(sd15), quantize={"unet": quantize})
    spec = pipe.components["unet"]
    model = spec.build()     # lazy: its shapes only
    expected = 0
    for path, m in model.named_modules():
        if isinstance(m, PalettizedConv2d):
            out, cols = m.kernel_shape[0], m.in_cols
            expected += out * P.row_bytes(cols, 4) + 16 * 4 + out * 4                      # indices, table, bias
        elif isinstance(m, QuantizedConv2d):
            out, cols = m.kernel_shape[0], m.in_cols
            expected += out * cols // 2 + 2 * out * cols // 32 * 4 + out * 4              # codes, scales+biases, bias
    quantized = {p for p, m in model.named_modules() if isinstance(m, QUANTIZED)}
    assert quantized
    expected += sum(v.nbytes for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[0] not in quantized)
    del model
    held, model = resident(spec)
    print(f"resident {held} bytes, codes + tables + the rest {expected}, overhead {overhead}")
    assert held <= 1.02 * expected + max(overhead, 0)


def test_lora_on_quantized_convolutions(sd15, tmp_path):
    """A kohya LoCon on a UNet whose convolutions are quantized (p4) wraps the quantized conv (its kernel shape read
    from the layer, not its stored rows) and computes what the same LoRA on the decoded dense UNet computes (the
    LoRA on a dense conv is tests/test_lora_unet.py's, against diffusers)."""
    from safetensors.numpy import save_file
    from mlxdiff import lora
    rng = np.random.default_rng(7)
    file = tmp_path / "locon.safetensors"
    save_file({"lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight":
               (rng.standard_normal((3, 32, 3, 3)) * 0.2).astype(np.float32),
               "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight":
               (rng.standard_normal((32, 3, 1, 1)) * 0.2).astype(np.float32),
               "lora_unet_down_blocks_0_resnets_0_conv1.alpha": np.array(2.0, np.float32),
               "lora_unet_up_blocks_1_resnets_0_conv2.lora_down.weight":
               (rng.standard_normal((2, 32, 3, 3)) * 0.2).astype(np.float32),
               "lora_unet_up_blocks_1_resnets_0_conv2.lora_up.weight":
               (rng.standard_normal((32, 2, 1, 1)) * 0.2).astype(np.float32)}, str(file))
    pipe = mlxdiff.load(str(sd15), quantize={"unet": "p4"}, loras=[(str(file), 0.8)])
    unet = _built(pipe, "unet")
    wrapped = [p for p, m in unet.named_modules() if isinstance(m, lora.LoRAConv)]
    assert len(wrapped) == 2 and isinstance(unet.down_blocks[0].resnets[0].conv1.base, PalettizedConv2d)
    rng = np.random.default_rng(1)
    sample = mx.array(rng.standard_normal((1, 4, 12, 10)).astype(np.float32))
    context = mx.array(rng.standard_normal((1, 7, 20)).astype(np.float32))
    t = mx.array([500.0])
    got = np.array(unet(sample, t, context))
    plain = _built(mlxdiff.load(str(sd15), quantize={"unet": "p4"}), "unet")
    without = np.array(plain(sample, t, context))
    dense = _densify(plain)              # (in place)
    lora.apply_loras(dense, pipe.components["unet"].arch, [(str(file), 0.8)], component="unet")
    assert max_rel_err(got, np.array(dense(sample, t, context))) <= 1e-5
    assert max_rel_err(got, without) > 1e-3     # the LoRA does change the output
