"""float8 safetensors files as ComfyUI writes them (formats/fp8.py), their weights kept at 8 bits:

- scaled fp8 (the `scaled_fp8` marker, `<layer>.scale_weight`, maybe `<layer>.scale_input`), and
- comfy_quant (`<layer>.weight_scale`, `<layer>.comfy_quant` JSON bytes, `_quantization_metadata` in the header),

for a FLUX.2 transformer in BFL names with ComfyUI's `model.diffusion_model.` prefix, given to a tiny klein
pipeline folder as `transformer=`; the blocks' linear layers fp8 with a per-tensor float32 scale, the embedders,
final layer and norms bf16, as in ComfyUI's files. The reference is diffusers' model loaded (from_single_file) with
the decoded weights, float32(fp8) x scale, which is how ComfyUI defines them (quant_ops.TensorCoreFP8Layout).
"""

import json

import numpy as np
import pytest

import mlxdiff
import mlx.core as mx
import mlx.nn as nn

from helpers import computing_in, max_rel_err, randomize_
from mlxdiff.formats import fp8 as fp8_reader, loaded_nbytes, open_weights, tensor_nbytes
from mlxdiff.formats.fp8 import Fp8Linear
from mlxdiff.formats.quantized import Float8Weight
from mlxdiff.loading import sources
from mlxdiff.loading.quantize import materialize
from mlxdiff.models import flux2
from twins import H, SEQ, TAPS, W, build_pipeline, flux2_to_bfl
from fp8_helpers import PREFIX, _quantized_layers, comfy_file


def torch_forward(model, inputs):
    import torch
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)[0]
    return out.double().numpy()


def mlx_forward(model, inputs):
    return np.array(model(**{k: mx.array(v) for k, v in inputs.items()}).astype(mx.float32), np.float64)


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """(a tiny klein pipeline folder, its transformer config, a float32 twin of that transformer in BFL names)."""
    import torch
    root = tmp_path_factory.mktemp("fp8")
    _, folder, pipe = build_pipeline("klein_base", root)
    config = dict(pipe.transformer.config)
    bfl = {k: v.detach().float().contiguous() for k, v in flux2_to_bfl(pipe.transformer.state_dict(),
                                                                       config).items()}
    return folder, config, bfl, root


@pytest.mark.parametrize("form", ["scaled_fp8", "comfy_quant"])
def test_flux2_comfy_fp8_matches_the_decoded_weights(klein, form):
    """mlxdiff.load(folder, transformer=ComfyUI fp8 file): the fp8 linear layers become Fp8Linear holding the
    file's bytes, the bf16 ones stay Linear, and the forward matches diffusers with the decoded weights."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file
    folder, config, bfl, root = klein
    decoded, path = comfy_file(bfl, root / f"flux2-klein-{form}.safetensors", form)
    float_file = root / f"decoded-{form}.safetensors"
    save_file({k: v.contiguous() for k, v in decoded.items()}, str(float_file))
    reference = Flux2Transformer2DModel.from_single_file(str(float_file), config=str(folder / "transformer"),
                                                         local_files_only=True, torch_dtype=torch.float32).eval()

    pipe = mlxdiff.load(str(folder), transformer=str(path))
    spec = pipe.components["transformer"]
    model = spec.build()
    fp8_layers = [m for _, m in model.named_modules() if isinstance(m, Fp8Linear)]
    # every quantized BFL layer, the fused qkv split into q, k, v (2 streams x 3 - 2 fused tensors)
    n_quantized = len(_quantized_layers(bfl))
    n_qkv = sum(1 for k in _quantized_layers(bfl) if k.endswith("attn.qkv"))
    assert len(fp8_layers) == n_quantized + 2 * n_qkv
    assert all(m["weight"].dtype == mx.uint8 and m["weight_scale"].dtype == mx.float32 for m in fp8_layers)
    assert isinstance(model.x_embedder, nn.Linear) and model.x_embedder.weight.dtype == mx.bfloat16

    rng = np.random.default_rng(3)
    n_img, n_txt = 6, 5
    inputs = dict(hidden_states=rng.standard_normal((1, n_img, config["in_channels"])).astype(np.float32),
                  encoder_hidden_states=rng.standard_normal((1, n_txt, config["joint_attention_dim"]))
                  .astype(np.float32),
                  timestep=np.array([0.7], np.float32),
                  img_ids=rng.integers(0, 4, (1, n_img, 4)).astype(np.int32),
                  txt_ids=rng.integers(0, 4, (1, n_txt, 4)).astype(np.int32))
    ref = torch_forward(reference, inputs)
    ours = mlx_forward(model, inputs)
    err = max_rel_err(ours, ref)
    print(f"{form}: max rel err {err:.2e} against diffusers with the decoded weights")
    assert err <= 1e-4
    # bfloat16 compute: the scales stay float32 (only the decoded weight is rounded, as ComfyUI's bf16 dequantize)
    with computing_in(mx.bfloat16):
        half = spec.build()
    layer = next(m for _, m in half.named_modules() if isinstance(m, Fp8Linear))
    assert layer["weight_scale"].dtype == mx.float32 and layer["weight"].dtype == mx.uint8
    out = half(**{k: mx.array(v) for k, v in inputs.items()})
    assert out.dtype == mx.bfloat16
    half_err = max_rel_err(np.array(out.astype(mx.float32), np.float64), ref)
    print(f"{form} in bfloat16: max rel err {half_err:.2e}")
    assert half_err <= 5e-2


def test_klein_pipeline_with_fp8_transformer_and_its_conversion(klein, tmp_path):
    """The klein pipeline (CFG, 2 steps) with a comfy_quant fp8 transformer gives the latents of the same folder
    holding the decoded weights in float32 (within float32 rounding), and mlxdiff.convert of it writes the fp8
    layers as they are held (8 bits), which load back as Fp8Linear and give the same latents."""
    import shutil
    import torch
    from diffusers import Flux2Transformer2DModel
    from mlxdiff.convert import convert
    folder, _, bfl, root = klein
    decoded, path = comfy_file(bfl, tmp_path / "klein-fp8mixed.safetensors", "comfy_quant")
    reference_folder = tmp_path / "reference"
    shutil.copytree(folder, reference_folder)
    Flux2Transformer2DModel.from_single_file(str(_save(decoded, tmp_path / "decoded.safetensors")),
                                             config=str(folder / "transformer"), local_files_only=True,
                                             torch_dtype=torch.float32).save_pretrained(
        str(reference_folder / "transformer"))
    noise = np.random.default_rng(4).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    run = dict(width=W, height=H, steps=2, guidance=3.5, latents=noise, max_sequence_length=SEQ,
               text_encoder_out_layers=TAPS, progress_bar=False)
    prompt = "a red fox in the snow"
    reference = mlxdiff.load(str(reference_folder)).generate(prompt, **run)
    ours = mlxdiff.load(str(folder), transformer=str(path)).generate(prompt, **run)
    err = max_rel_err(ours.latents, reference.latents)
    unrounded = max_rel_err(mlxdiff.load(str(folder)).generate(prompt, **run).latents, reference.latents)
    print(f"klein pipeline with an fp8 transformer: latents {err:.2e} from the decoded weights (the folder's own "
          f"float32 weights, before fp8 rounding: {unrounded:.2e})")
    assert err <= 1e-4 and unrounded > 1e-3   # (the comparison can tell fp8 rounding apart)

    converted = convert(str(folder), tmp_path / "converted", transformer=str(path), progress=lambda *_: None)
    stored = tensor_nbytes(converted / "transformer" / "model.safetensors")
    assert stored["transformer_blocks.0.attn.to_q.weight"] == bfl["double_blocks.0.img_attn.qkv.weight"].numel() // 3
    again = mlxdiff.load(str(converted))
    model = again.components["transformer"].build()
    assert sum(isinstance(m, Fp8Linear) for _, m in model.named_modules()) > 0
    err = max_rel_err(again.generate(prompt, **run).latents, ours.latents)
    assert err <= 1e-5


def _save(tensors, path):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_markers_and_scales_never_reach_the_model(klein, tmp_path):
    """open_weights folds the scales into Float8Weight and drops the marker, scale, input-scale and comfy_quant
    tensors: no 'unexpected keys ... scale_weight'. A plain (unscaled) fp8 weight is kept at 8 bits with scale 1."""
    import torch
    from safetensors.torch import save_file
    _, _, bfl, root = klein
    for form in ("scaled_fp8", "comfy_quant"):
        path = root / f"flux2-klein-{form}.safetensors"
        if not path.exists():
            comfy_file(bfl, path, form)
        weights = open_weights(path, mx.float32)
        assert not [k for k in weights if k.endswith(("scaled_fp8", "scale_weight", "weight_scale", "scale_input",
                                                      "input_scale", "comfy_quant"))]
        assert {k for k, v in weights.items() if isinstance(v, Float8Weight)} == \
            {PREFIX + k + ".weight" for k in _quantized_layers(bfl)}
    w = torch.randn(8, 16)
    save_file({"a.weight": w.to(torch.float8_e4m3fn), "b": w[0].to(torch.float8_e4m3fn)}, str(tmp_path / "p.safetensors"))
    plain = open_weights(tmp_path / "p.safetensors", mx.float32)
    assert isinstance(plain["a.weight"], Float8Weight)
    np.testing.assert_array_equal(np.array(plain["a.weight"].dequantize()),
                                  w.to(torch.float8_e4m3fn).float().numpy())
    assert plain["b"].dtype == mx.float32   # a non-linear fp8 tensor: decoded to the compute dtype


@pytest.mark.parametrize("fmt", ["nvfp4", "int8_blockwise", "int8 scale_weight"])
def test_unknown_comfy_quant_format_is_one_line(klein, tmp_path, fmt):
    """nvfp4 (packed uint8 weights, fp8 block scales, a float32 tensor scale), int8 blockwise, and a legacy int8
    file with scale_weight: one line naming the tensor and what it is."""
    import torch
    from safetensors.torch import save_file
    folder, _, bfl, _ = klein
    tensors = {PREFIX + k: v.to(torch.bfloat16).contiguous() for k, v in bfl.items()}
    layer = PREFIX + "double_blocks.0.img_attn.proj"
    rows, cols = bfl["double_blocks.0.img_attn.proj.weight"].shape
    if fmt == "int8 scale_weight":
        tensors[layer + ".weight"] = torch.zeros(rows, cols, dtype=torch.int8)
        tensors[layer + ".scale_weight"] = torch.ones((), dtype=torch.float32)
        tensors[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
        fmt = "I8"
    else:
        tensors[layer + ".weight"] = torch.zeros(rows, cols // 2, dtype=torch.uint8)
        tensors[layer + ".weight_scale"] = torch.ones(rows, cols // 16).to(torch.float8_e4m3fn)
        tensors[layer + ".weight_scale_2"] = torch.ones((), dtype=torch.float32)
        tensors[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()),
                                                       dtype=torch.uint8)
    path = tmp_path / f"flux2-{fmt}.safetensors"
    save_file(tensors, str(path))
    pipe = mlxdiff.load(str(folder), transformer=str(path))
    with pytest.raises(mlxdiff.MlxdiffError) as e:
        pipe.components["transformer"].build()
    message = str(e.value)
    assert "\n" not in message and f"{layer}.weight" in message and fmt in message and "unexpected keys" not in message


# A mid-size FLUX.2 transformer: D = 512, 1 double + 1 single block, every block linear fp8
RESIDENT_CONFIG = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=1, num_single_layers=1,
                       attention_head_dim=128, num_attention_heads=4, joint_attention_dim=640,
                       timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                       rope_theta=2000, eps=1e-6, guidance_embeds=False)


@pytest.mark.parametrize("form", ["scaled_fp8", "comfy_quant"])
def test_resident_bytes_at_the_file_size(tmp_path, form):
    """Built and materialized in float32 (the CPU default), an fp8 file's weights cost at most 1.1x its tensor
    bytes (the fp8 bytes, a float32 scale per row, the bf16 rest), and the header-only estimate says so."""
    import gc
    import torch
    from diffusers import Flux2Transformer2DModel
    with torch.device("meta"):
        shapes = flux2_to_bfl(Flux2Transformer2DModel(**RESIDENT_CONFIG).state_dict(), RESIDENT_CONFIG)
    g = torch.Generator().manual_seed(0)
    bfl = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in shapes.items()}
    _, path = comfy_file(bfl, tmp_path / f"flux2-{form}.safetensors", form)
    del bfl
    file_bytes = sum(tensor_nbytes(path).values())
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    spec = sources.transformer_from_file(path, flux2)
    model = spec.build()
    materialize(model)
    resident = mx.get_active_memory() - base
    estimate = loaded_nbytes(path, mx.float32)
    print(f"{form}: file tensors {file_bytes / 1e6:.1f} MB, resident {resident / 1e6:.1f} MB "
          f"({resident / file_bytes:.3f}x), estimate {estimate / 1e6:.1f} MB")
    assert resident <= 1.1 * file_bytes
    assert abs(estimate - resident) <= 0.01 * resident
    assert sum(isinstance(m, Fp8Linear) for _, m in model.named_modules()) >= 10
    inputs = dict(hidden_states=np.ones((1, 2, 64), np.float32), encoder_hidden_states=np.ones((1, 1, 640),
                  np.float32), timestep=np.array([0.5], np.float32), img_ids=np.zeros((1, 2, 4), np.int32),
                  txt_ids=np.zeros((1, 1, 4), np.int32))
    assert np.isfinite(mlx_forward(model, inputs)).all()


def test_t5xxl_scaled_fp8_text_encoder(tmp_path):
    """A T5 encoder file the way `t5xxl_fp8_e4m3fn_scaled.safetensors` is (top-level `scaled_fp8` marker, the
    blocks' linear weights fp8 with `scale_weight`), here with the shared embedding fp8 too (unscaled: ComfyUI
    casts it), read as SD3.5's t5xxl text encoder file: the linear layers stay fp8 (Fp8Linear), the embedding too
    (Fp8Embedding, only looked-up rows decoded), and the output matches transformers with the decoded weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel
    from mlxdiff.loading.component_files import text_encoder_file
    config = dict(vocab_size=89, d_model=36, d_kv=11, d_ff=44, num_layers=2, num_heads=3,
                  relative_attention_num_buckets=32, relative_attention_max_distance=128,
                  feed_forward_proj="gated-gelu")
    torch.manual_seed(0)
    model = randomize_(T5EncoderModel(T5Config(**config)), seed=2, scale=0.2).eval()
    tensors, decoded = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for name, value in model.state_dict().items():
        value = value.detach().float().contiguous()
        if name == "shared.weight" or name == "encoder.embed_tokens.weight":
            tensors[name] = value.to(torch.float8_e4m3fn)
            decoded[name] = tensors[name].float()
        elif name.endswith(".weight") and value.ndim == 2 and "relative_attention_bias" not in name:
            scale = value.abs().amax() / 448.0
            tensors[name] = (value / scale).to(torch.float8_e4m3fn)
            tensors[name[:-len(".weight")] + ".scale_weight"] = scale.reshape(()).float()
            decoded[name] = tensors[name].float() * scale
        else:
            tensors[name] = value.to(torch.bfloat16)
            decoded[name] = tensors[name].float()
    path = tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors"
    save_file(tensors, str(path))
    model.load_state_dict(decoded)

    spec = text_encoder_file("t5xxl", path)
    ours = spec.build()
    assert sum(isinstance(m, Fp8Linear) for _, m in ours.named_modules()) == 2 * 7
    assert type(ours.shared).__name__ == "Fp8Embedding" and ours.shared.weight.dtype == mx.uint8   # kept at 8 bits
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], size=(2, 23)).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).last_hidden_state.double().numpy()
    out = np.array(ours(mx.array(ids)).astype(mx.float32), np.float64)
    err = max_rel_err(out, ref)
    print(f"t5xxl scaled fp8: max rel err {err:.2e}")
    assert err <= 1e-4
