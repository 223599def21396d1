"""Chroma from the files people have, against diffusers' ChromaPipeline on the same components: lodestones' original
names with ComfyUI's prefix in ComfyUI's folders (models/diffusion_models, models/text_encoders, models/vae), the
files given alone, and a Q8_0 GGUF of the transformer kept quantized (its reference: diffusers' pipeline with gguf-py's
dequantization of the same file, through diffusers' own Chroma converter).

The reference runs get diffusers' prompt embeddings with the mask made boolean, as tests/test_chroma_pipeline.py
explains (diffusers #11724)."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
from conftest import ASSETS, FIXTURES
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from test_chroma_transformer import diffusers_converter
from test_gguf_models import dequantized
from twins import chroma_to_original, diffusers_to_ldm

H, W = 40, 24
LATENT = 6
SEQUENCE = 40
WIDTH = 64          # 2 heads of 32: the RoPE axes (4, 14, 14) that config_from_original infers


def components(seed=3):
    """Sizes whose configs the files' shapes give back (real files have none): T5 with 32 buckets / distance 128
    (t5.config_from_weights' single-file defaults), the transformer's head 32 wide, a VAE with 32 groups. Every
    other width differs: T5 224, its heads 5 x 12, FFN 70; approximator 96 wide over 16 channels."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast
    torch.manual_seed(seed)
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=224, d_kv=12, d_ff=70, num_layers=2, num_heads=5, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32, relative_attention_max_distance=128))
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT, num_layers=1, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=WIDTH // 32, joint_attention_dim=224, axes_dims_rope=(4, 14, 14),
        approximator_num_channels=16, approximator_hidden_dim=96, approximator_layers=2)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((t5, transformer, vae)):
        randomize_(m, seed=seed * 10 + i, scale=0.15)
        m.eval()
    t5_file = FIXTURES / "t5" if (FIXTURES / "t5" / "tokenizer.json").exists() else ASSETS / "t5"
    # FLUX.1-dev's scheduler: what chroma_files takes for files with no folder (pipelines/chroma/files.py)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return dict(transformer=transformer, vae=vae, text_encoder=t5, scheduler=scheduler,
                tokenizer=T5TokenizerFast(tokenizer_file=str(t5_file / "tokenizer.json"), model_max_length=512))


def write_q8_gguf(path, tensors):
    """Q8_0 for every 2-D tensor whose input width is a multiple of its 32-wide blocks, outside the embedders and
    the final layer (as city96's files keep them); the rest F32."""
    from gguf import GGMLQuantizationType as T, GGUFWriter
    from gguf_helpers import encode
    writer, quantized = GGUFWriter(str(path), "chroma"), []
    for name, value in tensors.items():
        value = value.float().numpy()
        if value.ndim == 2 and value.shape[1] % 32 == 0 and not name.startswith(("img_in.", "txt_in.",
                                                                                  "final_layer.")):
            writer.add_tensor(name, encode(value, T.Q8_0), raw_dtype=T.Q8_0)
            quantized.append(name)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from diffusers import ChromaPipeline, ChromaTransformer2DModel
    comps = components()
    pipe = ChromaPipeline(**comps)
    sd = lambda m: {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
    cfg = dict(pipe.transformer.config)
    original = chroma_to_original(sd(pipe.transformer), cfg)
    root = tmp_path_factory.mktemp("chroma_files")
    models = root / "models"
    for d in ("diffusion_models", "text_encoders", "vae", "unet"):
        (models / d).mkdir(parents=True)
    save_file({"model.diffusion_model." + k: v for k, v in original.items()},
              str(models / "diffusion_models" / "chroma-tiny.safetensors"))
    save_file({k: v for k, v in sd(pipe.text_encoder).items() if k != "encoder.embed_tokens.weight"},
              str(models / "text_encoders" / "t5xxl_fp16.safetensors"))
    save_file(diffusers_to_ldm(sd(pipe.vae), 2), str(models / "vae" / "ae.safetensors"))
    gguf = models / "unet" / "chroma-tiny-Q8_0.gguf"
    quantized = write_q8_gguf(gguf, original)
    # the GGUF's reference: the same pipeline with the file's values as gguf-py decodes them
    transformer = ChromaTransformer2DModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    transformer.load_state_dict(diffusers_converter(WIDTH)({k: torch.from_numpy(v)
                                                            for k, v in dequantized(gguf).items()}))
    gguf_pipe = ChromaPipeline(**dict(comps, transformer=transformer.eval()))
    return models, pipe, gguf_pipe, quantized


def reference(pipe, noise, prompt, negative, output_type="np"):
    def embeds(text):
        with torch.no_grad():
            e, m = pipe._get_t5_prompt_embeds(text, max_sequence_length=SEQUENCE)
        return e, m > 0
    (pe, pm), (ne, nm) = embeds(prompt), embeds(negative)
    return pipe(prompt_embeds=pe, prompt_attention_mask=pm, negative_prompt_embeds=ne,
                negative_prompt_attention_mask=nm, height=H, width=W, num_inference_steps=3, guidance_scale=4.0,
                latents=torch.from_numpy(noise), output_type=output_type).images[0]


def reference_latents(pipe, noise, prompt, negative):
    packed = reference(pipe, noise, prompt, negative, "latent")[None]
    return pipe._unpack_latents(packed, H, W, pipe.vae_scale_factor).numpy()


@pytest.mark.parametrize("layout", ["comfyui_folders", "files_alone", "gguf"])
def test_files_match_diffusers(files, layout):
    models, pipe, gguf_pipe, quantized = files
    noise = np.random.default_rng(9).standard_normal((1, (H // 4) * (W // 4), 4 * LATENT)).astype(np.float32)
    given = dict(text_encoders={"t5xxl": str(models / "text_encoders" / "t5xxl_fp16.safetensors")},
                 vae=str(models / "vae" / "ae.safetensors"))
    if layout == "comfyui_folders":
        loaded = mlxdiff.load(str(models / "diffusion_models" / "chroma-tiny.safetensors"))
    elif layout == "files_alone":
        loaded = mlxdiff.load(transformer=str(models / "diffusion_models" / "chroma-tiny.safetensors"), **given)
    else:
        loaded = mlxdiff.load(transformer=str(models / "unet" / "chroma-tiny-Q8_0.gguf"), **given)
    assert loaded.family == "chroma"
    prompt, negative = "a lighthouse at dusk", "blurry"
    ours = loaded.generate(prompt, negative_prompt=negative, width=W, height=H, steps=3, guidance=4.0, latents=noise,
                           max_sequence_length=SEQUENCE, progress_bar=False)
    twin = gguf_pipe if layout == "gguf" else pipe
    ref = reference(twin, noise, prompt, negative)
    diff = np.abs(np.asarray(ours.image).astype(np.float32) / 255.0 - (ref * 255).round() / 255.0).max()
    ref_latents = reference_latents(twin, noise, prompt, negative)
    err = max_rel_err(ours.latents, ref_latents)
    print(f"Chroma {layout}: latents max_rel_err {err:.2e}, image {diff * 255:.1f}/255")
    assert err <= 1e-4
    assert diff <= 2 / 255
    if layout == "gguf":
        # the file's values are what agree: the unquantized pipeline's latents are further off than ours
        moved = max_rel_err(reference_latents(pipe, noise, prompt, negative), ref_latents)
        assert quantized and moved > 10 * max(err, 1e-6), (moved, err)
        import mlx.core as mx
        import mlx.nn as nn
        from mlxdiff.formats.gguf import RawLinear
        model = loaded.components["transformer"].build(mx.float32)     # the weights kept quantized
        kept = sum(isinstance(m, (nn.QuantizedLinear, RawLinear)) for _, m in model.named_modules())
        assert kept >= len(quantized), (kept, len(quantized))

def test_a_missing_part_is_one_line_naming_it(files, tmp_path):
    import shutil
    models = files[0]
    (tmp_path / "diffusion_models").mkdir()
    shutil.copy(models / "diffusion_models" / "chroma-tiny.safetensors", tmp_path / "diffusion_models" / "c.safetensors")
    with pytest.raises(MlxdiffError, match="no t5xxl text encoder found.*text_encoders=") as e:
        mlxdiff.load(str(tmp_path / "diffusion_models" / "c.safetensors"))
    assert "\n" not in str(e.value)
    (tmp_path / "text_encoders").mkdir()
    shutil.copy(models / "text_encoders" / "t5xxl_fp16.safetensors", tmp_path / "text_encoders")
    with pytest.raises(MlxdiffError, match="no FLUX.1 VAE found.*ae.safetensors"):
        mlxdiff.load(str(tmp_path / "diffusion_models" / "c.safetensors"))
    with pytest.raises(MlxdiffError, match="Chroma takes 't5xxl'"):
        mlxdiff.load(transformer=str(models / "diffusion_models" / "chroma-tiny.safetensors"),
                     text_encoders={"clip_l": str(models / "text_encoders" / "t5xxl_fp16.safetensors")})
